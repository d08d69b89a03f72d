#!/bin/sh
# Installs what the node agent and its tests need on Debian bookworm. Idempotent.
#   runsc                        gVisor (Debian's 20221219 release; a newer one may be put first on PATH)
#   busybox-static               rootfs for test sandboxes (static: no libraries to copy)
#   containernetworking-plugins  CNI bridge + host-local in /usr/lib/cni: only the network
#                                benchmark's baseline (the agent makes sandbox networks itself)
#   iptables iproute2 util-linux egress policy, nsenter/unshare
set -eu
pkgs="runsc busybox-static containernetworking-plugins iptables iproute2 util-linux tar coreutils"
missing=""
for p in $pkgs; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # shellcheck disable=SC2086
  apt-get install -y -qq --no-install-recommends $missing
fi
runsc --version | head -1
test -x /usr/lib/cni/bridge && test -x /usr/lib/cni/host-local
iptables -w 5 -S >/dev/null
echo "ramify node-agent dependencies present"
