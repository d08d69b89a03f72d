#!/usr/bin/env bash
# The embedded default: a local control plane, the ramify operator, one node agent
# (standalone mode, real runsc) and ramify-api (the aggregated API behind
# `kubectl ramify exec|logs|diff`), then a live sandbox forked three ways and the
# winner committed. `hack/demo.sh down` stops everything and removes its state;
# `hack/demo.sh config` prints what this demo owns (directories, ports, network, cgroup).
#
# A second demo beside a running one (what `make test` runs) sets RAMIFY_DEMO_DIR and
# gets its own state, control plane directory, agent state, rootfs cache, ports,
# bridge, subnet and cgroup parent, so neither its start nor its `down` touches the
# first:
#   RAMIFY_DEMO_DIR          state directory (pid files, logs); default .ramify/demo
#   RAMIFY_CP_DIR            control plane directory; default .ramify/controlplane, or
#                            $RAMIFY_DEMO_DIR/controlplane when RAMIFY_DEMO_DIR is set
#   RAMIFY_CP_PORT_BASE      control plane ports (hack/controlplane/up.sh); ramify-api
#                            listens on base+6
#   RAMIFY_DEMO_METRICS_PORT operator metrics port; the agent's is the next one (18080)
#   RAMIFY_DEMO_BRIDGE, RAMIFY_DEMO_SUBNET, RAMIFY_DEMO_CGROUP_PARENT
#                            sandbox network and cgroup parent (ramify0, 10.88.0.0/16, /ramify)
# The busybox root file system the RootfsClass names is shared, read-only (it is only
# written when missing or different).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
if [[ -n "${RAMIFY_DEMO_DIR:-}" ]]; then
  state="$RAMIFY_DEMO_DIR"
  export RAMIFY_CP_DIR="${RAMIFY_CP_DIR:-$state/controlplane}"
  agent_state="$state/agent"
else
  state="$repo/.ramify/demo"
  export RAMIFY_CP_DIR="${RAMIFY_CP_DIR:-$repo/.ramify/controlplane}"
  agent_state="/var/lib/ramify/demo-agent"
fi
operator_metrics="127.0.0.1:${RAMIFY_DEMO_METRICS_PORT:-18080}"
agent_metrics="127.0.0.1:$(( ${RAMIFY_DEMO_METRICS_PORT:-18080} + 1 ))"
bridge="${RAMIFY_DEMO_BRIDGE:-ramify0}"
subnet="${RAMIFY_DEMO_SUBNET:-10.88.0.0/16}"
cgroup_parent="${RAMIFY_DEMO_CGROUP_PARENT:-/ramify}"
node="$(hostname)"
# ramify-api's port: next to the control plane's (hack/controlplane/up.sh uses base+0..5).
api_port=$(( ${RAMIFY_CP_PORT_BASE:-16440} + 6 ))
# The local OCI registry of the image step (it also takes the next port).
registry_port="${RAMIFY_DEMO_REGISTRY_PORT:-15100}"
registry_dir="$state/registry"
# The agent's only rootfs root (the RootfsClass `busybox` points inside it) and its
# cache of unpacked OCI layouts; neither overlaps the agent's state.
rootfs_root="/var/lib/ramify/rootfs"
rootfs="$rootfs_root/busybox"
if [[ -n "${RAMIFY_DEMO_DIR:-}" ]]; then
  rootfs_cache="$state/rootfs-cache"
else
  rootfs_cache="/var/lib/ramify/demo-rootfs-cache"
fi
say() { printf '\033[1m==> %s\033[0m\n' "$*"; }

if [[ "${1:-}" == "config" ]]; then
  printf 'state %s\ncontrolplane %s\ncontrolplane-ports %s\napi-port %s\nagent-state %s\nrootfs-cache %s\noperator-metrics %s\nagent-metrics %s\nbridge %s\nsubnet %s\ncgroup-parent %s\nregistry-port %s\n' \
    "$state" "$RAMIFY_CP_DIR" "${RAMIFY_CP_PORT_BASE:-16440}" "$api_port" "$agent_state" "$rootfs_cache" \
    "$operator_metrics" "$agent_metrics" "$bridge" "$subnet" "$cgroup_parent" "$registry_port"
  exit 0
