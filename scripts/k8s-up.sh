#!/usr/bin/env bash
# A live control plane on loopback for the chart: etcd, kube-apiserver, kube-controller-manager (garbage
# collector), kube-scheduler, kwok (simulated nodes and Pod status) and the KubeRay operator out of cluster.
# Every binary is built from upstream source by module version, through the wrapper modules under
# k8s/tools/<component>/ (their go.mod/go.sum pin the upstream versions; sources from the Go module proxy),
# into a cache outside the repo.
#
# Usage: scripts/k8s-up.sh build [--real-node]   build every missing binary into $K8S_CACHE/bin (a missing one is
#                                                built, never skipped); --real-node: the node's binaries too
#        scripts/k8s-up.sh up [--real-node]      build, then start everything; prints the state dir and the kubeconfig
#        scripts/k8s-up.sh down [--real-node]    stop what `up` started (pid files in the state dir) and clean up
#        scripts/k8s-up.sh import <archive>...   load OCI image archives into the real node's containerd
#        scripts/k8s-up.sh env [--real-node]     print `export KUBECONFIG=...`
#        scripts/k8s-up.sh monitoring-crds       fetch the PodMonitor CRD (prometheus-operator) into the cache; prints its dir
#
# --real-node: instead of kwok's simulated nodes, one real node (containerd, runc, the CNI bridge, kubelet,
# kube-proxy, CoreDNS, the NetworkPolicy controller: kube-network-policies, or kube-router's firewall where the
# kernel lacks nft's `queue`) in a network namespace of its own, with the control plane
# inside it; only a relay of the API server's port reaches the host's loopback. scripts/k8s-node.sh says how and why.
#
# K8S_CACHE   (default ~/.cache/ray-finetune/k8s): bin/ holds the binaries, images/ the pause image
# K8S_STATE   (default $K8S_CACHE/state, with --real-node $K8S_CACHE/state-node): certs, keys, token, kubeconfig,
#             etcd data, logs, pid files (and the real node's containerd, kubelet and CNI state)
# K8S_PORT    (default 26443, with --real-node 27443): kube-apiserver's secure port; the other components take fixed
#             ports near it
# K8S_CRDS    (default ../shared/kuberay-crds, the chart's v1.7.0 CRDs; required when that is absent)
#
# The KubeRay operator is v1.7.0, the version the chart targets: the proxy refuses its zip (403), so its source is
# vendored unchanged in k8s/third_party/kuberay-ray-operator (checked against its SHA256SUMS before each build).
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tools="$repo_root/k8s/tools"
REAL_NODE=0
[[ ${2:-} == --real-node || ${1:-} == import ]] && REAL_NODE=1
CACHE=${K8S_CACHE:-$HOME/.cache/ray-finetune/k8s}
if ((REAL_NODE)); then STATE=${K8S_STATE:-$CACHE/state-node}; PORT=${K8S_PORT:-27443}
else STATE=${K8S_STATE:-$CACHE/state}; PORT=${K8S_PORT:-26443}; fi
BIN="$CACHE/bin"
ETCD_PORT=$((PORT - 2600))      # 23843 client
ETCD_PEER=$((PORT - 2599))      # 23844 peer
KCM_PORT=$((PORT - 6186))       # 20257
SCHED_PORT=$((PORT - 6184))     # 20259
KWOK_PORT=$((PORT - 6196))      # 20247
OP_METRICS=$((PORT - 6363))     # 20080
OP_PROBE=$((PORT - 6362))       # 20081
NICE=(nice -n "${K8S_NICE:-19}")

log() { echo "k8s-up: $*" >&2; }

