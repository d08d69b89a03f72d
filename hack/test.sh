#!/usr/bin/env bash
# The whole test suite (what CI runs): formatting, lints, the CRD drift check, then
# every tier of tests: pure unit, real kube-apiserver (control plane started here
# and stopped at the end), real runsc sandboxes. Nothing is skipped: a missing binary
# fails the run.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
export RAMIFY_CP_DIR="${RAMIFY_CP_DIR:-$repo/.ramify/test-controlplane}"
export RAMIFY_CP_PORT_BASE="${RAMIFY_CP_PORT_BASE:-16540}"
# The object store the snapshot storage tier's tests use (SeaweedFS's S3 gateway).
export RAMIFY_S3_DIR="${RAMIFY_S3_DIR:-$repo/.ramify/test-objectstore}"
export RAMIFY_S3_PORT="${RAMIFY_S3_PORT:-16900}"
step() { printf '\n==> %s\n' "$*"; }

step "dependencies (Debian packages, Go-built control plane; idempotent, cached)"
hack/install-deps.sh

step "toolchain checks"
for tool in cargo go openssl curl; do
  command -v "$tool" >/dev/null || { echo "missing $tool: run hack/install-deps.sh" >&2; exit 1; }
done

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "CRD YAML matches the Rust types"
cargo run -q --locked -p ramify-crds --bin crdgen -- --check crds/yaml

step "helm and a current runsc (built from the Go module proxy, cached)"
hack/helm/build.sh >/dev/null
current_runsc="$(hack/runsc/build.sh)"

step "control plane (etcd + kube-apiserver + kube-controller-manager + kube-scheduler)"
# The real node first (its tests stop it; this is for a run cut short), then the plane.
# The Helm install test has a control plane of its own (it advertises the node IP).
helm_cp=(env RAMIFY_CP_DIR="$repo/.ramify/test-helm/controlplane" RAMIFY_CP_PORT_BASE=16740)
trap 'hack/objectstore/down.sh || true; hack/node/down.sh || true; hack/controlplane/down.sh || true; "${helm_cp[@]}" hack/node/down.sh || true; "${helm_cp[@]}" hack/controlplane/down.sh || true' EXIT
hack/controlplane/up.sh >/dev/null

step "object store (SeaweedFS S3 gateway on 127.0.0.1:$RAMIFY_S3_PORT)"
hack/objectstore/up.sh >/dev/null
# RAMIFY_S3_ENDPOINT, _BUCKET, _REGION, _CREDENTIALS_DIR for the tests.
source "$RAMIFY_S3_DIR/env"

step "cargo build --bins (the end-to-end tests run the real binaries)"
cargo build --workspace --bins --locked

step "cargo test --workspace (node agent on Debian's runsc: $(runsc --version | head -1))"
results="$(mktemp)"
# The fault matrix runs on its own below, with its table printed.
cargo test --workspace --locked -- --include-ignored --skip every_component_killed_at_every_step \
  --skip helm_install_fork_commit_upgrade_uninstall_on_the_real_node 2>&1 | tee -a "$results"

step "fault matrix: node agent, operator and API server killed at every step"
cargo test -p ramify-e2e --locked --test faults -- --nocapture 2>&1 | grep -v '^fault: ' | tee -a "$results"

# Pods reach the API server through the `kubernetes` Service only when the plane
# advertises an address they route to: the node IP (hack/node/up.sh's default).
step "helm install of charts/ramify on the real node, with ramify's images from the local registry"
"${helm_cp[@]}" RAMIFY_CP_ADVERTISE_ADDRESS=10.213.1.1 cargo test -p ramify-e2e --locked --test helm_install -- --nocapture 2>&1 | tee -a "$results"
"${helm_cp[@]}" hack/controlplane/down.sh

step "node agent again on the current runsc ($("$current_runsc" --version | head -1))"
RAMIFY_RUNSC="$current_runsc" cargo test -p ramify-node-agent --locked -- --include-ignored 2>&1 | tee -a "$results"

# Its own state, control plane, ports, network and cgroup parent: a `make demo` already
# running on this machine neither collides with it nor is stopped by its `down`.
step "the demo end to end (make demo), beside any running demo, checked for a committed winner, then every README kubectl ramify example"
test_demo() {
  env RAMIFY_DEMO_DIR="$repo/.ramify/test-demo" RAMIFY_CP_DIR="$repo/.ramify/test-demo/controlplane" \
    RAMIFY_CP_PORT_BASE=16640 RAMIFY_DEMO_METRICS_PORT=18180 RAMIFY_DEMO_BRIDGE=rmytdemo0 \
    RAMIFY_DEMO_SUBNET=10.90.0.0/16 RAMIFY_DEMO_CGROUP_PARENT=/ramify-test-demo RAMIFY_DEMO_REGISTRY_PORT=15200 \
    hack/demo.sh "$@"
}
# Nothing the user's demo owns is the test demo's (the shared rootfs is only read).
shared="$(comm -12 <(env -u RAMIFY_CP_DIR -u RAMIFY_CP_PORT_BASE hack/demo.sh config | cut -d' ' -f2 | sort) \
  <(test_demo config | cut -d' ' -f2 | sort))"
[[ -z "$shared" ]] || { echo "the test's demo shares with a user's demo: $shared" >&2; exit 1; }
demo_log="$(mktemp)"
if ! test_demo >"$demo_log" 2>&1; then
  cat "$demo_log"; test_demo down || true; exit 1
fi
tail -n 12 "$demo_log"
grep -q "winner: fix-b" "$demo_log" || { echo "the demo did not commit fix-b" >&2; test_demo down || true; exit 1; }
grep -q "/work/app.conf: mode=fast" "$demo_log" || { echo "the winner's change is not in the parent" >&2; test_demo down || true; exit 1; }
grep -q "python 3.* sqlite 3" "$demo_log" || { echo "the sandbox from an image did not run python" >&2; test_demo down || true; exit 1; }
# Every `kubectl ramify` example of the README, as printed, against the running demo.
if ! RAMIFY_CP_DIR="$repo/.ramify/test-demo/controlplane" hack/demo-check.sh 2>&1 | tee -a "$demo_log"; then
  echo "a README kubectl ramify example failed against the demo" >&2
  tail -n 20 "$repo/.ramify/test-demo/api.log" >&2 || true
  test_demo down || true; exit 1
fi
test_demo down
echo "test result: ok. 2 passed; 0 failed; 0 ignored (make demo, README examples)" >>"$results"

# One closing line for the whole run.
passed=$(grep -o '[0-9]* passed' "$results" | awk '{s+=$1} END {print s+0}')
failed=$(grep -o '[0-9]* failed' "$results" | awk '{s+=$1} END {print s+0}')
echo
echo "ramify: $passed passed, $failed failed"
