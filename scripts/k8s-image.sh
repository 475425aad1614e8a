#!/usr/bin/env bash
# The CPU test image of the real-pod tests (docs/chart.md "Test image"): the image set's versions
# (requirements-image.txt) in the layout of the chart's default image, the AWS Ray Train DLC
# (docker/ray-train/Dockerfile.cuda of aws/deep-learning-containers): a venv in /opt/venv first on PATH, Python 3.13
# in /usr/local, WORKDIR /workspace, no USER (root) and no account for uid 1000 (the chart's pods run as 1000 with
# HOME=/tmp), its ENV minus the CUDA paths. Made without a registry of images:
#   layer 1: a Debian bookworm rootfs (mmdebstrap, minbase plus bash tools, wget/curl as in the DLC) with the
#            interpreter of .venv-image (pyenv's build for this Debian) copied into /usr/local and an empty
#            /opt/venv holding .venv-image's console scripts
#   layer 2: .venv-image's site-packages as they are (no second download or install of the ~5 GB), without the
#            NVIDIA libraries that no library loads at import (only dlopen()ed for GPU work: cuDNN's engines,
#            cusolverMg, nvrtc's builtins, CUPTI, ...); the ones libtorch_cuda.so links (cuBLAS, cuSPARSE, NCCL,
#            ...) stay, as `import torch` of PyPI's CUDA build needs them even on CPU
# packed as an OCI image archive (zstd layers) that `ctr images import` takes.
#
# Usage: scripts/k8s-image.sh [build]        build unless cached; prints the image reference as the last line
#        scripts/k8s-image.sh import ADDRESS build unless cached, then import into the containerd listening on
#                                            ADDRESS (namespace k8s.io, as the kubelet's CRI reads it)
#        scripts/k8s-image.sh ref            print the reference without building
#
# The reference is localhost/ray-finetune-test:<first 12 hex of the sha256 of requirements-image.txt and this
# script and its helper>, and the archive $K8S_CACHE/images/ray-finetune-test-<that>.oci.tar is the cache: a build
# with the same inputs prints the reference and does nothing else. The archive also names the image
# localhost/ray-finetune-test:image-set, the tag ci/real-pods-image.yaml points at.
#
# Needs: root (mmdebstrap's root mode), .venv-image made (scripts/setup.sh --image; its pins are checked),
# mmdebstrap, zstd, readelf (apt-get install -y mmdebstrap zstd binutils), Debian's mirror.
# K8S_CACHE (default ~/.cache/ray-finetune/k8s), VENV_IMAGE (default .venv-image), K8S_NICE (default 19).
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${K8S_CACHE:-$HOME/.cache/ray-finetune/k8s}
IMAGES=$CACHE/images
VENV=${VENV_IMAGE:-$repo_root/.venv-image}
NICE=(nice -n "${K8S_NICE:-19}")
NAME=localhost/ray-finetune-test
SUITE=bookworm  # the Debian release pyenv built the interpreter on (its libssl3, libffi8, ... are this release's)
helper=$repo_root/scripts/oci-image.py
tag=$(cat "$repo_root/requirements-image.txt" "$repo_root/scripts/k8s-image.sh" "$helper" | sha256sum | cut -c1-12)
ref=$NAME:$tag
archive=$IMAGES/ray-finetune-test-$tag.oci.tar

log() { echo "k8s-image: $*" >&2; }

