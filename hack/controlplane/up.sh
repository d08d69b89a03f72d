#!/usr/bin/env bash
# Starts a real Kubernetes control plane on loopback: etcd, kube-apiserver,
# kube-controller-manager (garbage collection, namespace deletion, service accounts)
# and kube-scheduler, with freshly generated certificates. Node,RBAC authorization and a
# kubelet client certificate, so a kubelet (hack/node/up.sh) can join and
# `kubectl logs/exec` reach it (the node's InternalIP first: its name resolves nowhere). Writes
#   $RAMIFY_CP_DIR/kubeconfig        (admin, group system:masters)
#   $RAMIFY_CP_DIR/env               (KUBECONFIG=..., PATH with kubectl)
# and returns once /readyz answers. Re-running it while the plane is healthy (and
# started with the same kube-apiserver flags) is a no-op.
#
# The aggregation layer is on: a front-proxy CA of its own ($RAMIFY_CP_DIR/pki/
# front-proxy-ca.crt) signs the client certificate the API server presents to
# aggregated API servers (ramify-api), and --enable-aggregator-routing sends their
# traffic to their EndpointSlice addresses (there is no kube-proxy on loopback).
# Stop it with down.sh (same RAMIFY_CP_DIR).
#
# Environment: RAMIFY_CP_DIR (default: <repo>/.ramify/controlplane),
# RAMIFY_CP_PORT_BASE (default 16440: apiserver +3, etcd client +0, etcd peer +1,
# controller-manager +4, scheduler +5), RAMIFY_CP_ADVERTISE_ADDRESS (default: none, the
# API server listens and advertises on 127.0.0.1 only; set to the real node's IP,
# hack/node/up.sh's RAMIFY_NODE_IP, for Pods to reach it through the `kubernetes`
# Service: it then listens on every address, and a loopback advertise address would give
# that Service no endpoints).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dir="${RAMIFY_CP_DIR:-$repo/.ramify/controlplane}"
base="${RAMIFY_CP_PORT_BASE:-16440}"
etcd_port=$((base)); peer_port=$((base + 1)); api_port=$((base + 3))
kcm_port=$((base + 4)); sched_port=$((base + 5))

log() { echo "controlplane: $*" >&2; }
die() { echo "controlplane: FAILED: $*" >&2; exit 1; }

bin="$("$here/build.sh")" || die "building the control plane failed"
mkdir -p "$dir/pki" "$dir/logs" "$dir/run"

pki="$dir/pki"
advertise="${RAMIFY_CP_ADVERTISE_ADDRESS:-}"
bind=127.0.0.1; [[ -z "$advertise" ]] || bind=0.0.0.0
apiserver_args=(
  --etcd-servers "http://127.0.0.1:$etcd_port"
  --bind-address "$bind" --advertise-address "${advertise:-127.0.0.1}" --secure-port "$api_port"
  --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key"
  --client-ca-file "$pki/ca.crt"
  --service-account-issuer https://kubernetes.default.svc
  --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key"
  --service-cluster-ip-range 10.0.0.0/24 --allow-privileged=true
  --authorization-mode Node,RBAC --cert-dir "$dir/apiserver-certs"
  --requestheader-client-ca-file "$pki/front-proxy-ca.crt"
  --requestheader-allowed-names front-proxy-client
  --requestheader-username-headers X-Remote-User
  --requestheader-uid-headers X-Remote-Uid
  --requestheader-group-headers X-Remote-Group
  --requestheader-extra-headers-prefix X-Remote-Extra-
  --proxy-client-cert-file "$pki/front-proxy-client.crt"
  --proxy-client-key-file "$pki/front-proxy-client.key"
  --enable-aggregator-routing=true
  --kubelet-client-certificate "$pki/apiserver-kubelet-client.crt"
  --kubelet-client-key "$pki/apiserver-kubelet-client.key"
  --kubelet-preferred-address-types InternalIP,Hostname
)
args_stamp="$(printf '%s\n' "${apiserver_args[@]}" | sha256sum | cut -c1-16)"

healthy() {
  [[ -f "$dir/kubeconfig" ]] &&
    [[ "$(cat "$dir/run/kube-apiserver.args" 2>/dev/null)" == "$args_stamp" ]] &&
    "$bin/kubectl" --kubeconfig "$dir/kubeconfig" get --raw /readyz >/dev/null 2>&1
}
if healthy; then log "already running ($dir)"; echo "$dir"; exit 0; fi
# A half-started plane from an earlier run: stop it first.
"$here/down.sh" --keep >/dev/null 2>&1 || true
mkdir -p "$dir/pki" "$dir/logs" "$dir/run"

