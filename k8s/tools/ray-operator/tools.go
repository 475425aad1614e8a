//go:build tools

// Package tools pins the KubeRay operator the chart targets, v1.7.0. The Go module proxy refuses its zip (403),
// so go.mod replaces the module with its source vendored unchanged in k8s/third_party/kuberay-ray-operator
// (README there: upstream commit, what was kept, SHA256SUMS); its dependencies come from the proxy.
package tools

import _ "github.com/ray-project/kuberay/ray-operator"
