//go:build tools

// Package tools pins the upstream Kubernetes release whose control-plane
// binaries scripts/k8s-up.sh builds (kube-apiserver, kube-controller-manager,
// kube-scheduler, and the real node's kubelet and kube-proxy). Nothing here is compiled into anything.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
)
