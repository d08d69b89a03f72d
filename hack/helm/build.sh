#!/usr/bin/env bash
# Builds the pinned helm (the version go.mod requires) from the Go module proxy into
# ${RAMIFY_CACHE:-~/.cache/ramify}/helm-<version>/helm and prints that path. A second
# run with the binary present returns at once.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# go.mod is the single source of truth for the versions.
mod_version() { awk -v m="$1" '$1 == m { print $2; exit } $1 == "require" && $2 == m { print $3; exit }' "$here/go.mod"; }
HELM_VERSION="$(mod_version helm.sh/helm/v3)"
CLIENT_GO_VERSION="$(mod_version k8s.io/client-go)"
[[ -n "$HELM_VERSION" && -n "$CLIENT_GO_VERSION" ]] || { echo "helm: cannot read versions from $here/go.mod" >&2; exit 1; }
cache="${RAMIFY_CACHE:-$HOME/.cache/ramify}"
out="$cache/helm-$HELM_VERSION"
# The stamp hashes file contents only, so checkouts in other directories share the cache.
stamp="$out/.complete-$(cat "$here/go.mod" "$here/go.sum" "$here/build.sh" | sha256sum | cut -c1-16)"
if [[ -f "$stamp" && -x "$out/helm" ]]; then echo "$out/helm"; exit 0; fi
mkdir -p "$out"
# What upstream's Makefile stamps for a release build: the version (otherwise
# `helm version` says "v3.22" + "unreleased"), and the Kubernetes version helm assumes
# without a cluster (`helm template`'s .Capabilities.KubeVersion, the lint deprecation
# checks), derived from client-go v0.N.P -> 1.N exactly as upstream does; left unset
# these fall back to 1.20.
k8s_minor="${CLIENT_GO_VERSION#v0.}"; k8s_minor="${k8s_minor%%.*}"
v=helm.sh/helm/v3
ldflags="-s -w -X $v/internal/version.version=$HELM_VERSION -X $v/internal/version.metadata= -X $v/internal/version.gitTreeState=clean"
for pkg in pkg/lint/rules pkg/chartutil; do
  ldflags="$ldflags -X $v/$pkg.k8sVersionMajor=1 -X $v/$pkg.k8sVersionMinor=$k8s_minor"
done
echo ">> building helm $HELM_VERSION" >&2
cd "$here"
# Build to a private name and rename: a concurrent run never sees a partial binary.
tmp="$out/helm.tmp.$$"
trap 'rm -f "$tmp"' EXIT
CGO_ENABLED=0 go build -mod=readonly -trimpath -ldflags "$ldflags" -o "$tmp" "$v/cmd/helm" >&2
mv -f "$tmp" "$out/helm"
rm -f "$out"/.complete-*
touch "$stamp"
echo "$out/helm"