# build_one <tool dir> <output> <go build flags and packages>...: go build in the wrapper module, timed, into $BIN; skipped when the
# binaries were built from the same go.mod/go.sum and flags (a stamp per wrapper and first binary), so a version bump rebuilds, and
# every output is there (a deleted binary is rebuilt). An output ending in / is a directory: `go build -o dir/`
# writes one binary per package argument (those not starting with - and without spaces), named after its last element.
# A wrapper whose go.mod replaces a module with vendored source (k8s/third_party/*) has that source checked
# against its SHA256SUMS first, and the list is part of the stamp.
build_one() {
  local dir=$1 out=$2; shift 2
  local stamp sum vendored
  vendored=$(sed -n 's|^replace .* => \(\.\./.*\)$|\1|p' "$tools/$dir/go.mod")
  if [[ -n $vendored ]]; then
    (cd "$tools/$dir/$vendored" && sha256sum --check --quiet SHA256SUMS) ||
      { log "k8s/tools/$dir/$vendored differs from its SHA256SUMS: vendored source is kept unchanged"; exit 1; }
  fi
  sum=$({ cat "$tools/$dir/go.mod" "$tools/$dir/go.sum" ${vendored:+"$tools/$dir/$vendored/SHA256SUMS"}; echo "$*"; } |
        sha256sum | cut -d' ' -f1)
  local outputs=() arg
  if [[ $out == */ ]]; then
    for arg in "$@"; do [[ $arg == -* || $arg == *' '* ]] || outputs+=("$out${arg##*/}"); done
    ((${#outputs[@]})) || { log "build_one $dir: no package arguments to name the binaries in $out"; exit 1; }
  else
    outputs=("$out")
  fi
  stamp=$BIN/.$dir-${outputs[0]##*/}.stamp  # per wrapper and binaries: the node's build is apart from the control plane's
  if [[ -f $stamp && $(cat "$stamp") == "$sum" ]]; then
    local missing=()
    for arg in "${outputs[@]}"; do [[ -x $arg ]] || missing+=("${arg##*/}"); done
    ((${#missing[@]})) || return 0
    log "${missing[*]} missing from $BIN although its stamp is current: rebuilding"
  fi
  mkdir -p "$BIN"
  log "building $out from k8s/tools/$dir ($*)"
  local t0=$SECONDS cpu0 cpu1
  cpu0=$(children_cpu_s)
  (cd "$tools/$dir" && GOFLAGS=-mod=readonly "${NICE[@]}" go build -trimpath -o "$out" "$@")
  cpu1=$(children_cpu_s)
  echo "$sum" > "$stamp"
  log "built $out in $((SECONDS - t0))s ($((cpu1 - cpu0))s of CPU)"
}

# CPU seconds (user + system) of this script's finished children (cutime + cstime of /proc/$$/stat, in clock
# ticks): what a build cost in CPU, which on a busy 2-core machine says more than its wall time.
children_cpu_s() {
  local stat; stat=$(< "/proc/$$/stat")
  echo "${stat##*) }" | awk -v hz="$(getconf CLK_TCK)" '{ print int(($14 + $15) / hz) }'
}

cmd_build() {
  command -v go >/dev/null || { log "go is required (Go 1.26) to build the control plane"; exit 1; }
  # One build at a time per cache and part: a second `build` or `up` (scripts/test.sh builds in the background
  # while the tests start) waits here, then finds every stamp current. The real node's binaries have a lock of their
  # own, so that the kwok tests start once the control plane is built, while the node's build goes on.
  mkdir -p "$BIN"
  exec {lock}> "$BIN/.build.lock"
  flock "$lock"
  # The version the server reports (helm checks a chart's kubeVersion against it) is stamped at link time,
  # as Kubernetes' own release build does; a plain go build reports v0.0.0-master.
  local k8s; k8s=$(cd "$tools/kubernetes" && go list -m -f '{{.Version}}' k8s.io/kubernetes)
  # -s -w: no symbol table or DWARF, as Kubernetes' release build links: a shorter link and a smaller cache.
  local v=k8s.io/component-base/version minor=${k8s#v1.} strip="-s -w"; minor=${minor%%.*}
  build_one kubernetes "$BIN/" \
    -ldflags "$strip -X $v.gitVersion=$k8s -X $v.gitMajor=1 -X $v.gitMinor=$minor -X $v.gitTreeState=clean" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler
  build_one etcd "$BIN/etcd" -ldflags "$strip" go.etcd.io/etcd/server/v3
  # `up --real-node` starts no kwok; `build --real-node` (CI's background build) builds it for the kwok tests too.
  [[ ${1:-} == --no-kwok ]] || build_one kwok "$BIN/kwok" -ldflags "$strip" sigs.k8s.io/kwok/cmd/kwok
  build_one ray-operator "$BIN/ray-operator" -ldflags "$strip" github.com/ray-project/kuberay/ray-operator
  exec {lock}>&-  # the components `up` starts next must not inherit (and hold) a lock
  if ((REAL_NODE)); then
    exec {lock}> "$BIN/.build-node.lock"
    flock "$lock"
    node_packages
    build_one kubernetes "$BIN/" \
      -ldflags "$strip -X $v.gitVersion=$k8s -X $v.gitMajor=1 -X $v.gitMinor=$minor -X $v.gitTreeState=clean" \
      k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy
    build_one coredns "$BIN/coredns" -ldflags "$strip" .
    local why
    if why=$(nft_queue_missing); then
      log "kube-network-policies not built: $why; kube-router's firewall enforces NetworkPolicy instead"
      build_one kube-router "$BIN/kube-router" -ldflags "$strip" github.com/cloudnativelabs/kube-router/v2/cmd/kube-router
    else build_one kube-network-policies "$BIN/kube-network-policies" -ldflags "$strip" sigs.k8s.io/kube-network-policies/cmd; fi
    exec {lock}>&-
  fi
  du -sh "$BIN" >&2
}

# The prometheus-operator CRD of the PodMonitor that `monitoring.podMonitor` renders: from the operator's module on
# the Go module proxy (example/prometheus-operator-crd/ in it), pinned by version and module hash, into the cache.
PROMETHEUS_OPERATOR=v0.85.0
PROMETHEUS_OPERATOR_SUM=h1:M5xLCLEoaW2IJfnuCwFzzpL+jSVQu3KGT84Pye+fW8s=
cmd_monitoring_crds() {  # prints the directory holding monitoring.coreos.com_podmonitors.yaml
  local dir=$CACHE/crds/prometheus-operator-$PROMETHEUS_OPERATOR file=monitoring.coreos.com_podmonitors.yaml
  if [[ ! -f $dir/$file ]]; then
    command -v go >/dev/null || { log "go is required to fetch the prometheus-operator CRDs"; exit 1; }
    local info module sum scratch
    scratch=$(mktemp -d)  # outside any module: the version and hash are the pins
    info=$(cd "$scratch" && go mod download -json "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR")
    rmdir "$scratch"
    module=$(sed -n 's/^\t"Dir": "\(.*\)",$/\1/p' <<< "$info")
    sum=$(sed -n 's/^\t"Sum": "\(.*\)",$/\1/p' <<< "$info")
    [[ $sum == "$PROMETHEUS_OPERATOR_SUM" ]] ||
      { log "prometheus-operator $PROMETHEUS_OPERATOR: module hash '$sum', expected $PROMETHEUS_OPERATOR_SUM"; exit 1; }
    mkdir -p "$dir"
    cp "$module/example/prometheus-operator-crd/$file" "$dir/$file.tmp" && mv "$dir/$file.tmp" "$dir/$file"
  fi
  echo "$dir"
}

crd_dir() {
  if [[ -n ${K8S_CRDS:-} ]]; then echo "$K8S_CRDS"
  elif [[ -d $repo_root/../shared/kuberay-crds ]]; then (cd "$repo_root/../shared/kuberay-crds" && pwd)
  else log "no KubeRay CRDs: set K8S_CRDS to a directory of them (the vendored operator carries none)"; exit 1; fi
}

gen_certs() {
  local d=$STATE/pki
  [[ -f $d/apiserver.crt ]] && return
  mkdir -p "$d"
  log "generating CA, serving cert, service-account keys and admin token in $d"
  # The key usages and key identifiers a strict verifier requires (Python 3.13's ssl default, in the real node's
  # Pods: without them the job could not read its own Pod and the helm test Pod not its RayJob).
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj /CN=k8s-up-ca \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
    -keyout "$d/ca.key" -out "$d/ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj /CN=kube-apiserver -keyout "$d/apiserver.key" -out "$d/apiserver.csr" 2>/dev/null
  { printf 'subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc\n'
    printf 'keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n'
    printf 'subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n'; } > "$d/san.ext"
  openssl x509 -req -in "$d/apiserver.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial -days 3650 \
    -extfile "$d/san.ext" -out "$d/apiserver.crt" 2>/dev/null
  openssl genrsa -out "$d/sa.key" 2048 2>/dev/null
  openssl rsa -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
  openssl rand -hex 24 > "$d/admin.token"
  # token,user,uid,"groups": the admin is in system:masters (all of RBAC).
  printf '%s,admin,admin,"system:masters"\n' "$(cat "$d/admin.token")" > "$d/tokens.csv"
}

write_kubeconfig() {
  cat > "$STATE/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: k8s-up
  cluster:
    server: https://127.0.0.1:$PORT
    certificate-authority: $STATE/pki/ca.crt
users:
- name: admin
  user:
    token: $(cat "$STATE/pki/admin.token")
contexts:
- name: k8s-up
  context: {cluster: k8s-up, user: admin, namespace: default}
current-context: k8s-up
EOF
}

# start <name> <cmd>...: run in the background, log to $STATE/logs/<name>.log, pid in $STATE/pids/<name>.pid
start() {
  local name=$1; shift
  mkdir -p "$STATE/logs" "$STATE/pids"
  if [[ -f $STATE/pids/$name.pid ]] && kill -0 "$(cat "$STATE/pids/$name.pid")" 2>/dev/null; then
    log "$name already running (pid $(cat "$STATE/pids/$name.pid"))"; return
  fi
  "$@" > "$STATE/logs/$name.log" 2>&1 &
  echo $! > "$STATE/pids/$name.pid"
  log "started $name (pid $!)"
}

api() {  # api <curl args...>: an authenticated request to the API server
  curl -sS --cacert "$STATE/pki/ca.crt" -H "Authorization: Bearer $(cat "$STATE/pki/admin.token")" "$@"
}

wait_for() {  # wait_for <component> <seconds> <command...>: until the command succeeds; fails early if it exits
  local name=$1 secs=$2; shift 2
  for ((i = 0; i < secs; i++)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    if [[ -f $STATE/pids/$name.pid ]] && ! kill -0 "$(cat "$STATE/pids/$name.pid")" 2>/dev/null; then
      log "$name exited; the end of $STATE/logs/$name.log:"; tail -n 20 "$STATE/logs/$name.log" >&2; return 1
    fi
    sleep 1
  done
  log "timed out after ${secs}s waiting for $name; the end of its log:"; tail -n 20 "$STATE/logs/$name.log" >&2
  return 1
}

cmd_up() {
  if ((REAL_NODE)); then cmd_build --no-kwok; else cmd_build; fi
  command -v openssl >/dev/null || { log "openssl is required"; exit 1; }
  mkdir -p "$STATE"
  gen_certs
  write_kubeconfig
  local pki=$STATE/pki
  # With a real node the control plane runs inside the node's network namespace (scripts/k8s-node.sh).
  local ns=() apiserver_net=(--bind-address 127.0.0.1 --advertise-address 127.0.0.1 --endpoint-reconciler-type none)
  if ((REAL_NODE)); then
    NETNS=$(netns_of_state)
    node_netns_up
    api_relay_up
    ns=(nsenter "--net=/run/netns/$NETNS")
    # Pods reach it through the `kubernetes` Service (the helm test Pod reads the RayJob); logs and exec go
    # to the kubelet's InternalIP.
    apiserver_net=(--bind-address 0.0.0.0 --advertise-address "$NODE_IP" --kubelet-preferred-address-types InternalIP)
  fi
  start etcd "${ns[@]}" "$BIN/etcd" --name k8s-up --data-dir "$STATE/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER" \
    --initial-cluster "k8s-up=http://127.0.0.1:$ETCD_PEER" --listen-metrics-urls "" --log-level warn
  wait_for etcd 60 "${ns[@]}" curl -sf "http://127.0.0.1:$ETCD_PORT/health"
  start kube-apiserver "${ns[@]}" "$BIN/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$ETCD_PORT" "${apiserver_net[@]}" \
    --secure-port "$PORT" --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
    --client-ca-file "$pki/ca.crt" --token-auth-file "$pki/tokens.csv" \
    --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
    --service-account-issuer https://kubernetes.default.svc --service-cluster-ip-range 10.96.0.0/16 \
    --authorization-mode Node,RBAC --allow-privileged=true
  wait_for kube-apiserver 120 api -f "https://127.0.0.1:$PORT/readyz"
  start kube-controller-manager "${ns[@]}" "$BIN/kube-controller-manager" --kubeconfig "$STATE/kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$KCM_PORT" --leader-elect=false \
    --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
    --cluster-signing-cert-file "$pki/ca.crt" --cluster-signing-key-file "$pki/ca.key" \
    --use-service-account-credentials=false --controllers '*'
  start kube-scheduler "${ns[@]}" "$BIN/kube-scheduler" --kubeconfig "$STATE/kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$SCHED_PORT" --leader-elect=false
  ((REAL_NODE)) || start_kwok
  install_crds
  local operator_net=()
  # Out of cluster, the operator reaches the Ray dashboard of a real head through the API server's proxy.
  ((REAL_NODE)) && operator_net=(--use-kubernetes-proxy)
  KUBECONFIG=$STATE/kubeconfig start ray-operator "$BIN/ray-operator" \
    --metrics-addr "127.0.0.1:$OP_METRICS" --health-probe-bind-address "127.0.0.1:$OP_PROBE" \
    --enable-leader-election=false "${operator_net[@]}"
  wait_for ray-operator 60 curl -sf "http://127.0.0.1:$OP_PROBE/readyz"
  ((REAL_NODE)) && cmd_node_up
  echo "state: $STATE"
  echo "export KUBECONFIG=$STATE/kubeconfig"
}

start_kwok() {
  # kwok's binary has no built-in stages: take kwok's own "fast" node/pod stages (and node heartbeat) from
  # its module (kustomize/stage/): nodes turn Ready, Pods Running+Ready, Job Pods Succeeded.
  local kwokdir; kwokdir=$(cd "$tools/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
  local stages=$STATE/kwok-stages.yaml f
  : > "$stages"
  for f in "$kwokdir"/kustomize/stage/node/fast/node-initialize.yaml "$kwokdir"/kustomize/stage/node/heartbeat/node-heartbeat.yaml \
    "$kwokdir"/kustomize/stage/pod/fast/pod-{ready,complete,delete}.yaml; do
    { echo ---; cat "$f"; } >> "$stages"
  done
  start kwok "$BIN/kwok" --config "$stages" --kubeconfig "$STATE/kubeconfig" --server-address "127.0.0.1:$KWOK_PORT" \
    --manage-all-nodes=false --manage-nodes-with-annotation-selector kwok.x-k8s.io/node=fake \
    --cidr 10.244.0.1/16 --node-ip 127.0.0.1
}

install_crds() {
  local crds; crds=$(crd_dir)
  log "installing KubeRay CRDs from $crds"
  local monitoring; monitoring=$(cmd_monitoring_crds)
  for f in "$crds"/ray.io_*.yaml "$monitoring"/*.yaml; do
    local code
    code=$(api -o /dev/null -w '%{http_code}' -X POST -H 'Content-Type: application/yaml' --data-binary "@$f" \
      "https://127.0.0.1:$PORT/apis/apiextensions.k8s.io/v1/customresourcedefinitions")
    case $code in 201|409) ;; *) log "CRD $f: HTTP $code"; exit 1;; esac
  done
  wait_for kube-apiserver 60 api -f "https://127.0.0.1:$PORT/apis/ray.io/v1/rayjobs"
  wait_for kube-apiserver 60 api -f "https://127.0.0.1:$PORT/apis/monitoring.coreos.com/v1/podmonitors"
}

stop() {  # stop <name>...: what `start` started, in that order
  local name
  for name in "$@"; do
    local pf=$STATE/pids/$name.pid
    [[ -f $pf ]] || continue
    local pid; pid=$(cat "$pf")
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid"
      for ((i = 0; i < 20; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
      log "stopped $name (pid $pid)"
    fi
    rm -f "$pf"
  done
}

cmd_down() {
  # The port `up` served on (the API server is drained through it), whatever this call's flags default to.
  [[ -f $STATE/kubeconfig ]] && PORT=$(sed -n 's|^ *server: https://127.0.0.1:\([0-9]*\)$|\1|p' "$STATE/kubeconfig")
  # The controllers that would recreate Pods go first; a real node is drained while the API server still runs.
  stop ray-operator kwok kube-scheduler kube-controller-manager
  if [[ -f $STATE/netns ]]; then
    NETNS=$(cat "$STATE/netns")
    drain_node
    stop network-policies kube-proxy kubelet coredns containerd
  fi
  stop kube-apiserver etcd api-relay-host api-relay-node
  [[ -n ${NETNS:-} ]] && node_cleanup
  return 0
}

source "$repo_root/scripts/k8s-node.sh"

case ${1:-} in
  build) cmd_build ;;
  up) cmd_up ;;
  down) cmd_down ;;
  import) shift; import_images "$@" ;;
  env) echo "export KUBECONFIG=$STATE/kubeconfig" ;;
  monitoring-crds) cmd_monitoring_crds ;;
  *) echo "usage: $0 build|up|down|import|env|monitoring-crds [--real-node]" >&2; exit 2 ;;
esac
