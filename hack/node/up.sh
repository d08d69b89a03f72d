#!/usr/bin/env bash
# Starts a real Kubernetes node against the running test control plane
# (hack/controlplane/up.sh): containerd 2.x (runc from Debian, CNI bridge + host-local),
# the kubelet, registered as Node $RAMIFY_NODE_NAME, and kube-proxy (iptables mode: Pods
# reach Services, the `kubernetes` one included, by ClusterIP), and returns once the Node
# is Ready and kube-proxy has programmed the Services. Prints the node directory. Stop it with down.sh (same environment), which
# leaves nothing behind. `up.sh restart-kubelet` starts the kubelet of a running node
# again after a test killed it.
#
# Everything the node writes lives under $RAMIFY_NODE_DIR, except what kubelet and
# containerd do not let us move: the node IP on lo, the bridge, the kubepods cgroups,
# kubelet's iptables chains, /var/lib/kubelet/device-plugins, /var/log/containers and
# a short socket directory under /run. up.sh records what it touches in $dir/host so
# down.sh puts back exactly that.
#
# This VM's settings (../../../shared/notes/real-node-kubelet-containerd.md): no
# CAP_SYS_RESOURCE (restrict_oom_score_adj), cgroup v1 (failCgroupV1: false, cgroupfs),
# no systemd, and a loopback node IP is refused (so an address of its own on lo).
#
# Environment: RAMIFY_CP_DIR, RAMIFY_CP_PORT_BASE (as for the control plane; the kubelet
# listens on base+10 and its healthz on base+11), RAMIFY_NODE_DIR (default: the control
# plane directory's sibling `node`), RAMIFY_NODE_NAME (ramify-node), RAMIFY_NODE_IP
# (10.213.1.1), RAMIFY_NODE_SUBNET (10.91.0.0/16), RAMIFY_NODE_BRIDGE (rmynode0);
# kube-proxy's healthz on base+12, its metrics on base+13;
# RAMIFY_NODE_INSECURE_REGISTRIES (comma-separated HOST:PORT: registries containerd pulls
# from over plain HTTP, e.g. the test registry on loopback). Pods reach the API server
# only when the plane advertises an address they can route to
# (RAMIFY_CP_ADVERTISE_ADDRESS=<the node IP> for hack/controlplane/up.sh): a loopback
# advertise address gets no `kubernetes` endpoints at all.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cp_dir="${RAMIFY_CP_DIR:-$repo/.ramify/controlplane}"
dir="${RAMIFY_NODE_DIR:-$(dirname "$cp_dir")/node}"
base="${RAMIFY_CP_PORT_BASE:-16440}"
name="${RAMIFY_NODE_NAME:-ramify-node}"
node_ip="${RAMIFY_NODE_IP:-10.213.1.1}"
subnet="${RAMIFY_NODE_SUBNET:-10.91.0.0/16}"
bridge="${RAMIFY_NODE_BRIDGE:-rmynode0}"
kubelet_port=$((base + 10)); healthz_port=$((base + 11))
proxy_healthz_port=$((base + 12)); proxy_metrics_port=$((base + 13))
# Shim sockets must fit a unix socket path (108 bytes): a short directory of their own.
run="/run/ramify-node-$base"

log() { echo "node: $*" >&2; }
die() { echo "node: FAILED: $*" >&2; exit 1; }

[[ -f "$cp_dir/kubeconfig" && -f "$cp_dir/pki/ca.key" ]] ||
  die "no control plane in $cp_dir: run hack/controlplane/up.sh first"
bin="$("$here/build.sh")" || die "building the node failed"
cp_bin="$("$repo/hack/controlplane/build.sh")" || die "building the control plane failed"
kubectl=("$cp_bin/kubectl" --kubeconfig "$cp_dir/kubeconfig")
for tool in runc iptables ip6tables ip sysctl curl openssl; do
  command -v "$tool" >/dev/null || die "$tool missing: run hack/install-deps.sh"
done
cni_bin=/usr/lib/cni
for plugin in bridge host-local loopback; do
  [[ -x "$cni_bin/$plugin" ]] || die "CNI plugin $cni_bin/$plugin missing: run hack/install-deps.sh"
done

