//go:build tools

// Package tools records the commands this module builds so `go mod tidy` keeps them.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
