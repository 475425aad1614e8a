# The real node of `scripts/k8s-up.sh up --real-node` (sourced by it; uses its start, wait_for, log, api):
# containerd + runc, the CNI bridge, kubelet, kube-proxy, CoreDNS and the NetworkPolicy controller (kube-network-
# policies, or kube-router's firewall where nft's `queue` is missing), in a network namespace of their own.
#
# The host's network namespace is left as it is: no link, address, route or iptables rule is added there. The
# whole control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) runs inside the node's
# namespace too, so the API server reaches the kubelet (logs, exec) and the Pods (its proxy) directly, and the Pods
# reach the API server through the `kubernetes` Service. One relay crosses over: socat listens on the host's
# 127.0.0.1:$PORT and hands each connection through a Unix socket in the state dir to a socat inside the namespace,
# which connects to the API server there. helm, kubectl, the tests and the KubeRay operator (out of cluster, with
# `--use-kubernetes-proxy` to reach the Ray dashboard through the API server) all use that relay.
#
# Inside the namespace: a veth pair (this kernel has no `dummy` links) gives the node its address $NODE_IP; the CNI
# bridge `cni0` holds the Pods ($POD_CIDR, host-local IPAM); CoreDNS listens on $NODE_IP:53. The daemons are started
# with `nsenter --net=` (not `ip netns exec`, which remounts /sys and hides the cgroup v1 hierarchies); they share
# the host's mount namespace, so `down` unmounts what they leave under the state dir and removes the node's cgroups.
#
# What this machine needed (cgroup v1 hybrid, no CAP_SYS_RESOURCE): kubelet `failCgroupV1: false` and
# `cgroupDriver: cgroupfs`; containerd `restrict_oom_score_adj`; runc (crun refuses the hybrid hierarchy);
# kube-proxy `masqueradeAll` (no br_netfilter: without SNAT a Pod's reply to a Service client on the same bridge
# would skip the conntrack that undoes the DNAT).

NODE_NAME=k8s-up-node
NODE_IP=10.200.0.1
POD_CIDR=10.244.0.0/24
CLUSTER_CIDR=10.244.0.0/16
SERVICE_CIDR=10.96.0.0/16
PAUSE_IMAGE=registry.k8s.io/pause:3.10.2

