#!/usr/bin/env bash
# Stops the registry started by up.sh (by pid) and removes its directory (storage,
# credentials, logs). `--keep` stops the processes but keeps the directory;
# `--if-owner PID` does nothing unless PID owns it (up.sh's RAMIFY_REGISTRY_OWNER):
# a test process's reaper never stops the registry a later process took over.
# Idempotent: nothing running is not an error.
# Environment: RAMIFY_REGISTRY_DIR (default <repo>/.ramify/registry).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dir="${RAMIFY_REGISTRY_DIR:-$repo/.ramify/registry}"
keep=false owner=""
while (($#)); do
  case "$1" in
    --keep) keep=true ;;
    --if-owner) owner="$2"; shift ;;
    *) echo "registry: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if [[ -z "${RAMIFY_REGISTRY_LOCKED:-}" ]]; then
  mkdir -p "$(dirname "$dir")"
  exec 9>"$dir.lock"
  flock 9
fi
if [[ -n "$owner" && "$(cat "$dir/owner" 2>/dev/null)" != "$owner" ]]; then
  echo "registry: left running (owned by $(cat "$dir/owner" 2>/dev/null || echo nobody), not $owner)" >&2
  exit 0
fi

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
