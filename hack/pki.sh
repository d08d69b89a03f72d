#!/usr/bin/env bash
# Certificates for ramify-api and the node agents' endpoint, for the demo and the
# end-to-end tests (the Helm chart makes its own at install time):
#   ca.crt/key             signs the three below
#   api-serving.crt/key    ramify-api's serving certificate, for the aggregation layer
#                          (names ramify-api.<namespace>.svc; the APIService's caBundle is ca.crt)
#   api-client.crt/key     what ramify-api presents to node agents (names ramify-api)
#   agent.crt/key          the node agents' endpoint (names ramify-node-agent)
# Usage: hack/pki.sh DIR NAMESPACE. Existing files are kept (idempotent).
set -euo pipefail
dir="${1:?usage: hack/pki.sh DIR NAMESPACE}"; ns="${2:?usage: hack/pki.sh DIR NAMESPACE}"
mkdir -p "$dir"
cd "$dir"
if [[ ! -f ca.crt ]]; then
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 30 \
    -subj "/CN=ramify-internal-ca" 2>/dev/null
fi
sign() { # name cn eku san
  local name="$1" cn="$2" eku="$3" san="$4"
  [[ -f "$name.crt" ]] && return 0
  openssl genrsa -out "$name.key" 2048 2>/dev/null
  openssl req -new -key "$name.key" -subj "/CN=$cn" -out "$name.csr" 2>/dev/null
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=%s\nsubjectAltName=%s\n' \
    "$eku" "$san" >"$name.ext"
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 30 -sha256 \
    -extfile "$name.ext" -out "$name.crt" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
}
sign api-serving ramify-api serverAuth "DNS:ramify-api.$ns.svc,DNS:ramify-api.$ns.svc.cluster.local"
sign api-client ramify-api clientAuth "DNS:ramify-api"
sign agent ramify-node-agent serverAuth "DNS:ramify-node-agent"
chmod 600 ./*.key
echo "$dir"
