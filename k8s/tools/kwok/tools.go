//go:build tools

// Package tools pins kwok, which simulates nodes and Pod status.
package tools

import _ "sigs.k8s.io/kwok/cmd/kwok"
