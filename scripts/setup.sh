#!/usr/bin/env bash
# Create the virtual environments on a fresh machine; idempotent.
#   scripts/setup.sh          .venv: runtime only, pinned (CPU torch; enough to run the job locally)
#   scripts/setup.sh --dev    .venv plus test tooling, and a pinned helm binary in .tools/bin
#   scripts/setup.sh --image  .venv-image: the Ray image's library versions (requirements-image.txt) on Python
#                             3.13, as in the image ($PYTHON_IMAGE picks the interpreter)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
install() {  # venv-dir python requirements-file
  [[ -x "$1/bin/python" ]] || "$2" -m venv "$1"
  "$1/bin/python" -m pip install --quiet --disable-pip-version-check -r "$3"
}
case "${1:-}" in
  --image)
    python=${PYTHON_IMAGE:-$(command -v python3.13 || echo /root/.pyenv/versions/3.13.0/bin/python)}
    [[ -x "$python" ]] || { echo "setup: no Python 3.13 at $python (set PYTHON_IMAGE)" >&2; exit 1; }
    install .venv-image "$python" requirements-image.txt ;;
  --dev)
    install .venv "${PYTHON:-python3}" requirements-dev.txt
    PYTHON=.venv/bin/python bash scripts/install-helm.sh ;;
  "") install .venv "${PYTHON:-python3}" requirements.txt ;;
  *) echo "usage: scripts/setup.sh [--dev|--image]" >&2; exit 2 ;;
esac
