#!/usr/bin/env bash
# Builds what a real Kubernetes node needs, into a versioned cache directory, and prints
# that directory:
#   kubelet, kube-proxy        the control plane's pinned Kubernetes (module in this dir)
#   containerd, containerd-shim-runc-v2, ctr   containerd 2.x from the Go module proxy
#   images/pause.tar           the Pod sandbox image: a static C pause (hack/images/pause.c)
#   images/busybox.tar         Debian's busybox-static with its applet links, for test Pods
#   images/NAME.{ref,digest,id}  each image's reference, manifest digest and image ID
# The images are OCI archives made by hack/images/oci-archive.py (reproducible: the same
# inputs give the same digest). runc and the CNI plugins come from Debian
# (hack/install-deps.sh). A second run with everything present returns at once.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
K8S_VERSION="v1.36.3"
CONTAINERD_VERSION="v2.4.2"
cache="${RAMIFY_CACHE:-$HOME/.cache/ramify}"
out="$cache/node-k8s-$K8S_VERSION-containerd-$CONTAINERD_VERSION"
busybox=/bin/busybox
[[ -x "$busybox" ]] || { echo "node build: $busybox missing (apt-get install busybox-static)" >&2; exit 1; }
# The stamp hashes file contents only (and the busybox binary the image packs), so
# checkouts in other directories share the cache.
stamp="$out/.complete-$(cat "$here/go.mod" "$here/go.sum" "$here/build.sh" "$repo/hack/images/pause.c" \
  "$repo/hack/images/oci-archive.py" "$busybox" | sha256sum | cut -c1-16)"
if [[ -f "$stamp" ]]; then echo "$out"; exit 0; fi
mkdir -p "$out/images"
command -v gcc >/dev/null || { echo "node build: gcc missing (apt-get install gcc libc6-dev)" >&2; exit 1; }

minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
kver="-X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
export CGO_ENABLED=0
cd "$here"
for cmd in kubelet kube-proxy; do
  echo ">> building $cmd $K8S_VERSION" >&2
  nice go build -trimpath -ldflags "-s -w $kver" -o "$out/$cmd" "k8s.io/kubernetes/cmd/$cmd" >&2
done

# containerd's own go.mod has no replace directives, so `go install pkg@version` builds
# it with exactly its own pins. Static, as its Makefile's static release does.
cpkg=github.com/containerd/containerd/v2
cflags="-s -w -X $cpkg/version.Version=$CONTAINERD_VERSION -X $cpkg/version.Package=$cpkg"
for cmd in containerd ctr containerd-shim-runc-v2; do
  echo ">> building $cmd $CONTAINERD_VERSION" >&2
  tags="urfave_cli_no_docs osusergo netgo static_build"
  [[ "$cmd" == containerd-shim-runc-v2 ]] && tags="$tags no_grpc"
  GOBIN="$out" nice go install -trimpath -tags "$tags" -ldflags "$cflags" "$cpkg/cmd/$cmd@$CONTAINERD_VERSION" >&2
done

echo ">> building the pause and busybox images" >&2
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/pause"
# No paths or build ids in the binary: the same source gives the same image digest.
gcc -static -Os -s -Wl,--build-id=none -ffile-prefix-map="$repo"=. -o "$work/pause/pause" "$repo/hack/images/pause.c"
python3 "$repo/hack/images/oci-archive.py" "$work/pause" ramify.local/pause:1 "$out/images/pause.tar" \
  --entrypoint '["/pause"]' --id-file "$out/images/pause.id" >"$out/images/pause.digest"
mkdir -p "$work/busybox/bin" "$work/busybox/etc" "$work/busybox/tmp"
cp "$busybox" "$work/busybox/bin/busybox"
chmod 1777 "$work/busybox/tmp"
"$busybox" --list-full | while read -r applet; do
  [[ "$applet" == bin/busybox ]] && continue
  mkdir -p "$work/busybox/$(dirname "$applet")"
  ln -sf /bin/busybox "$work/busybox/$applet"
done
busybox_version="$("$busybox" 2>&1 | sed -n '1s/^BusyBox v\([0-9.]*\).*/\1/p')"
python3 "$repo/hack/images/oci-archive.py" "$work/busybox" "ramify.local/busybox:$busybox_version" \
  "$out/images/busybox.tar" --cmd '["/bin/sh"]' --id-file "$out/images/busybox.id" >"$out/images/busybox.digest"
echo "ramify.local/pause:1" >"$out/images/pause.ref"
echo "ramify.local/busybox:$busybox_version" >"$out/images/busybox.ref"

rm -f "$out"/.complete-*
touch "$stamp"
echo "$out"