fi

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
  RAMIFY_REGISTRY_DIR="$registry_dir" hack/registry/down.sh >/dev/null 2>&1 || true
  if [[ -x target/debug/ramify-node-agent ]]; then
    target/debug/ramify-node-agent cleanup --state-dir "$agent_state" || true
  fi
  hack/controlplane/down.sh
  rm -rf "$state" "$agent_state" "$rootfs_cache"
  # Its bridge and its cgroup parent (empty now: every sandbox is gone) go too.
  ip link delete "$bridge" 2>/dev/null || true
  for h in /sys/fs/cgroup/*/; do rmdir "$h${cgroup_parent#/}" 2>/dev/null || true; done
  say "stopped; nothing left running"
  exit 0
fi

if [[ $EUID -ne 0 ]]; then echo "the demo runs gVisor sandboxes and network namespaces: run it as root" >&2; exit 1; fi
say "installing what the demo needs (Debian packages, control plane, runsc, registry from the Go module proxy; cached after the first run)"
# shellcheck source=hack/lib/cargo-target.sh
source hack/lib/cargo-target.sh
hack/install-deps.sh --demo
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
# Another demo's sandboxes may run on it: write it only when it is missing or differs.
if ! cmp -s /bin/busybox "$rootfs/bin/busybox"; then
  target/debug/ramify-node-agent rootfs --out "$rootfs" >/dev/null
fi
kubectl apply -f config/samples/rootfsclass.yaml >/dev/null

say "starting the operator, the node agent ($node) and ramify-api (subresources.ramify.dev)"
stop_pid api; stop_pid operator; stop_pid node-agent
pki="$(hack/pki.sh "$state/pki" ramify-system)"
setsid target/debug/ramify-operator --metrics-addr "$operator_metrics" >"$state/operator.log" 2>&1 </dev/null &
echo $! >"$state/operator.pid"
# Its endpoint (exec, log, diff) serves ramify-api's client certificate only.
setsid target/debug/ramify-node-agent --runsc "$runsc_bin" run --node-name "$node" --state-dir "$agent_state" \
  --metrics-addr "$agent_metrics" --bridge "$bridge" --subnet "$subnet" --cgroup-parent "$cgroup_parent" \
  --rootfs-root "$rootfs_root" --rootfs-cache "$rootfs_cache" --insecure-registry loopback --endpoint-listen 127.0.0.1:0 \
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

say "a local OCI registry on 127.0.0.1:$registry_port with test images (hack/registry, hack/images)"
export RAMIFY_REGISTRY_DIR="$registry_dir" RAMIFY_REGISTRY_PORT="$registry_port"
hack/registry/up.sh >/dev/null
hack/images/build.sh push >/dev/null
unset RAMIFY_REGISTRY_DIR RAMIFY_REGISTRY_PORT

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
echo "   (times of the debug builds make demo runs, on this machine; the images ship release builds: make bench measures those)"
printf 'BRANCH\tPHASE\tVERDICT\tFORK-MS\tRUN-MS\tWHY\n'
kubectl get branchset try-fixes -o jsonpath='{range .status.branches[*]}{.name}{"\t"}{.phase}{"\t"}{.verdict}{"\t"}{.forkMillis}{"\t"}{.runMillis}{"\t"}{.reason}{"\n"}{end}'
echo
winner="$(kubectl get branchset try-fixes -o jsonpath='{.status.winner}')"
say "winner: $winner — committed into workspace; the other branches are gone"
echo "   /work/app.conf: $(exec_in workspace cat /work/app.conf)   counter: $(exec_in workspace cat /work/counter) (still counting: the winner's live process is the workspace now)"

say "a sandbox from a container image (config/samples/sandbox-image.yaml): Debian with python3 and sqlite3"
kubectl delete sandbox py --ignore-not-found --wait=true >/dev/null
sed "s#127.0.0.1:15100/#127.0.0.1:$registry_port/#" config/samples/sandbox-image.yaml | kubectl apply -f - >/dev/null
kubectl wait sandbox/py --for=jsonpath='{.status.phase}'=Running --timeout=300s >/dev/null || {
  kubectl get sandbox py -o yaml; tail -n 30 "$state/node-agent.log"; exit 1; }
echo "   image: $(kubectl get sandbox py -o jsonpath='{.spec.image}')@$(kubectl get sandbox py -o jsonpath='{.status.imageDigest}' | cut -c1-19)…"
echo "   $(exec_in py python3 -c 'import sqlite3, sys; print("python", sys.version.split()[0], "sqlite", sqlite3.sqlite_version)')"
echo
echo "Explore:   export KUBECONFIG=$RAMIFY_CP_DIR/kubeconfig PATH=$(dirname "$(command -v kubectl)"):$repo/target/debug:\$PATH"
echo "           kubectl get sandboxes,snapshots,branchsets; kubectl ramify status workspace (README.md: Quickstart)"
echo "Check:     hack/demo-check.sh (runs the commands of README.md and docs/ against this demo)"
echo "Stop:      make down"
