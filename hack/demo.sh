#!/usr/bin/env bash
# The embedded default: a local control plane, the ramify operator and one node agent
# (standalone mode, real runsc), then a live sandbox forked three ways and the winner
# committed. `hack/demo.sh down` stops everything and removes its state.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
state="$repo/.ramify/demo"
export RAMIFY_CP_DIR="${RAMIFY_CP_DIR:-$repo/.ramify/controlplane}"
node="$(hostname)"
agent_state="/var/lib/ramify/demo-agent"
# The agent's only rootfs root (the RootfsClass `busybox` points inside it) and its
# cache of unpacked OCI layouts; neither overlaps the agent's state.
rootfs_root="/var/lib/ramify/rootfs"
rootfs="$rootfs_root/busybox"
rootfs_cache="/var/lib/ramify/demo-rootfs-cache"
say() { printf '\033[1m==> %s\033[0m\n' "$*"; }

stop_pid() {
  local f="$state/$1.pid"
  [[ -f "$f" ]] || return 0
  local pid; pid="$(cat "$f")"
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$f"
}

if [[ "${1:-}" == "down" ]]; then
  if [[ -f "$RAMIFY_CP_DIR/env" ]]; then
    # shellcheck disable=SC1091
    source "$RAMIFY_CP_DIR/env"
    say "deleting ramify objects (the node agent removes their sandboxes)"
    kubectl delete branchsets,snapshots,sandboxes --all --all-namespaces --wait=true --timeout=60s >/dev/null 2>&1 || true
    kubectl delete rootfsclasses --all --wait=true --timeout=30s >/dev/null 2>&1 || true
  fi
  stop_pid operator
  stop_pid node-agent
  if [[ -x target/debug/ramify-node-agent ]]; then
    target/debug/ramify-node-agent cleanup --state-dir "$agent_state" || true
  fi
  hack/controlplane/down.sh
  rm -rf "$state" "$agent_state" "$rootfs_cache"
  say "stopped; nothing left running"
  exit 0
fi

if [[ $EUID -ne 0 ]]; then echo "the demo runs gVisor sandboxes and network namespaces: run it as root" >&2; exit 1; fi
say "installing dependencies (Debian packages, control plane from the Go module proxy; cached after the first run)"
hack/install-deps.sh
say "building ramify (cargo build) and a current runsc (Go module proxy, cached)"
cargo build --bins -q
runsc_bin="$(hack/runsc/build.sh)"
mkdir -p "$state"
say "starting the control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler)"
hack/controlplane/up.sh >/dev/null
# shellcheck disable=SC1091
source "$RAMIFY_CP_DIR/env"
kubectl apply --server-side --field-manager ramify-demo -f crds/yaml/ramify.dev.yaml >/dev/null
kubectl wait --for condition=Established crd/sandboxes.ramify.dev crd/snapshots.ramify.dev crd/branchsets.ramify.dev crd/rootfsclasses.ramify.dev --timeout=60s >/dev/null
kubectl create namespace ramify-system --dry-run=client -o yaml | kubectl apply -f - >/dev/null

say "preparing a busybox root file system at $rootfs, declared as RootfsClass busybox (config/samples/rootfsclass.yaml)"
target/debug/ramify-node-agent rootfs --out "$rootfs" >/dev/null
kubectl apply -f config/samples/rootfsclass.yaml >/dev/null

say "starting the operator and the node agent ($node)"
stop_pid operator; stop_pid node-agent
setsid target/debug/ramify-operator --metrics-addr 127.0.0.1:18080 >"$state/operator.log" 2>&1 </dev/null &
echo $! >"$state/operator.pid"
setsid target/debug/ramify-node-agent --runsc "$runsc_bin" run --node-name "$node" --state-dir "$agent_state" \
  --rootfs-root "$rootfs_root" --rootfs-cache "$rootfs_cache" \
  --metrics-addr 127.0.0.1:18081 >"$state/node-agent.log" 2>&1 </dev/null &
echo $! >"$state/node-agent.pid"

say "a live workspace: counting in memory, config on disk (config/samples/sandbox.yaml)"
kubectl delete branchset try-fixes --ignore-not-found --wait=true >/dev/null
kubectl apply -f config/samples/sandbox.yaml >/dev/null
kubectl wait sandbox/workspace --for=jsonpath='{.status.phase}'=Running --timeout=120s >/dev/null
exec_in() { target/debug/ramify-node-agent --runsc "$runsc_bin" exec --state-dir "$agent_state" "default/$1" -- "${@:2}"; }
echo "   /work/app.conf: $(exec_in workspace cat /work/app.conf)   counter: $(exec_in workspace cat /work/counter)"

say "forking it three ways (config/samples/branchset.yaml): the first branch whose check passes wins"
kubectl apply -f config/samples/branchset.yaml >/dev/null
kubectl wait branchset/try-fixes --for=jsonpath='{.status.phase}'=Committed --timeout=180s >/dev/null || {
  kubectl get branchset try-fixes -o yaml; tail -n 30 "$state/node-agent.log"; exit 1; }
kubectl get snapshot try-fixes-base -o custom-columns='SNAPSHOT:.metadata.name,SIZE:.status.sizeBytes,CAPTURE-MS:.status.captureMillis,SOURCE-PAUSE-MS:.status.sourcePauseMillis,RUNSC:.status.runscVersion'
echo
printf 'BRANCH\tPHASE\tVERDICT\tFORK-MS\tRUN-MS\tWHY\n'
kubectl get branchset try-fixes -o jsonpath='{range .status.branches[*]}{.name}{"\t"}{.phase}{"\t"}{.verdict}{"\t"}{.forkMillis}{"\t"}{.runMillis}{"\t"}{.reason}{"\n"}{end}'
echo
winner="$(kubectl get branchset try-fixes -o jsonpath='{.status.winner}')"
say "winner: $winner — committed into workspace; the other branches are gone"
echo "   /work/app.conf: $(exec_in workspace cat /work/app.conf)   counter: $(exec_in workspace cat /work/counter) (still counting: the winner's live process is the workspace now)"
echo
echo "Explore:   export KUBECONFIG=$RAMIFY_CP_DIR/kubeconfig PATH=$(dirname "$(command -v kubectl)"):\$PATH"
echo "           kubectl get sandboxes,snapshots,branchsets; kubectl describe branchset try-fixes"
echo "Stop:      make down"
