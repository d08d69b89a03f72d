#!/usr/bin/env bash
# Stops the control plane started by up.sh and removes its directory (certificates,
# etcd data, logs). `--keep` stops the processes but keeps the directory.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dir="${RAMIFY_CP_DIR:-$repo/.ramify/controlplane}"
keep=false; [[ "${1:-}" == "--keep" ]] && keep=true

# Reverse start order so clients go before the server they talk to.
for name in kube-scheduler kube-controller-manager kube-apiserver etcd; do
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
if ! $keep; then rm -rf "$dir"; fi
echo "controlplane: stopped" >&2
