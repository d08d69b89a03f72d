#!/usr/bin/env bash
# The embedded default: a local control plane with the ramify API installed and the
# samples applied. `hack/demo.sh down` stops it and removes its state.
#
# Stage note: the operator and node agent are not wired into this command yet, so the
# samples are accepted and validated by the API server but nothing forks them.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
export RAMIFY_CP_DIR="${RAMIFY_CP_DIR:-$repo/.ramify/controlplane}"
if [[ "${1:-}" == "down" ]]; then hack/controlplane/down.sh; exit 0; fi

echo "==> building the control plane (first run: about 10 minutes on 2 cores; cached afterwards)"
hack/controlplane/up.sh >/dev/null
# shellcheck disable=SC1091
source "$RAMIFY_CP_DIR/env"
echo "==> installing the ramify CRDs"
kubectl apply --server-side --field-manager ramify-demo -f crds/yaml/ramify.dev.yaml >/dev/null
kubectl wait --for condition=Established crd/sandboxes.ramify.dev crd/snapshots.ramify.dev crd/branchsets.ramify.dev --timeout=60s >/dev/null
echo "==> applying config/samples"
kubectl apply -f config/samples/
echo
kubectl get sandboxes,snapshots,branchsets
echo
echo "The API is live. Explore it with:"
echo "  export KUBECONFIG=$RAMIFY_CP_DIR/kubeconfig PATH=$(dirname "$(command -v kubectl)"):\$PATH"
echo "  kubectl explain branchset.spec"
echo "Stop everything with: make down"
