#!/usr/bin/env bash
# Builds ramify's own images without Docker (hack/images/ramify-images.py says what is in
# them; Dockerfile is the same recipe for Docker users) and pushes them to a registry.
#
#   hack/images/ramify.sh build           binaries + layouts (cached); prints the layout dir
#   hack/images/ramify.sh push [TAG...]   build, then push ramify/{operator,api,node-agent,pod}
#                                         under each TAG (default: the content stamp) to the
#                                         registry of $RAMIFY_REGISTRY_DIR; writes
#                                         $RAMIFY_REGISTRY_DIR/ramify-images.json and prints it
#
# ramify-images.json: {"stamp": KEY, "images": {"operator": {"repository":
# "127.0.0.1:15000/ramify/operator", "digest": "sha256:...", "size": N, "tags": [...]}, ...}}
#
# Inputs: the static binaries (cargo --profile image, crt-static glibc: the musl target is
# not installable offline; see README, Images), the pinned runsc (hack/runsc/build.sh), a
# Debian tree with the node agent's packages (hack/images/debootstrap.sh). The layouts are
# cached under ${RAMIFY_CACHE:-~/.cache/ramify}/ramify-images-<key>/, key = these scripts,
# static-root, the binaries and the Debian tree: the same inputs give the same digests.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${RAMIFY_CACHE:-$HOME/.cache/ramify}"
die() { echo "ramify-images: FAILED: $*" >&2; exit 1; }
py="$here/ramify-images.py"
recipe() { python3 -c 'import json,sys; r=json.load(sys.stdin)["cargo"]; print(r[sys.argv[1]] if isinstance(r[sys.argv[1]], str) else " ".join(r[sys.argv[1]]))' "$1" < <(python3 "$py" recipe); }

cmd="${1:-build}"
[[ "$cmd" == build || "$cmd" == push ]] || die "usage: ramify.sh build | push [TAG...]"

profile="$(recipe profile)"
target="$(recipe target)"
crates=()
for c in $(recipe crates); do crates+=(-p "$c" --bin "$c"); done
echo ">> cargo build --profile $profile --target $target (static)" >&2
# --target: RUSTFLAGS then apply to the binaries only, never to build scripts or proc
# macros (which cannot be static).
# Without the variables cargo sets for a running test or build script (a test may call
# this): ring's build script tracks CARGO_MANIFEST_DIR, so they would rebuild it all.
unset CARGO_MANIFEST_DIR CARGO_MANIFEST_PATH CARGO_PRIMARY_PACKAGE CARGO_CRATE_NAME CARGO_BIN_NAME CARGO_TARGET_TMPDIR OUT_DIR
for v in $(compgen -e | grep -E '^CARGO_PKG_' || true); do unset "$v"; done
(cd "$repo" && RUSTFLAGS="$(recipe rustflags)" cargo build --locked --profile "$profile" --target "$target" "${crates[@]}" >&2) ||
  die "cargo build of the images' binaries"
bin_dir="${CARGO_TARGET_DIR:-$repo/target}/$target/$profile"
runsc="$("$repo/hack/runsc/build.sh")" || die "hack/runsc/build.sh"
rootfs="$("$here/debootstrap.sh" "$(python3 "$py" packages node-agent)")" || die "debootstrap of the node-agent tree"

key="$( {
  cat "$py" "$here/mkimages.py" "$here/ramify.sh"
  find "$here/static-root" -type f | sort | xargs cat
  for c in $(recipe crates); do cat "$bin_dir/$c"; done
  cat "$runsc"
  printf '%s %s' "$rootfs" "$(stat -c %s "$rootfs")"
} | sha256sum | cut -c1-16)"
built="$cache/ramify-images-$key"
if [[ ! -f "$built/layouts.json" ]]; then
  echo ">> assembling the images into $built" >&2
  tmp="$cache/ramify-images-$key.tmp.$$"
  rm -rf "$tmp"
  trap 'rm -rf "$tmp"' EXIT
  python3 "$py" build "$tmp" --bin-dir "$bin_dir" --runsc "$runsc" --rootfs "$rootfs" >&2
  # Older builds (other inputs) unused for a day are stale: each holds a Debian tree.
  find "$cache" -maxdepth 1 -name 'ramify-images-*' ! -name "ramify-images-$key*" -mtime +1 -exec rm -rf {} + 2>/dev/null || true
  mv -T "$tmp" "$built" 2>/dev/null || [[ -f "$built/layouts.json" ]] || die "cannot move the layouts to $built"
fi
if [[ "$cmd" == build ]]; then echo "$built"; exit 0; fi

shift
tags=("$@")
((${#tags[@]})) || tags=("$key")
dir="${RAMIFY_REGISTRY_DIR:-$repo/.ramify/registry}"
[[ -f "$dir/addr" ]] || die "no registry running for $dir (start hack/registry/up.sh first)"
addr="$(cat "$dir/addr")"
crane="$("$repo/hack/registry/build.sh")/crane"
export DOCKER_CONFIG="$dir/docker"
mkdir -p "$dir/logs"
lines="$(python3 -c 'import json,sys
for n, v in json.load(open(sys.argv[1])).items(): print(n.split("/")[1].split(":")[0], v["dir"], v["digest"], v["size"])' "$built/layouts.json")"
while read -r name ldir want size; do
  for tag in "${tags[@]}"; do
    got="$("$crane" push --insecure "$built/$ldir" "$addr/ramify/$name:$tag" 2>"$dir/logs/crane-push-ramify.log")" ||
      { cat "$dir/logs/crane-push-ramify.log" >&2; die "crane push $addr/ramify/$name:$tag"; }
    [[ "${got##*@}" == "$want" ]] || die "ramify/$name:$tag: the registry has ${got##*@}, the layout $want"
  done
done <<<"$lines"
python3 -c 'import json, os, sys
path, addr, stamp, lines, tags = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
images = {}
for line in lines.splitlines():
    name, _, digest, size = line.split()
    images[name] = {"repository": f"{addr}/ramify/{name}", "digest": digest, "size": int(size), "tags": tags}
with open(path + ".tmp", "w") as fh:
    json.dump({"stamp": stamp, "images": images}, fh, indent=2, sort_keys=True)
os.replace(path + ".tmp", path)' "$dir/ramify-images.json" "$addr" "$key" "$lines" "${tags[@]}"
cat "$dir/ramify-images.json"
