#!/usr/bin/env bash
# The benchmarks (`make bench`): every bench binary and the two benchmarks written as
# tests, each printing its medians beside the baseline it beats, with release builds of
# the operator and node agent (RAMIFY_PROFILE=release) on a control plane, object store
# and bridge of their own (so a running demo or test run is not disturbed). Run it on a
# quiet machine: the figures are only as good as the machine is idle.
#
#   hack/bench.sh                 all of them, in full (about 40 minutes on 2 cores)
#   hack/bench.sh NAME...         only these: engine e2e cross-node cluster scale sdk self-fork
#   hack/bench.sh --smoke NAME    NAME once with its smallest settings and debug builds, in
#                                 the environment it is given (what `make test` runs, so
#                                 that no bench rots); prints a libtest closing line
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
all=(engine e2e cross-node cluster scale sdk self-fork)
smoke=false
if [[ "${1:-}" == "--smoke" ]]; then smoke=true; shift; fi
names=("$@"); ((${#names[@]})) || names=("${all[@]}")
for n in "${names[@]}"; do
  [[ " ${all[*]} " == *" $n "* ]] || { echo "unknown bench $n (one of: ${all[*]})" >&2; exit 2; }
done
runsc="$(hack/runsc/build.sh)"
bin=target/debug
if $smoke; then
  unset RAMIFY_PROFILE
else
  # shellcheck source=hack/lib/cargo-target.sh
  source hack/lib/cargo-target.sh
  hack/install-deps.sh
  ramify_undate_clone
  cargo build --workspace --bins --locked
  cargo build --workspace --bins --locked --release
  export RAMIFY_PROFILE=release
  export RAMIFY_CP_DIR="$repo/.ramify/bench-controlplane" RAMIFY_CP_PORT_BASE=17040
  export RAMIFY_S3_DIR="$repo/.ramify/bench-objectstore" RAMIFY_S3_PORT=16960
  export RAMIFY_E2E_LANE=9
  trap 'hack/node/down.sh >/dev/null 2>&1 || true; hack/objectstore/down.sh >/dev/null 2>&1 || true; hack/controlplane/down.sh >/dev/null 2>&1 || true' EXIT
  hack/controlplane/up.sh >/dev/null
  hack/objectstore/up.sh >/dev/null
  # shellcheck disable=SC1091
  source "$RAMIFY_S3_DIR/env"
fi
run() { printf '\n==> bench %s: %s\n' "$1" "${*:2}"; "${@:2}"; }
one() {
  local n="$1"
  case "$n:$smoke" in
    engine:true) run "$n" "$bin/ramify-bench" --runsc "$runsc" --claims 5 --dirty 0 --forks 1 \
      --platform-runs 1 --store-dirty 8 --throttle-runs 1 \
      --lazy-mib 32 --lazy-branches 2 \
      --scenarios engine,platforms,suspend,store,throttle,lazy,python,portforward,network --net-runs 1 --python-tar "$(hack/images/debootstrap.sh)" \
      --python-rows 2000 --python-dict 10000 --python-branches 2 --pf-requests 2 ;;
    engine:false)
      run "$n" target/release/ramify-bench --runsc "$runsc"
      run "$n" target/release/ramify-bench --runsc "$runsc" --scenarios suspend,store,throttle,lazy,python,portforward,network --dirty 0,64,256 \
        --python-tar "$(hack/images/debootstrap.sh)" ;;
    e2e:true) run "$n" "$bin/ramify-e2e-bench" --runs 1 ;;
    e2e:false) run "$n" "$bin/ramify-e2e-bench" --runs 5 ;;
    cross-node:true) run "$n" "$bin/ramify-cross-node-bench" --runs 1 ;;
    cross-node:false) run "$n" "$bin/ramify-cross-node-bench" --runs 5 ;;
    cluster:true) run "$n" "$bin/ramify-cluster-bench" --runs 1 ;;
    cluster:false) run "$n" "$bin/ramify-cluster-bench" --runs 5 ;;
    scale:true) run "$n" "$bin/ramify-scale-bench" --sandboxes 20 --branchsets 2 --replicas 2 --nodes 2 \
      --creators 2 --timeout-seconds 300 ;;
    scale:false) run "$n" "$bin/ramify-scale-bench" --sandboxes 1000 --branchsets 100 --replicas 10 --nodes 50 ;;
    sdk:*|self-fork:*)
      local test="sdk_fork_bench" file=sdk
      [[ "$n" == sdk ]] || { test=self_fork_bench; file=self_fork; }
      local runs=5; $smoke && runs=1
      run "$n" env RAMIFY_BENCH_RUNS="$runs" cargo test -q --locked -p ramify-e2e --test "$file" -- \
        --ignored --exact "$test" --nocapture ;;
  esac
}
failed=0
for n in "${names[@]}"; do one "$n" || { echo "==> bench $n FAILED" >&2; failed=$((failed + 1)); }; done
if $smoke; then echo "test result: $( ((failed)) && echo FAILED || echo ok). $((${#names[@]} - failed)) passed; $failed failed"; fi
((failed == 0))
