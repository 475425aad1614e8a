//go:build tools

// Package tools pins SIG Network's NetworkPolicy controller (sigs.k8s.io/kube-network-policies, the one kindnet
// uses), which enforces the chart's NetworkPolicy on the real node beside the CNI bridge (which ignores policies).
package tools

import _ "sigs.k8s.io/kube-network-policies/cmd"
