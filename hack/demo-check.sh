#!/usr/bin/env bash
# Runs every `kubectl ramify` example of README.md (the code block of its
# "kubectl ramify" section), in order and as printed, against the running demo
# (`make demo`), with only what the demo's "Explore" line exports: its KUBECONFIG,
# kubectl and target/debug on PATH. No ramify variable is set. Between two examples it
# waits until no BranchSet is still forking or running towards its verdicts (as a
# person reading the output would). Exits non-zero at the first example that fails.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
export RAMIFY_CP_DIR="${RAMIFY_CP_DIR:-$repo/.ramify/controlplane}"
[[ -f "$RAMIFY_CP_DIR/env" ]] || { echo "demo-check: no demo running (make demo first)" >&2; exit 1; }
# shellcheck disable=SC1091
source "$RAMIFY_CP_DIR/env"
export PATH="$repo/target/debug:$PATH"
unset RAMIFY_AGENT_STATE_DIR RAMIFY_NODE_AGENT RAMIFY_SYSTEM_NAMESPACE

mapfile -t examples < <(awk '
  /^## / { in_section = ($0 == "## kubectl ramify"); next }
  in_section && /^```sh/ { in_block = 1; next }
  in_block && /^```/ { exit }
  in_block && /^kubectl ramify / { print }
' README.md)
((${#examples[@]} >= 8)) || { echo "demo-check: found only ${#examples[@]} examples in README.md" >&2; exit 1; }

# True when every BranchSet has ended, or has every branch's verdict (Manual ones wait
# for a person then).
settled() {
  local bs phase want got
  for bs in $(kubectl get branchsets -o jsonpath='{.items[*].metadata.name}'); do
    phase="$(kubectl get branchset "$bs" -o jsonpath='{.status.phase}')"
    case "$phase" in Committed|Exhausted|Failed|Conflict) continue ;; esac
    want="$(kubectl get branchset "$bs" -o jsonpath='{.spec.replicas}')"
    [[ -n "$want" ]] || want="$(kubectl get branchset "$bs" -o jsonpath='{.spec.branches[*].name}' | wc -w)"
    got="$(kubectl get branchset "$bs" -o jsonpath='{.status.branches[*].verdict}' | wc -w)"
    ((got >= want && want > 0)) || return 1
  done
}

n=0
for example in "${examples[@]}"; do
  deadline=$((SECONDS + 180))
  until settled; do
    ((SECONDS < deadline)) || { echo "demo-check: BranchSets still running before: $example" >&2; kubectl get branchsets >&2; exit 1; }
    sleep 0.5
  done
  printf '\n$ %s\n' "$example"
  rc=0
  bash -c "$example" || rc=$?
  if ((rc != 0)); then
    echo "demo-check: FAILED (exit $rc): $example" >&2
    exit 1
  fi
  n=$((n + 1))
done
echo
echo "demo-check: all $n kubectl ramify examples of README.md succeeded"

# The README's Python example (its "Python" section), as printed, in the SDK's venv
# (hack/python-venv.sh), against the same demo; it prints the winner then the file.
py="$(awk '
  /^## / { in_section = ($0 == "## Python"); next }
  in_section && /^```python/ { in_block = 1; next }
  in_block && /^```/ { exit }
  in_block { print }
' README.md)"
[[ -n "$py" ]] || { echo "demo-check: no Python example in README.md" >&2; exit 1; }
venv="$(hack/python-venv.sh)"
printf '\n$ python (the README'"'"'s example)\n'
out="$(PYTHONPATH="$repo/sdk/python/src" "$venv/bin/python" -c "$py")" || {
  echo "demo-check: FAILED: the README's Python example" >&2; exit 1; }
printf '%s\n' "$out"
[[ "$out" == $'fast\nmode=fast' ]] || {
  echo "demo-check: the README's Python example printed something else than its comments say" >&2; exit 1; }
echo "demo-check: the README's Python example succeeded"