# Debian's containerd, runc, CNI plugins, socat, nft and ipset (installed when missing: CI's fresh machine has none of
# them; kube-router's firewall needs ipset).
node_packages() {
  local missing=() tool
  for tool in containerd runc ctr socat nft ipset; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  [[ -x /usr/lib/cni/bridge ]] || missing+=(cni)
  ((${#missing[@]})) || return 0
  log "installing containerd, runc, containernetworking-plugins, socat, nftables and ipset (missing: ${missing[*]})"
  local packages=(containerd runc containernetworking-plugins socat nftables ipset)
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${packages[@]}" >&2 ||
    { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${packages[@]}" >&2; }
}

netns_of_state() { echo "k8s-up-$(echo "$STATE" | sha256sum | cut -c1-8)"; }  # one namespace per state dir

# A command in the node's namespace (`start` is given nsenter itself, so that its pid file names the daemon).
in_node() { nsenter --net="/run/netns/$NETNS" "$@"; }

ctr_node() { ctr --address "$STATE/containerd/containerd.sock" --namespace k8s.io "$@"; }

node_netns_up() {
  # containerd's shims and ctr keep their sockets and fifos in /run/containerd (fixed paths): removed when empty.
  rmdir /run/containerd/s /run/containerd/fifo /run/containerd/runc/k8s.io /run/containerd/runc /run/containerd \
    2>/dev/null || true
  if [[ -e /run/netns/$NETNS ]]; then return; fi
  # One real node per machine: its cgroup root, /run/containerd and /var/log/containers are fixed paths.
  local other
  for other in /run/netns/k8s-up-*; do
    [[ -e $other ]] || continue
    log "another real node is up (network namespace ${other##*/}); one per machine: stop it with its K8S_STATE" \
        "(scripts/k8s-up.sh down), or remove the namespace if nothing runs in it"
    exit 1
  done
  ip netns add "$NETNS"
  echo "$NETNS" > "$STATE/netns"
  ip -n "$NETNS" link set lo up
  ip -n "$NETNS" link add node0 type veth peer name node1
  ip -n "$NETNS" addr add "$NODE_IP/24" dev node0
  ip -n "$NETNS" link set node0 up
  ip -n "$NETNS" link set node1 up
  # kubelet and kube-proxy look for a default route to pick the node's address and interface.
  ip -n "$NETNS" route add default via "${NODE_IP%.*}.254" dev node0 onlink
  in_node sysctl -qw net.ipv4.ip_forward=1 net.ipv4.conf.all.route_localnet=1
  log "network namespace $NETNS: node address $NODE_IP"
}

# The API server's relay from the host's loopback into the namespace (see the top of this file).
api_relay_up() {
  start api-relay-node nsenter "--net=/run/netns/$NETNS" socat "UNIX-LISTEN:$STATE/api.sock,fork,unlink-early" "TCP:127.0.0.1:$PORT"
  start api-relay-host socat "TCP-LISTEN:$PORT,bind=127.0.0.1,reuseaddr,fork" "UNIX-CONNECT:$STATE/api.sock"
}

# pause_archive: the sandbox image, built from the pause.c of the Kubernetes module (statically linked, as
# Kubernetes' own build/pause does) into an OCI archive in the cache; rebuilt when the source changes.
pause_archive() {
  local src out=$CACHE/images/pause.oci.tar
  src=$(cd "$tools/kubernetes" && go list -m -f '{{.Dir}}' k8s.io/kubernetes)/build/pause/linux/pause.c
  local stamp; stamp=$(sha256sum "$src" | cut -c1-16)
  if [[ -f $out && -f $out.stamp && $(cat "$out.stamp") == "$stamp" ]]; then echo "$out"; return; fi
  local tmp; tmp=$(mktemp -d)
  mkdir -p "$tmp/root" "$tmp/oci/blobs/sha256" "$CACHE/images"
  gcc -Os -Wall -Werror -static -DVERSION="v${PAUSE_IMAGE##*:}-k8s-up" -o "$tmp/root/pause" "$src"
  tar -C "$tmp/root" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf "$tmp/layer.tar" pause
  oci_archive "$tmp/oci" "$tmp/layer.tar" '{"Entrypoint":["/pause"],"User":"65535:65535"}' "$PAUSE_IMAGE" "$out"
  echo "$stamp" > "$out.stamp"
  rm -rf "$tmp"
  log "built the pause image $PAUSE_IMAGE into $out"
  echo "$out"
}

# oci_archive <dir> <layer tar> <config json> <image name> <out>: a one-layer OCI image archive that
# `ctr images import` names <image name>.
oci_archive() {
  local dir=$1 layer=$2 config=$3 name=$4 out=$5
  blob() {  # blob <file>: into blobs/, prints "<digest> <size>"
    local d; d=$(sha256sum "$1" | cut -d' ' -f1)
    cp "$1" "$dir/blobs/sha256/$d"; echo "sha256:$d $(stat -c %s "$1")"
  }
  local l c m
  read -r -a l <<< "$(blob "$layer")"
  printf '{"architecture":"amd64","os":"linux","config":%s,"rootfs":{"type":"layers","diff_ids":["%s"]}}' \
    "$config" "${l[0]}" > "$dir/config.json"
  read -r -a c <<< "$(blob "$dir/config.json")"
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"%s","size":%s}]}' \
    "${c[0]}" "${c[1]}" "${l[0]}" "${l[1]}" > "$dir/manifest.json"
  read -r -a m <<< "$(blob "$dir/manifest.json")"
  printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"%s","size":%s,"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
    "${m[0]}" "${m[1]}" "$name" "${name##*:}" > "$dir/index.json"
  echo '{"imageLayoutVersion":"1.0.0"}' > "$dir/oci-layout"
  rm "$dir/config.json" "$dir/manifest.json"
  tar -C "$dir" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf "$out" oci-layout index.json blobs
}

# import_images <archive>...: OCI or docker archives into the node's containerd (the CRI's namespace), where the
# kubelet finds them; a Pod's image must be here (the node cannot pull), with imagePullPolicy IfNotPresent.
import_images() {
  local archive
  for archive in "$@"; do
    [[ -f $archive ]] || { log "no image archive $archive"; exit 1; }
    local t0=$SECONDS
    ctr_node images import --all-platforms "$archive" >&2
    log "imported $archive in $((SECONDS - t0))s"
  done
}

# containerd's root (images, unpacked snapshots) is in the cache, so that the test image is imported once per cache
# rather than per state dir (several GB unpacked); its state (sockets, mounts of running containers) is per state dir.
containerd_config() {
  local d=$STATE/containerd
  mkdir -p "$d" "$STATE/cni/net.d"
  cat > "$d/config.toml" <<EOF
version = 2
root = "$CACHE/containerd"
state = "$d/state"
[grpc]
  address = "$d/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = "$d/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$STATE/cni/net.d"
EOF
  cat > "$STATE/cni/net.d/10-bridge.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "k8s-up", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}],
            "dataDir": "$STATE/cni/ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}},
  {"type": "loopback"}]}
