//go:build tools

// Package tools pins the KubeRay operator the chart targets.
package tools

import _ "github.com/ray-project/kuberay/ray-operator"
