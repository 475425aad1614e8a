//go:build tools

// Package tools pins kube-router (github.com/cloudnativelabs/kube-router), run on the real node as the
// NetworkPolicy controller only (its firewall: iptables and ipset), where the kernel lacks the nft `queue`
// expression that kube-network-policies needs.
package tools

import _ "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"
