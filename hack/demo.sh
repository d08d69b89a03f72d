#!/usr/bin/env bash
# The embedded default: a local control plane, the ramify operator, one node agent
# (standalone mode, real runsc) and ramify-api (the aggregated API behind
# `kubectl ramify exec|logs|diff`), then a live sandbox forked three ways and the
# winner committed. `hack/demo.sh down` stops everything and removes its state.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
state="$repo/.ramify/demo"
export RAMIFY_CP_DIR="${RAMIFY_CP_DIR:-$repo/.ramify/controlplane}"
node="$(hostname)"
agent_state="/var/lib/ramify/demo-agent"
# ramify-api's port: next to the control plane's (hack/controlplane/up.sh uses base+0..5).
api_port=$(( ${RAMIFY_CP_PORT_BASE:-16440} + 6 ))
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
  stop_pid api
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

say "starting the operator, the node agent ($node) and ramify-api (subresources.ramify.dev)"
stop_pid api; stop_pid operator; stop_pid node-agent
pki="$(hack/pki.sh "$state/pki" ramify-system)"
setsid target/debug/ramify-operator --metrics-addr 127.0.0.1:18080 >"$state/operator.log" 2>&1 </dev/null &
echo $! >"$state/operator.pid"
# Its endpoint (exec, log, diff) serves ramify-api's client certificate only.
setsid target/debug/ramify-node-agent --runsc "$runsc_bin" run --node-name "$node" --state-dir "$agent_state" \
  --rootfs-root "$rootfs_root" --rootfs-cache "$rootfs_cache" \
  --metrics-addr 127.0.0.1:18081 --endpoint-listen 127.0.0.1:0 \
  --endpoint-cert "$pki/agent.crt" --endpoint-key "$pki/agent.key" --endpoint-client-ca "$pki/ca.crt" \
  >"$state/node-agent.log" 2>&1 </dev/null &
echo $! >"$state/node-agent.pid"
setsid target/debug/ramify-api --listen "127.0.0.1:$api_port" \
  --tls-cert "$pki/api-serving.crt" --tls-key "$pki/api-serving.key" \
  --agent-ca "$pki/ca.crt" --agent-client-cert "$pki/api-client.crt" --agent-client-key "$pki/api-client.key" \
  >"$state/api.log" 2>&1 </dev/null &
echo $! >"$state/api.pid"
# (The API server warns that FQDN EndpointSlices are deprecated: expected here, see
# hack/apiservice.sh.)
hack/apiservice.sh ramify-system "$api_port" "$pki/ca.crt" | kubectl apply -f - 2>&1 >/dev/null |
  { grep -v 'FQDN endpoints are deprecated' >&2 || true; }
# The roles the chart ships: `edit`/`view` in a namespace then cover exec, logs, diff.
kubectl apply -f config/rbac/user-roles.yaml >/dev/null
kubectl wait apiservice/v1alpha1.subresources.ramify.dev --for=condition=Available --timeout=60s >/dev/null || {
  kubectl get apiservice v1alpha1.subresources.ramify.dev -o yaml; tail -n 20 "$state/api.log"; exit 1; }

say "a live workspace: counting in memory, config on disk (config/samples/sandbox.yaml)"
kubectl delete branchset try-fixes --ignore-not-found --wait=true >/dev/null
kubectl apply -f config/samples/sandbox.yaml >/dev/null
kubectl wait sandbox/workspace --for=jsonpath='{.status.phase}'=Running --timeout=120s >/dev/null
# Through the API server, as any user: `kubectl ramify exec` (RBAC: sandboxes/exec).
exec_in() { target/debug/kubectl-ramify exec "$1" -- "${@:2}"; }
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
echo "Explore:   export KUBECONFIG=$RAMIFY_CP_DIR/kubeconfig PATH=$(dirname "$(command -v kubectl)"):$repo/target/debug:\$PATH"
echo "           kubectl get sandboxes,snapshots,branchsets; kubectl ramify status workspace (README: kubectl ramify)"
echo "Check:     hack/demo-check.sh (runs every kubectl ramify example of the README)"
echo "Stop:      make down"
