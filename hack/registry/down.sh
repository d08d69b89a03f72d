#!/usr/bin/env bash
# Stops the registry started by up.sh (by pid) and removes its directory (storage,
# credentials, logs). `--keep` stops the processes but keeps the directory.
# Idempotent: nothing running is not an error.
# Environment: RAMIFY_REGISTRY_DIR (default <repo>/.ramify/registry).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dir="${RAMIFY_REGISTRY_DIR:-$repo/.ramify/registry}"
keep=false; [[ "${1:-}" == "--keep" ]] && keep=true

# The front first, so no client reaches a registry that is going away.
for name in regfront registry; do
  pidfile="$dir/run/$name.pid"
  [[ -f "$pidfile" ]] || continue
  pid="$(cat "$pidfile")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
done
rm -f "$dir/addr"
if ! $keep; then rm -rf "$dir"; fi
echo "registry: stopped" >&2