gen_cert() { # name cn org [san] [ca]
  local name="$1" cn="$2" org="$3" san="${4:-}" ca="${5:-ca}"
  local subj="/CN=$cn"; [[ -n "$org" ]] && subj="/O=$org$subj"
  openssl genrsa -out "$pki/$name.key" 2048 2>/dev/null
  openssl req -new -key "$pki/$name.key" -subj "$subj" -out "$pki/$name.csr" 2>/dev/null
  local ext="$pki/$name.ext"
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    if [[ -n "$san" ]]; then echo "extendedKeyUsage=serverAuth,clientAuth"; echo "subjectAltName=$san"
    else echo "extendedKeyUsage=clientAuth"; fi
  } >"$ext"
  openssl x509 -req -in "$pki/$name.csr" -CA "$pki/$ca.crt" -CAkey "$pki/$ca.key" -CAcreateserial \
    -days 30 -sha256 -extfile "$ext" -out "$pki/$name.crt" 2>/dev/null
}
if [[ ! -f "$pki/ca.crt" ]]; then
  log "generating certificates"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$pki/ca.key" -out "$pki/ca.crt" \
    -days 30 -subj "/CN=ramify-test-ca" 2>/dev/null
  gen_cert apiserver kube-apiserver "" "IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
  gen_cert admin ramify-admin system:masters
  gen_cert controller-manager system:kube-controller-manager ""
  gen_cert scheduler system:kube-scheduler ""
  openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
  openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
fi
# Its own CA, as kubeadm does: a user certificate from ca.crt must never pass for the
# front proxy (which aggregated API servers trust to name the user).
if [[ ! -f "$pki/front-proxy-client.crt" ]]; then
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$pki/front-proxy-ca.key" -out "$pki/front-proxy-ca.crt" \
    -days 30 -subj "/CN=ramify-test-front-proxy-ca" 2>/dev/null
  gen_cert front-proxy-client front-proxy-client "" "" front-proxy-ca
fi

# What the API server presents to kubelets (logs, exec, port-forward): bound below to
# system:kubelet-api-admin, which a kubelet's webhook authorization checks.
if [[ ! -f "$pki/apiserver-kubelet-client.crt" ]]; then
  gen_cert apiserver-kubelet-client kube-apiserver-kubelet-client ""
fi

kubeconfig() { # file user
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: ramify
  cluster:
    server: https://127.0.0.1:$api_port
    certificate-authority: $pki/ca.crt
users:
- name: $2
  user:
    client-certificate: $pki/$2.crt
    client-key: $pki/$2.key
contexts:
- name: ramify
  context: {cluster: ramify, user: $2, namespace: default}
current-context: ramify
EOF
}
kubeconfig "$dir/kubeconfig" admin
kubeconfig "$dir/controller-manager.kubeconfig" controller-manager
kubeconfig "$dir/scheduler.kubeconfig" scheduler

# shellcheck source=../lib/daemon.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/daemon.sh"

# etcd and kube-apiserver run at a higher CPU weight than the sandboxes and tools on
# this machine: a control plane has machines of its own in a real cluster, and here it
# shares two cores with a hundred restoring sandboxes. Our own processes only (root may
# lower a niceness; see `start` for why the session's group is set too); no host setting
# changes. RAMIFY_CP_NICE=0 turns it off.
prio="${RAMIFY_CP_NICE:--5}"

log "starting etcd on 127.0.0.1:$etcd_port"
DAEMON_NICE="$prio" start etcd "$bin/etcd" --name ramify --data-dir "$dir/etcd" \
  --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
  --listen-peer-urls "http://127.0.0.1:$peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
  --initial-cluster "ramify=http://127.0.0.1:$peer_port" --unsafe-no-fsync=true --log-level warn
wait_for etcd 30 curl -sf "http://127.0.0.1:$etcd_port/health"

log "starting kube-apiserver on https://127.0.0.1:$api_port"
DAEMON_NICE="$prio" start kube-apiserver "$bin/kube-apiserver" "${apiserver_args[@]}"
wait_for kube-apiserver 120 "$bin/kubectl" --kubeconfig "$dir/kubeconfig" get --raw /readyz
"$bin/kubectl" --kubeconfig "$dir/kubeconfig" apply -f - >/dev/null <<EOF || die "binding the kubelet client failed"
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "kube-apiserver:kubelet-client"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:kubelet-api-admin"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: kube-apiserver-kubelet-client}
EOF
echo "$args_stamp" >"$dir/run/kube-apiserver.args"

log "starting kube-controller-manager and kube-scheduler"
start kube-controller-manager "$bin/kube-controller-manager" \
  --kubeconfig "$dir/controller-manager.kubeconfig" \
  --authentication-kubeconfig "$dir/controller-manager.kubeconfig" \
  --authorization-kubeconfig "$dir/controller-manager.kubeconfig" \
  --bind-address 127.0.0.1 --secure-port "$kcm_port" --leader-elect=false \
  --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
  --use-service-account-credentials=true --controllers '*'
start kube-scheduler "$bin/kube-scheduler" \
  --kubeconfig "$dir/scheduler.kubeconfig" \
  --authentication-kubeconfig "$dir/scheduler.kubeconfig" \
  --authorization-kubeconfig "$dir/scheduler.kubeconfig" \
  --bind-address 127.0.0.1 --secure-port "$sched_port" --leader-elect=false
wait_for kube-controller-manager 60 curl -skf "https://127.0.0.1:$kcm_port/healthz"
wait_for kube-scheduler 60 curl -skf "https://127.0.0.1:$sched_port/healthz"
# The default ServiceAccount shows the controller manager really works.
wait_for kube-controller-manager 60 "$bin/kubectl" --kubeconfig "$dir/kubeconfig" -n default get serviceaccount default

cat >"$dir/env" <<EOF
export KUBECONFIG=$dir/kubeconfig
export PATH=$bin:\$PATH
EOF
log "ready: KUBECONFIG=$dir/kubeconfig (kubectl in $bin)"
echo "$dir"
