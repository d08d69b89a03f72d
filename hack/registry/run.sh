#!/usr/bin/env bash
# Runs a command with the test registry up and the test images pushed, then stops the
# registry (whatever the command's outcome) and exits with the command's status:
#   hack/registry/run.sh cargo test -p ramify-node-agent --test images
# The command sees RAMIFY_REGISTRY_DIR (images.json, credentials.json, dockerconfig.json,
# env; see up.sh) and RAMIFY_REGISTRY (host:port). Placement as for up.sh:
# RAMIFY_REGISTRY_DIR (default <repo>/.ramify/registry), RAMIFY_REGISTRY_PORT (15000).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
(($#)) || { echo "usage: hack/registry/run.sh COMMAND [ARGS...]" >&2; exit 2; }
export RAMIFY_REGISTRY_DIR="${RAMIFY_REGISTRY_DIR:-$repo/.ramify/registry}"
trap '"$here/down.sh" || true' EXIT
RAMIFY_REGISTRY="$("$here/up.sh")"
export RAMIFY_REGISTRY
"$repo/hack/images/build.sh" push >/dev/null
status=0
"$@" || status=$?
exit "$status"
