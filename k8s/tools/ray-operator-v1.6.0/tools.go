//go:build tools

// Package tools pins KubeRay v1.6.0, a stand-in: the Go module proxy refuses the
// v1.7.0 zip the chart targets (403 "This module version is not available").
package tools

import _ "github.com/ray-project/kuberay/ray-operator"
