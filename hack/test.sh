#!/usr/bin/env bash
# The whole test suite (what CI runs): formatting, lints, the CRD drift check, the builds,
# then every test binary of every tier (pure unit, real kube-apiserver, real runsc, real
# node, the system as processes, the fault matrix, Helm, the node agent again on the
# current runsc, the benches once each with their smallest settings, the demo and the
# commands of README.md and docs/) in two lanes at once (hack/testrun.py says how they
# are kept apart).
# Nothing is skipped: a missing binary fails the run. Every step and every test binary
# runs whatever failed before it; the run ends with a table of where the time went, the
# 20 slowest tests, every failure, and one closing line.
#
#   hack/test.sh                 everything
#   hack/test.sh --only NAME     the builds, then only the test binaries whose job name
#                                contains NAME (repeatable): e.g. --only ramify-e2e/system,
#                                --only ramify-node-agent (see the table for the names)
#   RAMIFY_TEST_LANES=1          one lane (half the machine's load, about twice the time)
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
cache="${RAMIFY_CACHE:-$HOME/.cache/ramify}"
only=()
while (($#)); do
  case "$1" in
    --only) only+=(--only "$2"); shift 2 ;;
    *) echo "usage: hack/test.sh [--only NAME]..." >&2; exit 2 ;;
  esac
done
report="$repo/.ramify/test-report"
rm -rf "$report"; mkdir -p "$report"
steps="$report/steps.tsv"
failed_steps=0
# step NAME COMMAND...: runs and times one step; a failure is counted, and the run goes on.
step() {
  local name="$1"; shift
  printf '\n==> %s\n' "$name"
  local t0=$EPOCHREALTIME rc=0
  "$@" || rc=$?
  local secs; secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN {printf "%.1f", b - a}')
  if ((rc == 0)); then printf '%s\t%s\tok\n' "$name" "$secs" >>"$steps"
  else printf '%s\t%s\tFAILED\n' "$name" "$secs" >>"$steps"; failed_steps=$((failed_steps + 1)); echo "==> FAILED: $name (exit $rc)"; fi
  return "$rc"
}
# must NAME COMMAND...: a step nothing after it can do without.
must() { step "$@" || { echo "ramify: 0 passed, 1 failed"; exit 1; }; }

# Compiled artifacts outlive the clone (CI runs in a fresh one): see hack/lib/cargo-target.sh.
# shellcheck source=hack/lib/cargo-target.sh
source hack/lib/cargo-target.sh

must "dependencies (Debian packages, Go-built test bed; cached)" hack/install-deps.sh
for tool in cargo go openssl curl python3; do
  command -v "$tool" >/dev/null || { echo "missing $tool: run hack/install-deps.sh" >&2; exit 1; }
done
step "cargo fmt --check" cargo fmt --all -- --check
step "cargo clippy --all-targets -- -D warnings" cargo clippy --workspace --all-targets --locked -- -D warnings
step "CRD YAML matches the Rust types" cargo run -q --locked -p ramify-crds --bin crdgen -- --check crds/yaml
step "docs/api-reference.md matches the CRDs" cargo run -q --locked -p ramify-crds --bin crdgen -- --check-docs docs/api-reference.md
step "docs: every relative link and anchor resolves" python3 hack/doc-links.py
step "no two files of a crate import each other" python3 hack/import-cycles.py
step "docs: every command block says whether the demo check runs it" python3 hack/doc-blocks.py check
# A test binary reused from another clone of this tree (hack/lib/cargo-target.sh) must not
# look for the repository where it was compiled: every path is found at run time.
step "no compile-time repository paths (binaries are reused across clones)" \
  bash -c '! git grep -n "env!(\"CARGO_MANIFEST_DIR\")" -- "*.rs"'
