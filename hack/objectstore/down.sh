#!/usr/bin/env bash
# Stops the object store started by up.sh (by pid) and removes its directory (data,
# credentials, logs). `--keep` stops the process but keeps the directory (a restart
# with up.sh then serves the same objects). Idempotent: nothing running is not an error.
# Environment: RAMIFY_S3_DIR (default <repo>/.ramify/objectstore).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dir="${RAMIFY_S3_DIR:-$repo/.ramify/objectstore}"
keep=false; [[ "${1:-}" == "--keep" ]] && keep=true

# shellcheck source=../lib/daemon.sh
source "$here/../lib/daemon.sh"
stop weed
rm -f "$dir/endpoint" "$dir/run/filer.sock"
if ! $keep; then rm -rf "$dir"; fi
echo "objectstore: stopped" >&2
