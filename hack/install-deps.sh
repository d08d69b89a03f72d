#!/usr/bin/env bash
# Installs everything the demo and the tests need on a fresh Debian machine with Go and
# Rust present: Debian packages (runsc, runc, CNI plugins, busybox for test rootfs, gcc for
# the pause image, debootstrap for the workspace test image, ...), rustfmt/clippy, the
# Go-built control plane, node (kubelet, containerd), test registry and crane, the test
# object store (SeaweedFS) (cached by version), the debootstrap rootfs of the workspace
# test image (cached by package list), and ramify's own images (hack/images/ramify.sh: static binaries + OCI layouts, cached).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
need_apt=()
for pkg in runsc runc gcc libc6-dev containernetworking-plugins busybox-static debootstrap python3 iptables iproute2 procps util-linux openssl curl jq; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  echo "install-deps: apt-get install ${need_apt[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
if [[ -x "$here/../node-agent/scripts/install-deps.sh" ]]; then "$here/../node-agent/scripts/install-deps.sh"; fi
echo "install-deps: control plane binaries in $("$here/controlplane/build.sh")" >&2
echo "install-deps: node (kubelet, containerd, pause and busybox images) in $("$here/node/build.sh")" >&2
echo "install-deps: registry and crane in $("$here/registry/build.sh")" >&2
echo "install-deps: object store (SeaweedFS weed) in $("$here/objectstore/build.sh")" >&2
echo "install-deps: workspace image rootfs in $("$here/images/debootstrap.sh")" >&2
echo "install-deps: ramify's own images (static binaries, OCI layouts) in $("$here/images/ramify.sh" build)" >&2
echo "install-deps: Python SDK venv in $("$here/python-venv.sh")" >&2
