#!/usr/bin/env bash
# Installs what the demo and the tests need on a fresh Debian machine with Go and Rust
# present, each piece cached (by version or content stamp) under ~/.cache/ramify, so a
# second run takes seconds:
#
#   hack/install-deps.sh          everything `make test` needs
#   hack/install-deps.sh --demo   only what `make demo` runs: Debian packages, the control
#                                 plane, the current runsc, the registry and crane, the
#                                 workspace image's Debian tree
#
# The rest, for the tests: rustfmt/clippy, the real node (kubelet, containerd), the object
# store (SeaweedFS), helm, ramify's own images (static binaries and OCI layouts) and the
# Python SDK's venv. Each step says what it builds and, when it is not cached yet, how
# long it took on 2 cores the first time.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
demo_only=false
[[ "${1:-}" == "--demo" ]] && demo_only=true
# Compiled Rust outlives the clone (ramify's images are built here): hack/lib/cargo-target.sh.
# shellcheck source=hack/lib/cargo-target.sh
source "$here/lib/cargo-target.sh"

need_apt=()
for pkg in runsc runc gcc libc6-dev patch containernetworking-plugins busybox-static debootstrap python3 iptables iproute2 procps util-linux openssl curl jq; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  echo "install-deps: apt-get install ${need_apt[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
if [[ -x "$here/../node-agent/scripts/install-deps.sh" ]]; then "$here/../node-agent/scripts/install-deps.sh" >/dev/null; fi

# stage WHAT COLD COMMAND...: runs one cached build; prints where it is, and how long it
# took when that was more than a few seconds (a cold build; COLD is what to expect).
stage() {
  local what="$1" cold="$2"; shift 2
  local t0=$SECONDS out
  if [[ -t 2 || -n "${CI:-}" ]]; then echo "install-deps: $what (cached, or about $cold when cold) ..." >&2; fi
  out="$("$@")"
  local secs=$((SECONDS - t0))
  if ((secs > 5)); then echo "install-deps: $what in $out (built in ${secs}s)" >&2
  else echo "install-deps: $what in $out" >&2; fi
}
stage "control plane (etcd, kube-apiserver, -controller-manager, -scheduler, kubectl)" "6 min" "$here/controlplane/build.sh"
stage "current runsc" "2 min" "$here/runsc/build.sh"
stage "registry and crane" "3 min" "$here/registry/build.sh"
stage "workspace image rootfs (debootstrap: python3, sqlite3)" "2 min" "$here/images/debootstrap.sh"
$demo_only && exit 0

rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
stage "node (kubelet, containerd, pause and busybox images)" "4 min" "$here/node/build.sh"
stage "object store (SeaweedFS weed)" "3 min" "$here/objectstore/build.sh"
stage "helm" "2 min" "$here/helm/build.sh"
stage "ramify's own images (static binaries, OCI layouts)" "12 min" "$here/images/ramify.sh" build
stage "Python SDK venv" "1 min" "$here/python-venv.sh"
