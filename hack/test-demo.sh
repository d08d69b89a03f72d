#!/usr/bin/env bash
# The demo end to end, as `make test` runs it: `make demo` with a state, control plane,
# ports, bridge, subnet and cgroup parent of its own (beside any demo a user runs; nothing
# of theirs is shared or stopped), checked for its committed winner, then the commands and
# manifests of README.md and docs/ against it (hack/demo-check.sh), then `down`.
# Prints libtest's closing line so the suite counts it.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
test_demo() {
  env RAMIFY_DEMO_DIR="$repo/.ramify/test-demo" RAMIFY_CP_DIR="$repo/.ramify/test-demo/controlplane" \
    RAMIFY_CP_PORT_BASE=16640 RAMIFY_DEMO_METRICS_PORT=18180 RAMIFY_DEMO_BRIDGE=rmytdemo0 \
    RAMIFY_DEMO_SUBNET=10.90.0.0/16 RAMIFY_DEMO_CGROUP_PARENT=/ramify-test-demo RAMIFY_DEMO_REGISTRY_PORT=15200 \
    hack/demo.sh "$@"
}
fail() { echo "$*" >&2; test_demo down || true; echo "test result: FAILED. 0 passed; 1 failed"; exit 1; }
# Nothing the user's demo owns is the test demo's (the shared rootfs is only read).
shared="$(comm -12 <(env -u RAMIFY_CP_DIR -u RAMIFY_CP_PORT_BASE hack/demo.sh config | cut -d' ' -f2 | sort) \
  <(test_demo config | cut -d' ' -f2 | sort))"
[[ -z "$shared" ]] || fail "the test's demo shares with a user's demo: $shared"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if ! test_demo >"$log" 2>&1; then cat "$log"; fail "make demo failed"; fi
tail -n 14 "$log"
grep -q "winner: fix-b" "$log" || fail "the demo did not commit fix-b"
grep -q "/work/app.conf: mode=fast" "$log" || fail "the winner's change is not in the parent"
grep -q "python 3.* sqlite 3" "$log" || fail "the sandbox from an image did not run python"
if ! RAMIFY_CP_DIR="$repo/.ramify/test-demo/controlplane" RAMIFY_DEMO_METRICS_PORT=18180 hack/demo-check.sh; then
  tail -n 20 "$repo/.ramify/test-demo/api.log" >&2 || true
  fail "a command or manifest of README.md or docs/ failed against the demo"
fi
test_demo down
echo "test result: ok. 2 passed; 0 failed; 0 ignored (make demo, the docs' commands)"
