#!/usr/bin/env bash
# Runs the commands and manifests of README.md and docs/*.md against the running demo
# (`make demo`), as printed, with only what the demo's "Explore" line exports: its
# KUBECONFIG, kubectl and target/debug on PATH. No ramify variable is set. Which blocks
# run, which are validated by a server-side dry run and which are not run (and why) is
# marked beside each block: hack/doc-blocks.py says how. Between two commands it waits
# until no BranchSet is still forking or running towards its verdicts (as a person
# reading the output would). The Python examples run in the SDK's venv
# (hack/python-venv.sh); the Grafana dashboard's metrics are checked against the demo's
# /metrics. Exits non-zero at the first failure.
#   RAMIFY_CP_DIR             the demo's control plane (default .ramify/controlplane)
#   RAMIFY_DEMO_METRICS_PORT  the demo operator's metrics port, the agent's is the next
#                             (default 18080, as hack/demo.sh)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
export RAMIFY_CP_DIR="${RAMIFY_CP_DIR:-$repo/.ramify/controlplane}"
[[ -f "$RAMIFY_CP_DIR/env" ]] || { echo "demo-check: no demo running (make demo first)" >&2; exit 1; }
# shellcheck disable=SC1091
source "$RAMIFY_CP_DIR/env"
export PATH="$repo/target/debug:$PATH"
metrics_port="${RAMIFY_DEMO_METRICS_PORT:-18080}"
unset RAMIFY_AGENT_STATE_DIR RAMIFY_NODE_AGENT RAMIFY_SYSTEM_NAMESPACE RAMIFY_DEMO_METRICS_PORT
venv="$(hack/python-venv.sh)"
PYTHONPATH="$repo/sdk/python/src" exec python3 hack/doc-blocks.py run --python "$venv/bin/python" \
  --metrics "127.0.0.1:$metrics_port" --metrics "127.0.0.1:$((metrics_port + 1))"