EOF
}

kubelet_config() {
  cat > "$STATE/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /$NODE_NAME
containerRuntimeEndpoint: unix://$STATE/containerd/containerd.sock
podLogsDir: $STATE/pod-logs
# Only the API server reaches the kubelet's port (it is inside the node's namespace), and it has no client
# certificate here: anonymous, allowed.
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
clusterDomain: cluster.local
clusterDNS: [$NODE_IP]
resolvConf: $STATE/resolv.conf
failSwapOn: false
# No CFS quota for CPU limits: on a 2-core node the pods' limits are fractions of a core (the chart sets limits =
# requests), and Ray's head, throttled to 0.4 of a core, timed out starting its raylet. Requests still divide the
# node (CPU shares, and the scheduler's bookkeeping).
cpuCFSQuota: false
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
# The host's disk is shared: evict for real shortage only, and keep the test image (never garbage-collected).
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%}
imageGCHighThresholdPercent: 100
serializeImagePulls: false
EOF
  : > "$STATE/resolv.conf"  # no upstream resolver: only cluster names resolve (CoreDNS answers them)
}

kube_proxy_config() {
  cat > "$STATE/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $STATE/kubeconfig}
hostnameOverride: $NODE_NAME
mode: iptables
clusterCIDR: $CLUSTER_CIDR
iptables: {masqueradeAll: true}
# conntrack's limits are the host's (a global sysctl): left as they are.
conntrack: {maxPerCore: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
EOF
}

coredns_config() {
  cat > "$STATE/Corefile" <<EOF
cluster.local:53 in-addr.arpa:53 {
  errors
  health 127.0.0.1:8080
  ready 127.0.0.1:8181
  kubernetes cluster.local in-addr.arpa {
    kubeconfig $STATE/kubeconfig
    pods insecure
  }
  cache 30
}
EOF
}

node_cgroup_dirs() {  # the node's cgroup root in every hierarchy (kubelet requires it to exist)
  local h
  for h in /sys/fs/cgroup/*/; do
    [[ -e $h/cgroup.procs ]] && echo "${h%/}/$NODE_NAME"
  done
}

# The kubelet links each container's log into /var/log/containers (a fixed path): those pointing into this node's
# state go, and the folder with them if nothing else is there.
forget_container_log_links() {
  local link
  for link in /var/log/containers/*.log; do
    [[ -L $link && $(readlink "$link") == "$STATE"/* ]] && rm -f "$link"
  done
  rmdir /var/log/containers 2>/dev/null || true
}

cmd_node_up() {
  forget_container_log_links
  local d
  for d in $(node_cgroup_dirs); do mkdir -p "$d"; done
  containerd_config
  start containerd nsenter "--net=/run/netns/$NETNS" containerd --config "$STATE/containerd/config.toml"
  wait_for containerd 60 ctr_node version
  import_images "$(pause_archive)"
  coredns_config
  start coredns nsenter "--net=/run/netns/$NETNS" "$BIN/coredns" -conf "$STATE/Corefile" -dns.port 53
  kubelet_config
  start kubelet nsenter "--net=/run/netns/$NETNS" "$BIN/kubelet" --config "$STATE/kubelet.yaml" --kubeconfig "$STATE/kubeconfig" \
    --root-dir "$STATE/kubelet" --cert-dir "$STATE/kubelet-pki" --hostname-override "$NODE_NAME" --node-ip "$NODE_IP"
  kube_proxy_config
  start kube-proxy nsenter "--net=/run/netns/$NETNS" "$BIN/kube-proxy" --config "$STATE/kube-proxy.yaml"
  wait_for kubelet 120 node_ready
  wait_for coredns 30 in_node curl -sf http://127.0.0.1:8181/ready
  wait_for kube-proxy 60 in_node curl -sf http://127.0.0.1:10256/healthz
  network_policies_up
  log "node $NODE_NAME Ready"
}

# SIG Network's NetworkPolicy controller, kube-network-policies (the one kindnet runs), beside the CNI bridge, which
# ignores policies: an nftables table `kube-network-policies` sends the first packet of each connection to or from a
# Pod that a policy selects to an nfqueue, where the controller accepts or drops it. It reads the API only as a Pod
# does (client-go's in-cluster config: the service-account files at their fixed path), so it runs in a mount
# namespace of its own with a tmpfs over /run holding them (the admin token; nothing of it reaches the host's
# mounts). Without the kernel's nft `queue` expression (CONFIG_NFT_QUEUE, absent from this machine's kernel) its
# table cannot be loaded: kube-router's firewall runs instead (`kube_router_up`). Where neither enforces policies
# `up` says so, and NETWORK_POLICIES_UNENFORCED in the state dir holds why. (kube-network-policies v0.8.0 ignores
# its --disable-nri: it logs that it found no NRI socket.)
network_policies_up() {
  local sa=/run/secrets/kubernetes.io/serviceaccount why
  rm -f "$STATE/NETWORK_POLICIES_UNENFORCED"
  if why=$(nft_queue_missing); then
    kube_router_up "$why"
    return 0
  fi
  start network-policies nsenter "--net=/run/netns/$NETNS" unshare --mount --propagation private \
    env KUBERNETES_SERVICE_HOST=127.0.0.1 KUBERNETES_SERVICE_PORT="$PORT" sh -c \
    'mount -t tmpfs tmpfs /run && mkdir -p "$0" && cp "$1" "$0/token" && cp "$2" "$0/ca.crt" && shift 2 && exec "$@"' \
    "$sa" "$STATE/pki/admin.token" "$STATE/pki/ca.crt" \
    "$BIN/kube-network-policies" --hostname-override "$NODE_NAME" --disable-nri \
    --metrics-bind-address 127.0.0.1:9080 --v=2
  local np_log=$STATE/logs/network-policies.log
  if wait_for network-policies 60 network_policies_synced && network_policies_table; then
    log "NetworkPolicy enforced (kube-network-policies)"
  else
    { grep -m1 -A1 "$NP_SYNC_ERROR" "$np_log" || tail -n 3 "$np_log"; } | tr -s ' \t\n' ' ' \
      > "$STATE/NETWORK_POLICIES_UNENFORCED"
    log "NetworkPolicy NOT enforced: kube-network-policies could not load its nftables table:" \
        "$(cat "$STATE/NETWORK_POLICIES_UNENFORCED")"
  fi
}

# kube-router (cloudnativelabs) as the NetworkPolicy controller only: its firewall, with its routing (the CNI bridge
# routes), service proxy (kube-proxy's) and CNI off. Its rules are iptables chains (KUBE-ROUTER-FORWARD, -INPUT,
# -OUTPUT, per-pod and per-policy chains) matching ipsets of the selected Pods' addresses; the bridge's netfilter
# hook (bridge-nf-call-iptables, on in the node's namespace) puts traffic between Pods on cni0 through them. It reads
# the API with the admin kubeconfig, which reaches the API server inside the same namespace. `$1`: why the nft
# controller could not run.
kube_router_up() {
  if [[ ! -x $BIN/kube-router ]]; then
    echo "kube-network-policies not started ($1), and no kube-router in $BIN" > "$STATE/NETWORK_POLICIES_UNENFORCED"
    log "NetworkPolicy NOT enforced: $(cat "$STATE/NETWORK_POLICIES_UNENFORCED")"
    return 0
  fi
  start network-policies nsenter "--net=/run/netns/$NETNS" "$BIN/kube-router" --kubeconfig "$STATE/kubeconfig" \
    --hostname-override "$NODE_NAME" --run-firewall=true --run-router=false --run-service-proxy=false \
    --enable-cni=false --enable-pod-egress=false --service-cluster-ip-range "$SERVICE_CIDR" \
    --health-port "$KUBE_ROUTER_HEALTH_PORT" --metrics-port 0
  if wait_for network-policies 60 kube_router_synced; then
    log "NetworkPolicy enforced (kube-router's firewall; nft queue missing: $1)"
  else
    { echo "kube-router's firewall did not sync:"; tail -n 3 "$STATE/logs/network-policies.log"; } | tr -s ' \t\n' ' ' \
      > "$STATE/NETWORK_POLICIES_UNENFORCED"
    log "NetworkPolicy NOT enforced: $(cat "$STATE/NETWORK_POLICIES_UNENFORCED")"
  fi
}

KUBE_ROUTER_HEALTH_PORT=20244
kube_router_synced() {
  in_node curl -sf "http://127.0.0.1:$KUBE_ROUTER_HEALTH_PORT/healthz" >/dev/null &&
    in_node iptables -t filter -S KUBE-ROUTER-FORWARD >/dev/null 2>&1
}

# Prints why this kernel cannot run the controller's rules and succeeds, or fails when it can: a table with the nft
# `queue` expression loaded in a network namespace of its own (`unshare --net`: gone when nft exits).
nft_queue_missing() {
  local error
  error=$(unshare --net nft -f - 2>&1 <<'RULES'
table inet probe { chain c { type filter hook input priority 0; ct state new queue num 100 bypass; }; }
RULES
  ) && return 1
  echo "this kernel has no nft queue expression (CONFIG_NFT_QUEUE), which its rules need: $(echo "$error" | head -n1)"
}

NP_SYNC_ERROR='syncing nftables rules.*error'  # the controller's log line when its table fails to load
network_policies_table() { in_node nft list table inet kube-network-policies >/dev/null 2>&1; }
network_policies_synced() { network_policies_table || grep -q "$NP_SYNC_ERROR" "$STATE/logs/network-policies.log"; }

node_ready() {
  api -f "https://127.0.0.1:$PORT/api/v1/nodes/$NODE_NAME" |
    python3 -c 'import json,sys; s=json.load(sys.stdin)["status"]; sys.exit(not any(c["type"]=="Ready" and c["status"]=="True" for c in s.get("conditions",[])))'
}

# Every Pod deleted through the API (the kubelet stops its containers and tears its sandbox's network down), with
# the controllers that would recreate them already stopped.
drain_node() {
  local pods
  api -f "https://127.0.0.1:$PORT/readyz" >/dev/null 2>&1 || { log "no API server to drain the node through"; return 0; }
  pods=$(api -f "https://127.0.0.1:$PORT/api/v1/pods" 2>/dev/null |
    python3 -c 'import json,sys; print("\n".join(p["metadata"]["namespace"]+"/"+p["metadata"]["name"] for p in json.load(sys.stdin)["items"]))') || return 0
  local p
  for p in $pods; do
    api -o /dev/null -X DELETE -H 'Content-Type: application/json' --data '{"gracePeriodSeconds":1}' \
      "https://127.0.0.1:$PORT/api/v1/namespaces/${p%/*}/pods/${p#*/}"
  done
  for ((i = 0; i < 90; i++)); do
    [[ $(api "https://127.0.0.1:$PORT/api/v1/pods" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["items"]))') == 0 ]] && break
    sleep 1
  done
  # The kubelet removes a stopped sandbox's containers later (garbage collection): do it now.
  local ids; ids=$(ctr_node containers ls -q 2>/dev/null) || return 0
  local id
  for id in $ids; do
    ctr_node tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true
    ctr_node tasks delete -f "$id" >/dev/null 2>&1 || true
    ctr_node containers delete "$id" >/dev/null 2>&1 || true
  done
}

# What the node's daemons leave outside their processes: runc shims (reparented to init), mounts under the state
# dir (overlay root filesystems, Pod volumes, sandbox shm), Pod network namespaces, cgroups, the node's namespace.
node_cleanup() {
  local pid
  for pid in $(grep -l -s -- "$STATE/containerd/containerd.sock" /proc/[0-9]*/cmdline | cut -d/ -f3); do
    kill -9 "$pid" 2>/dev/null && log "killed a leftover containerd shim (pid $pid)"
  done
  local mnt
  while read -r mnt; do
    umount "$mnt" 2>/dev/null || umount -l "$mnt"
  done < <(awk -v s="$STATE/" 'index($2, s) == 1 {print $2}' /proc/mounts | sort -r)
  forget_container_log_links
  local d
  for d in $(node_cgroup_dirs); do
    [[ -d $d ]] && find "$d" -depth -type d -exec rmdir {} + 2>/dev/null
    [[ -d $d ]] && log "cgroup $d left (a process is still in it)"
  done
  # containerd's shims and ctr keep their sockets and fifos in /run/containerd (fixed paths): removed when empty.
  rmdir /run/containerd/s /run/containerd/fifo /run/containerd/runc/k8s.io /run/containerd/runc /run/containerd \
    2>/dev/null || true
  if [[ -e /run/netns/$NETNS ]]; then ip netns delete "$NETNS" && log "deleted network namespace $NETNS"; fi
  rmdir /run/netns 2>/dev/null || true  # `ip netns add` made it; kept while it holds another namespace
  rm -f "$STATE/netns"
}