must "helm and a current runsc (Go module proxy, cached)" hack/helm/build.sh
current_runsc="$(hack/runsc/build.sh)" || exit 1
step "runsc patches: their Go tests (hack/runsc/patches)" hack/runsc/build.sh --test
must "cargo build --bins (the end-to-end tests run the real binaries)" cargo build --workspace --bins --locked
must "cargo test --no-run (every test binary)" cargo test --workspace --locked --no-run
# Every profile this tree needs is built: a fresh clone of it reuses them (cargo-target.sh).
ramify_record_built_tree

lanes="${RAMIFY_TEST_LANES:-2}"
# lane_env K: the control plane, object store and e2e names of lane K.
lane_env() {
  local k="$1" sfx=""; ((k == 0)) || sfx="-lane$k"
  echo "RAMIFY_E2E_LANE=$k"
  # The lanes' control planes share the cores as equals: given priority they answered
  # the lanes' polling faster and the suite ran longer (system 275 -> 515 s, cluster
  # 516 -> 639 s). The load test, alone after the lanes, has one of its own at priority
  # (hack/testrun.py), as a control plane on machines of its own would.
  echo "RAMIFY_CP_NICE=0"
  echo "RAMIFY_CP_DIR=$repo/.ramify/test-controlplane$sfx"
  echo "RAMIFY_CP_PORT_BASE=$((16540 + 300 * k))"
  echo "RAMIFY_S3_DIR=$repo/.ramify/test-objectstore$sfx"
  echo "RAMIFY_S3_PORT=$((16900 + 20 * k))"
}
teardown() {
  for ((k = 0; k < lanes; k++)); do
    (eval "export $(lane_env "$k" | tr '\n' ' ')"; hack/objectstore/down.sh; hack/controlplane/down.sh) >/dev/null 2>&1 || true
  done
  hack/node/down.sh >/dev/null 2>&1 || true
  RAMIFY_CP_DIR="$repo/.ramify/test-helm/controlplane" RAMIFY_CP_PORT_BASE=16740 hack/node/down.sh >/dev/null 2>&1 || true
  RAMIFY_CP_DIR="$repo/.ramify/test-helm/controlplane" RAMIFY_CP_PORT_BASE=16740 hack/controlplane/down.sh >/dev/null 2>&1 || true
  RAMIFY_CP_DIR="$repo/.ramify/test-solo/controlplane" RAMIFY_CP_PORT_BASE=17140 hack/controlplane/down.sh >/dev/null 2>&1 || true
  hack/test-sweep.sh || true
}
trap teardown EXIT
# A run cut short leaves the real node up: its tests start it again.
hack/node/down.sh >/dev/null 2>&1 || true
lanes_up() {
  local k pids=()
  for ((k = 0; k < lanes; k++)); do
    (
      eval "export $(lane_env "$k" | tr '\n' ' ')"
      hack/controlplane/up.sh >/dev/null && hack/objectstore/up.sh >/dev/null
    ) > >(sed "s/^/[lane $k] /") 2>&1 &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  ((rc == 0)) || return 1
  for ((k = 0; k < lanes; k++)); do
    local s3_dir; s3_dir="$(lane_env "$k" | sed -n 's/^RAMIFY_S3_DIR=//p')"
    { lane_env "$k"; sed 's/^export //' "$s3_dir/env"; } >"$report/lane-$k.env"
  done
}
must "control planes and object stores, one per lane ($lanes)" lanes_up

printf '\n==> the test binaries, %s lanes (logs in %s)\n' "$lanes" "$report"
rc=0
lane_files=()
for ((k = 0; k < lanes; k++)); do lane_files+=(--lane "$report/lane-$k.env"); done
python3 hack/testrun.py "${lane_files[@]}" --report "$report" --steps "$steps" \
  --times "$cache/test-times.tsv" --current-runsc "$current_runsc" "${only[@]}" || rc=$?
read -r passed failed < "$report/counts" 2>/dev/null || { passed=0; failed=1; }
echo
echo "ramify: $passed passed, $((failed + failed_steps)) failed"
((rc == 0 && failed_steps == 0))
