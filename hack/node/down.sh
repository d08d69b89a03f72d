#!/usr/bin/env bash
# Stops the node started by up.sh (same environment) and leaves nothing behind: the
# kubelet, kube-proxy (and its iptables rules: `kube-proxy --cleanup`), containerd, its shims and every Pod process (by pid: the pid files, the
# shims serving this node's containerd socket, the processes in the kubepods cgroups);
# the mounts under the node directory and /var/lib/kubelet; the kubepods cgroups in every
# hierarchy; kubelet's iptables chains (KUBE-FIREWALL with its INPUT/OUTPUT jumps,
# KUBE-KUBELET-CANARY, KUBE-IPTABLES-HINT; IPv4 and IPv6) and only those; the CNI bridge,
# netns and leases; the node IP on lo; the sysctls kubelet changed; the Node object (if
# the control plane still answers). Idempotent, and safe after an up.sh that failed
# half-way. `--keep` keeps the node directory (logs) and removes the rest.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cp_dir="${RAMIFY_CP_DIR:-$repo/.ramify/controlplane}"
dir="${RAMIFY_NODE_DIR:-$(dirname "$cp_dir")/node}"
base="${RAMIFY_CP_PORT_BASE:-16440}"
name="${RAMIFY_NODE_NAME:-ramify-node}"
keep=false; [[ "${1:-}" == "--keep" ]] && keep=true
host="$dir/host"
run="$(cat "$host/run-dir" 2>/dev/null || echo "/run/ramify-node-$base")"
# up.sh records what it will change in $host before changing anything: without it there
# is nothing of this node's to undo (and another kubelet's chains are not ours to remove).
if [[ ! -d "$host" ]]; then
  if ! $keep; then rm -rf "$dir"; fi
  echo "node: not running ($dir)" >&2
  exit 0
fi
failed=0
warn() { echo "node down: $*" >&2; failed=1; }

stop_pid() { # pid
  local pid="$1"
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  warn "pid $pid did not exit"
}
stop_named() { # name (pid file under $dir/run)
  local pidfile="$dir/run/$1.pid"
  [[ -f "$pidfile" ]] || return 0
  stop_pid "$(cat "$pidfile")"
  rm -f "$pidfile"
}

# 1. The kubelet first, so it restarts nothing while the rest goes; kube-proxy, so it
# programs nothing again once its rules are removed (6).
stop_named kubelet
stop_named kube-proxy

# 2. Every Pod process: whatever is in a kubepods cgroup (pause, containers, exec'd
# processes), found through the cgroups kubelet made, not by name.
cgroup_roots() {
  awk '$3 == "cgroup" || $3 == "cgroup2" {print $2}' /proc/self/mounts
}
pod_pids() {
  local root
  for root in $(cgroup_roots); do
    [[ -d "$root/kubepods" ]] || continue
    find "$root/kubepods" -name cgroup.procs -exec cat {} + 2>/dev/null
  done | sort -un
}
for _ in $(seq 1 50); do
  pids="$(pod_pids)"
  [[ -z "$pids" ]] && break
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null
  sleep 0.1
done
[[ -z "$(pod_pids)" ]] || warn "pod processes still running: $(pod_pids | tr '\n' ' ')"

# 3. The shims serving this node's containerd (its socket path is on their command
# line), then containerd.
shim_pids() {
  local p
  for p in /proc/[0-9]*; do
    [[ "$(tr '\0' ' ' 2>/dev/null <"$p/cmdline")" == *"-address $run/containerd.sock "* ]] && echo "${p#/proc/}"
  done
}
for pid in $(shim_pids); do stop_pid "$pid"; done
stop_named containerd

