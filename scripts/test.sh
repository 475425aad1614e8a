#!/usr/bin/env bash
# Set up the environments, then run every test on the pinned dependency set (.venv) and the tests marked
# `image_set` again on the Ray image's library versions (.venv-image, Python 3.13). Extra arguments go to both
# pytest runs; IMAGE_SET=0 skips the second (for a quick local run; CI runs both). Prints each leg's time.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
legs=()
leg() {  # leg <name> <command...>: run and time one leg
  local name=$1 t0=$SECONDS status=0; shift
  "$@" || status=$?
  legs+=("$name: $((SECONDS - t0)) s (exit $status)")
  return $status
}
report() { printf '# leg times\n'; printf '#   %s\n' "${legs[@]}"; }
trap report EXIT

# The live control plane of tests/test_k8s_live.py is built from source (minutes of CPU when cold): build it in
# the background beside the Python setup, which mostly downloads; the test module's `up` waits for it (a lock).
# The real-pod tests (tests/test_k8s_pods.py) add the real node to that build (kubelet, kube-proxy, CoreDNS;
# containerd from Debian) and a CPU test image; they need root (network namespaces, mounts, cgroups).
# REAL_PODS: auto (default: on as root, off with a line saying so otherwise), 1 (required: fails if not root), 0 (off).
case "${REAL_PODS:=auto}" in
  auto) if [[ $EUID == 0 ]]; then REAL_PODS=1
        else REAL_PODS=0; echo "# real-pod tests off: they need root (network namespaces, mounts, cgroups)"; fi ;;
  1) [[ $EUID == 0 ]] || { echo "REAL_PODS=1: the real-pod tests need root (network namespaces, mounts, cgroups)" >&2; exit 2; } ;;
  0) echo "# real-pod tests off (REAL_PODS=0)" ;;
  *) echo "REAL_PODS must be auto, 1 or 0, got '$REAL_PODS'" >&2; exit 2 ;;
esac
build_log=${K8S_CACHE:-$HOME/.cache/ray-finetune/k8s}/build.log
mkdir -p "$(dirname "$build_log")"
real_node=()
if [[ $REAL_PODS == 1 ]]; then real_node=(--real-node); export RAY_FINETUNE_REAL_PODS=1; fi
( t0=$SECONDS status=0; bash scripts/k8s-up.sh build "${real_node[@]}" > "$build_log" 2>&1 || status=$?
  echo "# control-plane build (background, $build_log): $((SECONDS - t0)) s (exit $status)" ) &

# The real-pod tests' container image (scripts/k8s-image.sh: Debian rootfs + .venv-image, a cached OCI archive) is
# built from .venv-image once that exists, also in the background; `scripts/k8s-image.sh import <address>` from a
# test waits for this build (a lock) and then imports the archive it left.
start_test_image_build() {
  local log=${K8S_CACHE:-$HOME/.cache/ray-finetune/k8s}/image-build.log
  ( t0=$SECONDS status=0; bash scripts/k8s-image.sh > "$log" 2>&1 || status=$?
    echo "# test image build (background, $log): $((SECONDS - t0)) s (exit $status)" ) &
}

echo "# disk: $(df -h --output=avail . | tail -1 | tr -d ' ') free here; a run from nothing takes about 35 GB (two venvs" \
     "with PyPI's CUDA torch, the Go caches, the test image packed and unpacked)"
leg "setup (.venv, helm)" bash scripts/setup.sh --dev
# A passing test's tmp_path is deleted when it ends: the checkpoints of the pretrained and resume tests add up to
# GBs, and pytest keeps three sessions' (CI's disk is shared and ran out once). A failing test's is kept to look at.
pytest_args=(-q -o tmp_path_retention_policy=failed "$@")
# The image set's environment (mostly downloads and unpacking) is made in the background beside the pinned tests;
# the real-pod tests' image is built from it, so they need it even without the image-set tests.
if [[ "${IMAGE_SET:-1}" != 0 || $REAL_PODS == 1 ]]; then
  image_log=$(mktemp "${TMPDIR:-/tmp}/setup-image.XXXXXX.log")
  ( t0=$SECONDS status=0; bash scripts/setup.sh --image > "$image_log" 2>&1 || status=$?
    echo "# setup (.venv-image, background): $((SECONDS - t0)) s (exit $status)"
    echo "$status" > "$image_log.status"
    [[ $status == 0 && $REAL_PODS == 1 ]] && start_test_image_build
    exit $status ) &
  image_setup=$!
fi
# The real-pod tests run beside the pinned tests, once .venv-image exists (their fixture waits for the node's build
# and the test image, each under its lock): a third of their time the machine is idle, waiting on the kubelet,
# KubeRay and the TTLs, which the pinned tests fill (docs/chart.md "Real pods": the legs).
pinned_args=()
if [[ $REAL_PODS == 1 ]]; then
  pods_log=$(mktemp "${TMPDIR:-/tmp}/real-pods.XXXXXX.log")
  ( until [[ -f $image_log.status ]]; do sleep 2; done
    [[ $(cat "$image_log.status") == 0 ]] || { echo "# real-pod tests not run: .venv-image was not made"; exit 1; }
    t0=$SECONDS status=0
    .venv/bin/python -m pytest --durations=15 "${pytest_args[@]}" tests/test_k8s_pods.py > "$pods_log" 2>&1 || status=$?
    echo "# real-pod tests (background, beside the pinned tests, $pods_log): $((SECONDS - t0)) s (exit $status)"
    [[ $status == 5 ]] && status=0  # extra arguments that select none of them
    exit $status ) &
  real_pods=$!
  pinned_args=(--ignore=tests/test_k8s_pods.py)
  # A run that ends early stops them too: pytest's teardown on SIGINT takes the node down.
  trap 'report; pkill -INT -P "$real_pods" || true' EXIT
fi
status=0
leg "pinned tests" .venv/bin/python -m pytest --durations=25 "${pytest_args[@]}" "${pinned_args[@]}" tests || status=1
image_setup_done() { wait "$image_setup" || { cat "$image_log"; return 1; }; }
image_set_tests() {
  echo "# the image's library versions: $(.venv-image/bin/python -c 'import platform, ray, torch, transformers
print(f"Python {platform.python_version()}, Ray {ray.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")')"
  local s=0
  .venv-image/bin/python -m pytest -m image_set "${pytest_args[@]}" tests || s=$?
  # Extra arguments may select no image_set test (pytest exit 5): that is not a failure of this set.
  [[ $s == 5 ]] && s=0
  return $s
}
# The image set runs beside the real-pod tests' end, where they outlast the pinned tests.
if [[ "${IMAGE_SET:-1}" != 0 ]]; then
  { leg "setup (.venv-image): waiting for it" image_setup_done && leg "image-set tests" image_set_tests; } || status=1
fi
if [[ $REAL_PODS == 1 ]]; then
  real_pods_done() { local s=0; wait "$real_pods" || s=$?; cat "$pods_log"; return $s; }
  leg "real-pod tests: waiting for them" real_pods_done || status=1
fi
exit $status