ready() {
  [[ "$("${kubectl[@]}" get node "$name" \
    -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" == True ]]
}
# The kubelet, on the node this script set up (also `up.sh restart-kubelet`, after a
# test killed it: its Pods' containers kept running under containerd).
start_kubelet() {
  log "starting kubelet $("$bin/kubelet" --version | awk '{print $2}') as node $name ($node_ip)"
  start kubelet "$bin/kubelet" --config "$dir/kubelet.yaml" --kubeconfig "$dir/kubelet.kubeconfig" \
    --root-dir "$dir/kubelet" --cert-dir "$dir/pki" --hostname-override "$name" --node-ip "$node_ip" \
    --v 1
  wait_for kubelet 120 curl -sf "http://127.0.0.1:$healthz_port/healthz"
  wait_for kubelet 120 ready
  # kubelet sets these at start (vm.overcommit_memory=1, kernel.panic=10,
  # kernel.panic_on_oops=1); this is a shared machine: put them back now it has.
  local key value now
  while IFS='=' read -r key value; do
    [[ "$key" == net.ipv4.ip_forward ]] && continue # the CNI bridge needs it while Pods run
    now="$(sysctl -n "$key")"
    if [[ "$now" != "$value" ]]; then
      log "putting back $key=$value (kubelet set $now)"
      sysctl -qw "$key=$value" || die "cannot put back $key=$value"
    fi
  done <"$dir/host/sysctls"
}
# shellcheck source=../lib/daemon.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/daemon.sh"
if [[ "${1:-}" == restart-kubelet ]]; then
  [[ -f "$dir/kubelet.yaml" && -f "$dir/host/sysctls" ]] || die "no node in $dir to restart the kubelet of"
  if [[ -f "$dir/run/kubelet.pid" ]] && kill -0 "$(cat "$dir/run/kubelet.pid")" 2>/dev/null; then
    die "the kubelet of $dir still runs (pid $(cat "$dir/run/kubelet.pid"))"
  fi
  start_kubelet
  echo "$dir"; exit 0
fi
if [[ -f "$dir/run/kubelet.pid" ]] && kill -0 "$(cat "$dir/run/kubelet.pid")" 2>/dev/null && ready; then
  log "already running ($dir)"; echo "$dir"; exit 0
fi
# A half-started node from an earlier run: stop it first (down.sh is idempotent).
"$here/down.sh" >/dev/null 2>&1 || true
mkdir -p "$dir"/{pki,logs,run,host,cni/net.d,cni/ipam,containerd,kubelet,pod-logs} "$run"

# What up.sh changes on the host, recorded before it changes anything, for down.sh.
host="$dir/host"
# kube-proxy is configured to change none (conntrack and route_localnet left alone);
# they are recorded all the same, so a change would be put back.
for key in vm.overcommit_memory kernel.panic kernel.panic_on_oops net.ipv4.ip_forward \
  net.ipv4.conf.all.route_localnet net.netfilter.nf_conntrack_max \
  net.netfilter.nf_conntrack_tcp_timeout_established net.netfilter.nf_conntrack_tcp_timeout_close_wait; do
  value="$(sysctl -n "$key" 2>/dev/null)" || continue # conntrack's exist once its module is loaded
  echo "$key=$value"
done >"$host/sysctls"
for d in /var/lib/kubelet /var/log/containers /var/log/pods; do
  [[ -e "$d" ]] || echo "$d"
done >"$host/created-dirs"
echo "$node_ip/32" >"$host/lo-address"
echo "$bridge" >"$host/bridge"
echo "$run" >"$host/run-dir"
echo "$cp_bin/kubectl" >"$host/kubectl"

pki="$dir/pki"
sign() { # name subject eku san
  local name="$1" subj="$2" eku="$3" san="$4"
  openssl genrsa -out "$pki/$name.key" 2048 2>/dev/null
  openssl req -new -key "$pki/$name.key" -subj "$subj" -out "$pki/$name.csr" 2>/dev/null
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    [[ -n "$san" ]] && echo "subjectAltName=$san"
  } >"$pki/$name.ext"
  openssl x509 -req -in "$pki/$name.csr" -CA "$cp_dir/pki/ca.crt" -CAkey "$cp_dir/pki/ca.key" \
    -CAcreateserial -days 30 -sha256 -extfile "$pki/$name.ext" -out "$pki/$name.crt" 2>/dev/null
  rm -f "$pki/$name.csr" "$pki/$name.ext"
}
# The node's identity for the Node authorizer, and the kubelet's serving certificate.
sign kubelet-client "/O=system:nodes/CN=system:node:$name" clientAuth ""
sign kubelet-serving "/CN=$name" serverAuth "IP:$node_ip,DNS:$name"
# kube-proxy's identity: the built-in system:node-proxier role is bound to this user.
sign kube-proxy-client "/CN=system:kube-proxy" clientAuth ""
api_server="$(awk '/server:/ {print $2; exit}' "$cp_dir/kubeconfig")"
kubeconfig() { # client-cert-name
  cat <<EOF
apiVersion: v1
kind: Config
clusters:
- name: ramify
  cluster: {server: "$api_server", certificate-authority: "$cp_dir/pki/ca.crt"}
users:
- name: node
  user: {client-certificate: "$pki/$1.crt", client-key: "$pki/$1.key"}
contexts:
- name: ramify
  context: {cluster: ramify, user: node}
current-context: ramify
EOF
}
kubeconfig kubelet-client >"$dir/kubelet.kubeconfig"
kubeconfig kube-proxy-client >"$dir/kube-proxy.kubeconfig"

