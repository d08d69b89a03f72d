#!/usr/bin/env bash
# Builds the pinned runsc from the Go module proxy into a versioned cache directory and
# prints the binary's path. The version string is stamped so that images checkpointed
# by this runsc are only restored by the same build (runsc refuses a mismatch).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
pseudo="$(awk '$1 == "require" && $2 == "gvisor.dev/gvisor" {print $3}' "$here/go.mod")"
# release-YYYYMMDD.0-<commit>: the node agent reads the release date from the version to
# decide which runsc features to trust (e.g. checkpoint --leave-running from 2024 on).
stamp="${pseudo#v0.0.0-}"; commit="${stamp#*-}"
version="release-${stamp:0:8}.0-${commit}"
cache="${RAMIFY_CACHE:-$HOME/.cache/ramify}"
out="$cache/runsc-$pseudo"
if [[ -x "$out/runsc" ]]; then echo "$out/runsc"; exit 0; fi
mkdir -p "$out"
echo ">> building runsc $version (gvisor.dev/gvisor $pseudo)" >&2
cd "$here"
CGO_ENABLED=0 go build -trimpath \
  -ldflags "-s -w -X gvisor.dev/gvisor/runsc/version.version=$version" \
  -o "$out/runsc.tmp" gvisor.dev/gvisor/runsc >&2
mv "$out/runsc.tmp" "$out/runsc"
echo "$out/runsc"
