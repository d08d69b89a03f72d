#!/usr/bin/env bash
# Prints the objects that register a ramify-api running on this machine (loopback)
# with the local control plane: a selector-less Service, an EndpointSlice naming
# 127.0.0.1:PORT (type FQDN: the API server refuses loopback IPs in IP slices), and
# the APIService for subresources.ramify.dev (FQDN slices are deprecated, and the API
# server says so, but still served in 1.36). The API server routes to the slice's
# address because up.sh starts it with --enable-aggregator-routing. In a real cluster
# the Helm chart's Service selects the ramify-api pods instead.
# Usage: hack/apiservice.sh NAMESPACE PORT CA_FILE | kubectl apply -f -
set -euo pipefail
ns="${1:?usage: hack/apiservice.sh NAMESPACE PORT CA_FILE}"
port="${2:?usage: hack/apiservice.sh NAMESPACE PORT CA_FILE}"
ca="${3:?usage: hack/apiservice.sh NAMESPACE PORT CA_FILE}"
cat <<YAML
apiVersion: v1
kind: Service
metadata: {name: ramify-api, namespace: $ns}
spec:
  ports: [{name: https, port: 443, targetPort: $port, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: ramify-api-loopback
  namespace: $ns
  labels:
    kubernetes.io/service-name: ramify-api
    endpointslice.kubernetes.io/managed-by: ramify-local
addressType: FQDN
endpoints: [{addresses: ["127.0.0.1"], conditions: {ready: true}}]
ports: [{name: https, port: $port, protocol: TCP}]
---
apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata: {name: v1alpha1.subresources.ramify.dev}
spec:
  group: subresources.ramify.dev
  version: v1alpha1
  service: {namespace: $ns, name: ramify-api, port: 443}
  caBundle: $(base64 -w0 <"$ca")
  groupPriorityMinimum: 1000
  versionPriority: 100
YAML