# The node IP: kubelet refuses a loopback address, and this kernel has no dummy links.
ip addr add "$node_ip/32" dev lo 2>/dev/null || [[ "$(ip -o addr show dev lo)" == *" $node_ip/32 "* ]] ||
  die "cannot add $node_ip/32 to lo"

cat >"$dir/cni/net.d/10-ramify-node.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "ramify-node",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$bridge",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {"type": "host-local", "ranges": [[{"subnet": "$subnet"}]], "dataDir": "$dir/cni/ipam",
               "routes": [{"dst": "0.0.0.0/0"}]}
    }
  ]
}
EOF

# Plain-HTTP registries (hosts.toml per registry; every other registry is HTTPS).
mkdir -p "$dir/certs.d"
IFS=',' read -ra insecure <<<"${RAMIFY_NODE_INSECURE_REGISTRIES:-}"
for reg in "${insecure[@]}"; do
  [[ "$reg" =~ ^[A-Za-z0-9.-]+:[0-9]+$ ]] || die "RAMIFY_NODE_INSECURE_REGISTRIES: $reg is not HOST:PORT"
  mkdir -p "$dir/certs.d/$reg"
  printf 'server = "http://%s"\n[host."http://%s"]\n  capabilities = ["pull", "resolve"]\n' "$reg" "$reg" \
    >"$dir/certs.d/$reg/hosts.toml"
done

ctrd="$dir/containerd"
sandbox_image="$(cat "$bin/images/pause.ref")"
cat >"$ctrd/config.toml" <<EOF
version = 3
root = "$ctrd/root"
state = "$ctrd/state"
[grpc]
  address = "$run/containerd.sock"
[ttrpc]
  address = "$run/containerd.sock.ttrpc"
[plugins.'io.containerd.shim.v1.manager']
  socket_dir = "$run/s"
[plugins.'io.containerd.internal.v1.opt']
  path = "$ctrd/opt"
[plugins.'io.containerd.nri.v1.nri']
  disable = true
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = "$dir/certs.d"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "$sandbox_image"
[plugins.'io.containerd.cri.v1.runtime']
  # No CAP_SYS_RESOURCE here: without it every container fails to lower its oom_score_adj.
  restrict_oom_score_adj = true
  # Pod network namespaces under the state directory, not /var/run/netns.
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["$cni_bin"]
    conf_dir = "$dir/cni/net.d"
    max_conf_num = 1
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "$(command -v runc)"
        Root = "$run/runc"
        SystemdCgroup = false
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
EOF

ctr=("$bin/ctr" --address "$run/containerd.sock" -n k8s.io)

log "starting containerd ($("$bin/containerd" --version | awk '{print $3}'))"
PATH="$bin:$PATH" start containerd "$bin/containerd" --config "$ctrd/config.toml"
wait_for containerd 60 "${ctr[@]}" version
for image in pause busybox; do
  "${ctr[@]}" images import --local "$bin/images/$image.tar" >>"$dir/logs/ctr.log" 2>&1 ||
    die "importing $bin/images/$image.tar failed"
done

cat >"$dir/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $node_ip
port: $kubelet_port
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $healthz_port
tlsCertFile: $pki/kubelet-serving.crt
tlsPrivateKeyFile: $pki/kubelet-serving.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $cp_dir/pki/ca.crt}
authorization: {mode: Webhook}
containerRuntimeEndpoint: unix://$run/containerd.sock
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
podLogsDir: $dir/pod-logs
resolvConf: /etc/resolv.conf
clusterDomain: cluster.local
maxPods: 30
serializeImagePulls: false
rotateCertificates: false
serverTLSBootstrap: false
# A shared development disk: never evict the test Pods nor collect the imported images
# for lack of space (imports are not pulls; a collected image could not come back).
evictionHard: {nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
EOF

start_kubelet

cat >"$dir/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $dir/kube-proxy.kubeconfig}
hostnameOverride: $name
mode: iptables
clusterCIDR: $subnet
bindAddress: $node_ip
healthzBindAddress: 127.0.0.1:$proxy_healthz_port
metricsBindAddress: 127.0.0.1:$proxy_metrics_port
# NodePorts only on the node IP, never on 127.0.0.1 (that would set route_localnet).
nodePortAddresses: ["$node_ip/32"]
iptables: {localhostNodePorts: false}
# Leave the host's conntrack settings as they are (a shared machine).
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
log "starting kube-proxy $("$bin/kube-proxy" --version | awk '{print $2}') (iptables mode)"
echo "$bin/kube-proxy" >"$host/kube-proxy" # down.sh runs its --cleanup
start kube-proxy "$bin/kube-proxy" --config "$dir/kube-proxy.yaml" --v 1
# Its healthz answers 200 once it has programmed the Services at least once.
wait_for kube-proxy 120 curl -sf "http://127.0.0.1:$proxy_healthz_port/healthz"
log "ready: node $name (kubelet on $node_ip:$kubelet_port, pods on $subnet via $bridge, Services by kube-proxy)"
echo "$dir"
