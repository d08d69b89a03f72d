#!/usr/bin/env bash
# Builds SeaweedFS's `weed` (github.com/seaweedfs/seaweedfs/weed, version pinned by
# hack/objectstore/go.mod + go.sum) from the Go module proxy into
# ${RAMIFY_CACHE:-~/.cache/ramify}/objectstore-seaweedfs-<version>/weed and prints that
# directory. A second run with the binary present returns at once (content stamp).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# go.mod is the single source of truth for the version.
version="$(awk '$1 == "require" && $2 == "github.com/seaweedfs/seaweedfs" { print $3; exit }
  $1 == "github.com/seaweedfs/seaweedfs" { print $2; exit }' "$here/go.mod")"
[[ -n "$version" ]] || { echo "objectstore: cannot read the seaweedfs version from $here/go.mod" >&2; exit 1; }
cache="${RAMIFY_CACHE:-$HOME/.cache/ramify}"
out="$cache/objectstore-seaweedfs-$version"
# The stamp hashes file contents only, so checkouts in other directories share the cache.
stamp="$out/.complete-$(cat "$here/go.mod" "$here/go.sum" "$here/build.sh" | sha256sum | cut -c1-16)"
if [[ -f "$stamp" && -x "$out/weed" ]]; then echo "$out"; exit 0; fi
mkdir -p "$out"
cd "$here"
echo ">> building weed (seaweedfs $version; a cold build takes minutes)" >&2
# Build to a private name and rename: a concurrent run never sees a partial binary.
tmp="$out/weed.tmp.$$"
trap 'rm -f "$tmp"' EXIT
CGO_ENABLED=0 go build -mod=readonly -trimpath -ldflags "-s -w" -o "$tmp" github.com/seaweedfs/seaweedfs/weed >&2
mv -f "$tmp" "$out/weed"
rm -f "$out"/.complete-*
touch "$stamp"
echo "$out"