# 4. Mounts: the node directory's (rootfs overlays, netns, shm, volumes) and
# /var/lib/kubelet's, deepest first.
umount_under() { # dir
  local prefix="$1" m
  [[ -n "$prefix" && "$prefix" != / ]] || return 0
  for _ in 1 2 3; do
    mapfile -t mounts < <(awk -v p="$prefix" '$2 == p || index($2, p "/") == 1 {print $2}' /proc/self/mounts | sort -r)
    ((${#mounts[@]})) || return 0
    for m in "${mounts[@]}"; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null; done
  done
  [[ -z "$(awk -v p="$prefix" '$2 == p || index($2, p "/") == 1' /proc/self/mounts)" ]] ||
    warn "mounts left under $prefix"
}
[[ -d "$dir" ]] && umount_under "$(realpath "$dir")"
umount_under /var/lib/kubelet
umount_under "$run"

# 5. The kubepods cgroups, leaves first, in every hierarchy.
for root in $(cgroup_roots); do
  [[ -d "$root/kubepods" ]] || continue
  find "$root/kubepods" -depth -type d -exec rmdir {} \; 2>/dev/null
  [[ -d "$root/kubepods" ]] && warn "cgroup $root/kubepods left"
done

# 6. kubelet's iptables chains, v4 and v6, and nothing else.
for ipt in iptables ip6tables; do
  command -v "$ipt" >/dev/null || continue
  for hook in INPUT OUTPUT; do
    while "$ipt" -w -t filter -C "$hook" -j KUBE-FIREWALL 2>/dev/null; do
      "$ipt" -w -t filter -D "$hook" -j KUBE-FIREWALL || break
    done
  done
  for table in filter nat mangle; do
    for chain in KUBE-FIREWALL KUBE-KUBELET-CANARY KUBE-IPTABLES-HINT; do
      if "$ipt" -w -t "$table" -S "$chain" >/dev/null 2>&1; then
        "$ipt" -w -t "$table" -F "$chain" && "$ipt" -w -t "$table" -X "$chain" ||
          warn "$ipt -t $table: cannot remove $chain"
      fi
    done
  done
done

# kube-proxy's chains and rules (KUBE-SERVICES, KUBE-SVC-*, KUBE-POSTROUTING, its nft
# table...): its own --cleanup knows them all, then none may be left.
if [[ -f "$host/kube-proxy" ]]; then
  proxy_bin="$(cat "$host/kube-proxy")"
  if [[ -x "$proxy_bin" ]]; then
    "$proxy_bin" --cleanup --v 0 >>"$dir/logs/kube-proxy-cleanup.log" 2>&1 || warn "kube-proxy --cleanup failed (log: $dir/logs/kube-proxy-cleanup.log)"
  else
    warn "no kube-proxy binary to clean its rules up with"
  fi
  for ipt in iptables ip6tables; do
    left="$("$ipt-save" 2>/dev/null | grep -Eo '^:KUBE-[A-Z0-9-]+' | tr '\n' ' ' || true)"
    [[ -z "$left" ]] || warn "$ipt chains left: $left"
  done
fi

# 7. Networking: the bridge (the Pods' veths went with their netns) and the node IP.
if [[ -f "$host/bridge" ]]; then
  bridge="$(cat "$host/bridge")"
  if ip link show "$bridge" >/dev/null 2>&1; then ip link del "$bridge" || warn "cannot delete $bridge"; fi
fi
if [[ -f "$host/lo-address" ]]; then
  addr="$(cat "$host/lo-address")"
  # (Not `ip | grep -q` under pipefail: grep leaving early fails the pipeline.)
  if [[ "$(ip -o addr show dev lo)" == *" $addr "* ]]; then ip addr del "$addr" dev lo || warn "cannot remove $addr from lo"; fi
fi

# 8. The sysctls, as they were before up.sh.
if [[ -f "$host/sysctls" ]]; then
  while IFS='=' read -r key value; do
    [[ "$(sysctl -n "$key")" == "$value" ]] || sysctl -qw "$key=$value" || warn "cannot restore $key=$value"
  done <"$host/sysctls"
fi

# 9. The Node object, if the control plane still answers.
if [[ -f "$cp_dir/kubeconfig" && -x "$(cat "$host/kubectl" 2>/dev/null)" ]]; then
  "$(cat "$host/kubectl")" --kubeconfig "$cp_dir/kubeconfig" --request-timeout 5s delete node "$name" \
    --ignore-not-found >/dev/null 2>&1 || true
fi

# 10. Files: what kubelet made outside the node directory (only if up.sh found it
# absent), the socket directory, and the node directory itself.
if [[ -f "$host/created-dirs" ]]; then
  while read -r d; do
    [[ -n "$d" && -e "$d" ]] && { rm -rf "$d" || warn "cannot remove $d"; }
  done <"$host/created-dirs"
fi
# kubelet's links to this node's container logs.
[[ -d /var/log/containers ]] && find /var/log/containers -maxdepth 1 -lname "$dir/pod-logs/*" -delete
rm -rf "$run"
if ! $keep; then rm -rf "$dir" || warn "cannot remove $dir"; fi
echo "node: stopped" >&2
exit "$failed"
