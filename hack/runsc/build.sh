#!/usr/bin/env bash
# Builds the pinned runsc from the Go module proxy into a versioned cache directory and
# prints the binary's path. The version string is stamped so that images checkpointed
# by this runsc are only restored by the same build (runsc refuses a mismatch).
#
# Patches in patches/*.patch (unified diffs against the gvisor.dev/gvisor module root,
# applied in name order with `patch -p1`) are applied to a writable copy of the module
# source, which is then built through a temporary `replace`. Their hash is part of both
# the version string and the cache directory, so a patched and an unpatched build (or
# two different patch sets) never share a binary or restore each other's images.
#
#   build.sh          build (cached) and print the path of runsc
#   build.sh --test   run the Go unit tests of the packages the patches touch, on the
#                     patched source (output on stderr)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mode=build
case "${1:-}" in
  "") ;;
  --test) mode=test ;;
  *) echo "usage: $0 [--test]" >&2; exit 2 ;;
esac
pseudo="$(awk '$1 == "require" && $2 == "gvisor.dev/gvisor" {print $3}' "$here/go.mod")"
# release-YYYYMMDD.0-<commit>: the node agent reads the release date from the version to
# decide which runsc features to trust (e.g. checkpoint --leave-running from 2024 on).
stamp="${pseudo#v0.0.0-}"; commit="${stamp#*-}"
version="release-${stamp:0:8}.0-${commit}"
shopt -s nullglob
patches=("$here"/patches/*.patch)
shopt -u nullglob
suffix=""
if (( ${#patches[@]} )); then
  # Names and contents, in application order.
  phash="$(for p in "${patches[@]}"; do basename "$p"; cat "$p"; done | sha256sum | cut -c1-8)"
  suffix="+p${phash}"
  version="${version}${suffix}"
fi
cache="${RAMIFY_CACHE:-$HOME/.cache/ramify}"
out="$cache/runsc-$pseudo$suffix"
if [[ $mode == build && -x "$out/runsc" ]]; then echo "$out/runsc"; exit 0; fi

work="$(mktemp -d "${TMPDIR:-/tmp}/ramify-runsc.XXXXXX")"
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work" "$out/runsc.tmp.$$"' EXIT
# The wrapper module (go.mod, go.sum, tools.go), so dependency versions are the ones
# pinned here whether or not there are patches.
cp "$here/go.mod" "$here/go.sum" "$here/tools.go" "$work/"
touched=()
if (( ${#patches[@]} )); then
  src="$(cd "$here" && go mod download -json gvisor.dev/gvisor | awk -F'"' '$2 == "Dir" {print $4}')"
  [[ -d "$src" ]] || { echo "runsc: gvisor.dev/gvisor $pseudo is not in the module cache" >&2; exit 1; }
  # The module cache is read-only: copy, then patch the copy.
  cp -r "$src" "$work/gvisor"
  chmod -R u+w "$work/gvisor"
  for p in "${patches[@]}"; do
    echo ">> applying $(basename "$p")" >&2
    patch -d "$work/gvisor" -p1 --forward --batch --quiet <"$p" >&2
    # Packages whose files the patch touches, for --test.
    while read -r f; do touched+=("gvisor.dev/gvisor/$(dirname "$f")"); done \
      < <(awk '/^\+\+\+ / {sub(/^b\//, "", $2); print $2}' "$p")
  done
  (cd "$work" && go mod edit -replace "gvisor.dev/gvisor=$work/gvisor")
fi
cd "$work"

if [[ $mode == test ]]; then
  (( ${#touched[@]} )) || { echo "runsc: no patches, nothing to test" >&2; exit 0; }
  mapfile -t pkgs < <(printf '%s\n' "${touched[@]}" | sort -u)
  # Touched packages without tests are still compiled ("no test files"). -trimpath as
  # below, so the build cache is shared with the runsc build.
  echo ">> go test ${pkgs[*]}" >&2
  CGO_ENABLED=0 nice -n 19 go test -trimpath -count=1 "${pkgs[@]}" >&2
  exit 0
fi

mkdir -p "$out"
echo ">> building runsc $version (gvisor.dev/gvisor $pseudo, ${#patches[@]} patch(es))" >&2
# Build to a private name and rename: a concurrent run never sees a partial binary.
CGO_ENABLED=0 nice -n 19 go build -trimpath \
  -ldflags "-s -w -X gvisor.dev/gvisor/runsc/version.version=$version" \
  -o "$out/runsc.tmp.$$" gvisor.dev/gvisor/runsc >&2
mv -f "$out/runsc.tmp.$$" "$out/runsc"
echo "$out/runsc"
