#!/usr/bin/env bash
# Builds the test images reproducibly (hack/images/mkimages.py: OCI layouts, stdlib
# Python) and pushes them with crane to the registry started by hack/registry/up.sh.
#
#   hack/images/build.sh [push]           build (cached) and push every image; writes
#                                         $RAMIFY_REGISTRY_DIR/images.json and prints it
#   hack/images/build.sh layouts OUT      build every layout into OUT, bypassing the cache
#                                         (reproducibility checks); prints "name digest size"
#   hack/images/build.sh retag-busybox-v2 moves the tag busybox:moving (pushed as
#                                         busybox:1's image) to busybox:v2's image (an extra
#                                         /etc/ramify-v2); updates images.json
#
# hostile/corrupt:1's top layer is corrupted in storage after the push (see mkimages.py).
# images.json: {"busybox:1": {"ref": "127.0.0.1:15000/busybox:1", "digest": "sha256:...",
# "size": <bytes of its blobs, compressed>}, ...}. The images and their contents are
# listed in mkimages.py's doc string; private/* needs the credentials in
# $RAMIFY_REGISTRY_DIR/credentials.json. The layouts are cached under
# ${RAMIFY_CACHE:-~/.cache/ramify}/images-<key>/ (key: these scripts, the busybox binary,
# the debootstrap rootfs), so a warm run only pushes.
#
# Environment: RAMIFY_REGISTRY_DIR (default <repo>/.ramify/registry; the registry must be up).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dir="${RAMIFY_REGISTRY_DIR:-$repo/.ramify/registry}"
cache="${RAMIFY_CACHE:-$HOME/.cache/ramify}"
die() { echo "images: FAILED: $*" >&2; exit 1; }

# Debian's busybox-static (hack/install-deps.sh installs it): one static binary.
busybox=/bin/busybox
dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q "install ok installed" && [[ -x "$busybox" ]] ||
  die "no static busybox: install Debian's busybox-static (hack/install-deps.sh does)"
rootfs="$("$here/debootstrap.sh")" || die "debootstrap of the workspace rootfs failed"

layouts() { # out
  python3 "$here/mkimages.py" "$1" --busybox "$busybox" --workspace-rootfs "$rootfs"
}

cmd="${1:-push}"
if [[ "$cmd" == layouts ]]; then
  [[ -n "${2:-}" ]] || die "usage: build.sh layouts OUT"
  layouts "$2"
  exit 0
fi

key="$(cat "$here/mkimages.py" "$here/build.sh" "$here/debootstrap.sh" "$busybox" | sha256sum | cut -c1-16)"
key="$(printf '%s %s %s' "$key" "$rootfs" "$(stat -c %s "$rootfs")" | sha256sum | cut -c1-16)"
built="$cache/images-$key"
if [[ ! -f "$built/layouts.json" ]]; then
  echo ">> building image layouts into $built" >&2
  tmp="$cache/images-$key.tmp.$$"
  rm -rf "$tmp"
  trap 'rm -rf "$tmp"' EXIT
  layouts "$tmp" >&2
  # Layouts of other keys (older scripts) unused for a week are stale.
  find "$cache" -maxdepth 1 -name 'images-*' ! -name "images-$key*" -mtime +7 -exec rm -rf {} + 2>/dev/null || true
  # Another checkout may have finished the same key first: its copy is as good.
  mv -T "$tmp" "$built" 2>/dev/null || [[ -f "$built/layouts.json" ]] || die "cannot move the layouts to $built"
fi

[[ -f "$dir/addr" ]] || die "no registry running for $dir (start hack/registry/up.sh first)"
addr="$(cat "$dir/addr")"
crane="$("$repo/hack/registry/build.sh")/crane"
# The credentials up.sh wrote: pushes to private/* need them.
export DOCKER_CONFIG="$dir/docker"

push() { # layout-dir ref -> the pushed digest
  local pushed
  pushed="$("$crane" push --insecure "$built/$1" "$2" 2>"$dir/logs/crane-push.log")" ||
    { cat "$dir/logs/crane-push.log" >&2; die "crane push $2"; }
  echo "${pushed##*@}"
}
# name dir digest size, one line per layout
layouts_list() { python3 -c 'import json,sys
for n, v in json.load(open(sys.argv[1])).items(): print(n, v["dir"], v["digest"], v["size"])' "$built/layouts.json"; }
record() { # lines "name digest size" on stdin -> merged into images.json
  python3 -c 'import json, os, sys
path, addr = sys.argv[1:]
images = json.load(open(path)) if os.path.exists(path) else {}
for line in sys.stdin:
    name, digest, size = line.split()
    images[name] = {"ref": f"{addr}/{name}", "digest": digest, "size": int(size)}
with open(path + ".tmp", "w") as fh:
    json.dump(images, fh, indent=2, sort_keys=True)
os.replace(path + ".tmp", path)' "$dir/images.json" "$addr"
}

# Overwrites the stored data of an image's top layer with other bytes of the same
# length, behind the registry's back (it checks digests on upload, not when serving).
corrupt_top_layer() { # name
  local ldir layer data
  ldir="$(layouts_list | awk -v n="$1" '$1 == n { print $2 }')"
  layer="$(python3 -c 'import json,sys
root = sys.argv[1]
desc = json.load(open(root + "/index.json"))["manifests"][0]
m = json.load(open(root + "/blobs/sha256/" + desc["digest"][7:]))
print(m["layers"][-1]["digest"][7:])' "$built/$ldir")"
  data="$dir/storage/docker/registry/v2/blobs/sha256/${layer:0:2}/$layer/data"
  [[ -f "$data" ]] || die "$1: no stored blob $data"
  # Only while it still matches: a second push (blob already there) leaves it corrupt.
  python3 -c 'import hashlib, sys
p, digest = sys.argv[1:]
b = bytearray(open(p, "rb").read())
if hashlib.sha256(b).hexdigest() == digest:
    b[len(b) // 2] ^= 0xFF
    open(p, "wb").write(bytes(b))' "$data" "$layer"
}

case "$cmd" in
  push)
    rm -f "$dir/images.json"
    pushed_list="$(layouts_list | while read -r name ldir want size; do
      got="$(push "$ldir" "$addr/$name")"
      [[ "$got" == "$want" ]] || die "$name: the registry has $got, the layout $want"
      echo "$name $want $size"
      # The tag the retag step moves starts out as busybox:1's image.
      if [[ "$name" == busybox:1 ]]; then echo "busybox:moving $(push "$ldir" "$addr/busybox:moving") $size"; fi
    done)"
    record <<<"$pushed_list"
    corrupt_top_layer hostile/corrupt:1
    ;;
  retag-busybox-v2)
    [[ -f "$dir/images.json" ]] || die "push the images first (build.sh push)"
    read -r _ ldir want size < <(layouts_list | grep '^busybox:v2 ')
    got="$(push "$ldir" "$addr/busybox:moving")"
    [[ "$got" == "$want" ]] || die "busybox:moving: the registry has $got, the layout $want"
    record <<<"busybox:moving $got $size"
    ;;
  *) die "unknown command $cmd (push | layouts OUT | retag-busybox-v2)" ;;
esac
cat "$dir/images.json"
