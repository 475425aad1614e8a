// Command coredns is CoreDNS v1.15.0 with only the plugins the real node's cluster DNS needs (scripts/k8s-up.sh
// node): Service and Pod names from the API server (kubernetes), a cache, and the probes. CoreDNS's own
// plugin.cfg compiles some fifty plugins and their cloud SDKs in; a wrapper that sets the directive list is
// CoreDNS's documented way to build a smaller one.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
)

// Directives in CoreDNS's plugin.cfg order (the order a request passes them).
var directives = []string{"errors", "health", "ready", "cache", "kubernetes"}

func init() { dnsserver.Directives = directives }

func main() { coremain.Run() }
