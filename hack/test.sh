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
trap 'hack/controlplane/down.sh || true' EXIT
hack/controlplane/up.sh >/dev/null

step "cargo build --bins (the end-to-end tests run the real binaries)"
cargo build --workspace --bins --locked

step "cargo test --workspace (node agent on Debian's runsc: $(runsc --version | head -1))"
results="$(mktemp)"
# The fault matrix runs on its own below, with its table printed.
cargo test --workspace --locked -- --include-ignored --skip every_component_killed_at_every_step 2>&1 | tee -a "$results"

step "fault matrix: node agent, operator and API server killed at every step"
cargo test -p ramify-e2e --locked --test faults -- --nocapture 2>&1 | grep -v '^fault: ' | tee -a "$results"

step "node agent again on the current runsc ($("$current_runsc" --version | head -1))"
RAMIFY_RUNSC="$current_runsc" cargo test -p ramify-node-agent --locked -- --include-ignored 2>&1 | tee -a "$results"

# Its own ports, so a demo already running on this machine does not collide.
step "the demo end to end (make demo), checked for a committed winner, then every README kubectl ramify example"
demo_log="$(mktemp)"
if ! env -u RAMIFY_CP_DIR RAMIFY_CP_PORT_BASE=16640 hack/demo.sh >"$demo_log" 2>&1; then
  cat "$demo_log"; env -u RAMIFY_CP_DIR RAMIFY_CP_PORT_BASE=16640 hack/demo.sh down || true; exit 1
fi
tail -n 12 "$demo_log"
grep -q "winner: fix-b" "$demo_log" || { echo "the demo did not commit fix-b" >&2; env -u RAMIFY_CP_DIR RAMIFY_CP_PORT_BASE=16640 hack/demo.sh down || true; exit 1; }
grep -q "/work/app.conf: mode=fast" "$demo_log" || { echo "the winner's change is not in the parent" >&2; env -u RAMIFY_CP_DIR RAMIFY_CP_PORT_BASE=16640 hack/demo.sh down || true; exit 1; }
# Every `kubectl ramify` example of the README, as printed, against the running demo.
if ! env -u RAMIFY_CP_DIR RAMIFY_CP_PORT_BASE=16640 hack/demo-check.sh 2>&1 | tee -a "$demo_log"; then
  echo "a README kubectl ramify example failed against the demo" >&2
  tail -n 20 .ramify/demo/api.log >&2 || true
  env -u RAMIFY_CP_DIR RAMIFY_CP_PORT_BASE=16640 hack/demo.sh down || true; exit 1
fi
env -u RAMIFY_CP_DIR RAMIFY_CP_PORT_BASE=16640 hack/demo.sh down
echo "test result: ok. 2 passed; 0 failed; 0 ignored (make demo, README examples)" >>"$results"

# One closing line for the whole run.
passed=$(grep -o '[0-9]* passed' "$results" | awk '{s+=$1} END {print s+0}')
failed=$(grep -o '[0-9]* failed' "$results" | awk '{s+=$1} END {print s+0}')
echo
echo "ramify: $passed passed, $failed failed"