build() {
  mkdir -p "$IMAGES"
  # One build at a time: a second caller (a test beside scripts/test.sh's background build) waits, then finds it.
  exec 9> "$IMAGES/.build.lock"
  flock 9
  if [[ -f $archive ]]; then log "cached: $archive"; return; fi
  local t0=$SECONDS
  [[ $EUID == 0 ]] || { log "needs root (mmdebstrap's root mode, chroot)"; exit 1; }
  local tool
  for tool in mmdebstrap zstd readelf; do
    command -v "$tool" > /dev/null || { log "no $tool: apt-get install -y mmdebstrap zstd binutils"; exit 1; }
  done
  [[ -x $VENV/bin/python ]] || { log "no $VENV: run scripts/setup.sh --image first"; exit 1; }
  python3 "$helper" pins "$VENV/bin/python" "$repo_root/requirements-image.txt"
  # The venv's own paths as pip wrote them into its scripts (.venv-image may be a symlink) and its interpreter.
  local venv_prefix py_prefix site
  venv_prefix=$("$VENV/bin/python" -c 'import sys; print(sys.prefix)')
  py_prefix=$("$VENV/bin/python" -c 'import sys; print(sys.base_prefix)')
  site=$venv_prefix/lib/python3.13/site-packages
  [[ -f $py_prefix/lib/libpython3.13.so.1.0 ]] ||
    { log "$py_prefix has no libpython3.13.so.1.0 (a shared build, as pyenv's, is what is copied)"; exit 1; }

  work=$(mktemp -d "$IMAGES/.build.XXXXXX")  # global: the EXIT trap removes it
  trap 'rm -rf "$work"' EXIT

  log "layer 1: Debian $SUITE rootfs, Python from $py_prefix, /opt/venv"
  # The hooks (this script's `rootfs-hook`) run on the host with the rootfs as their first argument.
  local hook="bash '$repo_root/scripts/k8s-image.sh' rootfs-hook \"\$1\" '$py_prefix' '$venv_prefix'"
  "${NICE[@]}" mmdebstrap --mode=root --variant=minbase --format=tar --quiet \
    --include=ca-certificates,curl,wget,procps,less,libssl3,libffi8,libsqlite3-0,libreadline8,libncursesw6,libexpat1,libbz2-1.0,liblzma5,libuuid1,zlib1g \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook="$hook" \
    "$SUITE" - "deb http://deb.debian.org/debian $SUITE main" \
    "deb http://deb.debian.org/debian $SUITE-updates main" \
    "deb http://deb.debian.org/debian-security $SUITE-security main" |
    "${NICE[@]}" python3 "$helper" layer "$work" > /dev/null

  log "layer 2: $site, less the NVIDIA libraries nothing links"
  local exclude=$work/exclude
  python3 "$helper" trim "$site" | sed 's|^|./|' > "$exclude"
  log "  leaving out $(wc -l < "$exclude") libraries, $(cd "$site" && du -ch $(sed 's|^\./||' "$exclude") | tail -n 1 | cut -f1)"
  # mtimes are kept: the .pyc files are checked against their sources' (the image sets PYTHONDONTWRITEBYTECODE).
  "${NICE[@]}" tar -C "$site" --sort=name --owner=0 --group=0 --numeric-owner --exclude-from="$exclude" \
    --transform='s|^\./*|opt/venv/lib/python3.13/site-packages/|' -cf - . |
    "${NICE[@]}" python3 "$helper" layer "$work" > /dev/null

  local ray_version config
  ray_version=$("$VENV/bin/python" -c 'import ray; print(ray.__version__)')
  config=$(python3 -c '
import json, sys
ray_version, suite, py_prefix, site = sys.argv[1:]
print(json.dumps({
    "config": {
        # The DLC ec2 stage: its ENV (less CUDA_HOME and the CUDA/EFA library paths), WORKDIR, no USER.
        "Env": [
            "PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1", "PYTHONIOENCODING=UTF-8",
            "LANG=C.UTF-8", "LC_ALL=C.UTF-8", "DLC_CONTAINER_TYPE=training",
            "FI_PROVIDER=efa", "FI_LOG_LEVEL=warn", "NCCL_DEBUG=INFO",
        ],
        "Cmd": ["bash"],
        "WorkingDir": "/workspace",
        "Labels": {"framework": "ray", "framework_version": ray_version,
                   "org.opencontainers.image.title": "ray-finetune CPU test image (the Ray Train DLC layout)"},
    },
    "history": [
        {"created_by": f"mmdebstrap {suite} minbase; Python from {py_prefix}; venv /opt/venv"},
        {"created_by": f"site-packages of {site} (requirements-image.txt)"},
    ],
}))' "$ray_version" "$SUITE" "$py_prefix" "$site")
  "${NICE[@]}" python3 "$helper" archive "$work" "$archive" "$config" --ref "$ref" --ref "$NAME:image-set"
  log "built $archive ($(du -h "$archive" | cut -f1)) in $((SECONDS - t0)) s"
}

# rootfs-hook ROOTFS PY_PREFIX VENV_PREFIX: mmdebstrap's customize hook. The interpreter is pyenv's shared build:
# its RUNPATH points into /root/.pyenv, so libpython goes to /usr/local/lib, which ldconfig finds. The venv gets
# .venv-image's console scripts (ray, ...) with their interpreter line rewritten. Debian's /etc/profile resets PATH
# in login shells (KubeRay's ENABLE_LOGIN_SHELL): a profile.d line puts the venv first again, as the DLC's PATH has
# it. Last, the job's libraries are imported in the rootfs with layer 2 bind-mounted in a private mount namespace
# (the mount ends with it), so a missing system library fails the build, not a pod.
rootfs_hook() {
  local root=$1 py_prefix=$2 venv_prefix=$3 script
  cp -a "$py_prefix/bin/python3.13" "$root/usr/local/bin/"
  cp -a "$py_prefix"/lib/libpython3.13.so* "$root/usr/local/lib/"
  tar -C "$py_prefix/lib" --exclude=python3.13/test --exclude=python3.13/idlelib --exclude=python3.13/tkinter \
    --exclude=python3.13/turtledemo --exclude='python3.13/config-3.13-*' --exclude='python3.13/site-packages/*' \
    -cf - python3.13 | tar -C "$root/usr/local/lib" -xf -
  ln -s python3.13 "$root/usr/local/bin/python3"
  ln -s python3.13 "$root/usr/local/bin/python"
  chroot "$root" ldconfig
  chroot "$root" /usr/local/bin/python3.13 -m venv --without-pip /opt/venv
  local venv_real interpreter
  venv_real=$(realpath "$venv_prefix")
  for script in "$venv_prefix"/bin/*; do
    [[ -f $script && ! -L $script ]] || continue
    interpreter=$(head -n 1 "$script")
    interpreter=${interpreter#\#!}
    # pip wrote the path the venv was made under, which a symlink (.venv-image -> /work/main's) may hide.
    [[ $interpreter == /*/bin/python* && $(realpath -m "${interpreter%/bin/python*}") == "$venv_real" ]] || continue
    sed '1s|^#!.*|#!/opt/venv/bin/python|' "$script" > "$root/opt/venv/bin/${script##*/}"
    chmod 755 "$root/opt/venv/bin/${script##*/}"
  done
  echo 'PATH=/opt/venv/bin:$PATH' > "$root/etc/profile.d/venv.sh"
  mkdir -p "$root/workspace"
  unshare --mount sh -c 'mount --bind -o ro "$1/lib/python3.13/site-packages" "$2/opt/venv/lib/python3.13/site-packages" &&
    exec chroot "$2" /usr/bin/env -i PATH=/opt/venv/bin:/usr/bin:/bin HOME=/tmp sh -c "$3"' \
    check "$venv_prefix" "$root" '
      python -c "import ssl, sqlite3, lzma, bz2, ctypes, uuid, ray, torch, transformers, datasets, yaml
print(\"k8s-image: imports ok in the rootfs: torch\", torch.__version__)" >&2 && ray --version >&2'
}

case "${1:-build}" in
  build) build ;;
  import)
    [[ $# == 2 ]] || { log "usage: scripts/k8s-image.sh import <containerd address>"; exit 2; }
    build
    log "importing into $2 (namespace k8s.io)"
    ctr --address "$2" --namespace k8s.io images import "$archive" >&2 ;;
  ref) ;;
  rootfs-hook) shift; rootfs_hook "$@"; exit ;;
  *) log "usage: scripts/k8s-image.sh [build|import <containerd address>|ref]"; exit 2 ;;
esac
echo "$ref"
