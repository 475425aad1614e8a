//go:build tools

// Package tools pins the etcd server that backs kube-apiserver.
package tools

import _ "go.etcd.io/etcd/server/v3"
