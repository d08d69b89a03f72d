#!/usr/bin/env bash
# Builds the test registry's binaries from the Go module proxy (versions pinned by
# hack/registry/go.mod + go.sum) into ${RAMIFY_CACHE:-~/.cache/ramify}/registry-<versions>/
# and prints that directory:
#   registry   distribution's registry (github.com/distribution/distribution/v3/cmd/registry)
#   crane      go-containerregistry's crane (push, pull, digest, manifest, blob, export)
#   regfront   the per-repository Basic-auth front (./regfront; see its doc comment)
# A second run with the binaries present returns at once (content stamp).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# go.mod is the single source of truth for the versions.
mod_version() { awk -v m="$1" '$1 == m { print $2; exit } $1 == "require" && $2 == m { print $3; exit }' "$here/go.mod"; }
DIST_VERSION="$(mod_version github.com/distribution/distribution/v3)"
CRANE_VERSION="$(mod_version github.com/google/go-containerregistry)"
[[ -n "$DIST_VERSION" && -n "$CRANE_VERSION" ]] || { echo "registry: cannot read versions from $here/go.mod" >&2; exit 1; }
cache="${RAMIFY_CACHE:-$HOME/.cache/ramify}"
out="$cache/registry-$DIST_VERSION-crane-$CRANE_VERSION"
# The stamp hashes file contents only, so checkouts in other directories share the cache.
stamp="$out/.complete-$(cat "$here/go.mod" "$here/go.sum" "$here/build.sh" "$here/regfront/main.go" | sha256sum | cut -c1-16)"
if [[ -f "$stamp" && -x "$out/registry" && -x "$out/crane" && -x "$out/regfront" ]]; then echo "$out"; exit 0; fi
mkdir -p "$out"
cd "$here"
export CGO_ENABLED=0
build() { # name package ldflags
  echo ">> building $1" >&2
  # Build to a private name and rename: a concurrent run never sees a partial binary.
  local tmp="$out/$1.tmp.$$"
  go build -mod=readonly -trimpath -ldflags "-s -w $3" -o "$tmp" "$2" >&2
  mv -f "$tmp" "$out/$1"
}
trap 'rm -f "$out"/*.tmp.$$' EXIT
build registry github.com/distribution/distribution/v3/cmd/registry \
  "-X github.com/distribution/distribution/v3/version.version=$DIST_VERSION"
build crane github.com/google/go-containerregistry/cmd/crane \
  "-X github.com/google/go-containerregistry/cmd/crane/cmd.Version=$CRANE_VERSION"
build regfront ./regfront ""
rm -f "$out"/.complete-*
touch "$stamp"
echo "$out"
