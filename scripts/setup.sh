#!/usr/bin/env bash
# Create the virtual environments on a fresh machine; idempotent.
#   scripts/setup.sh          .venv: runtime only, pinned (PyPI torch: the CUDA build, run on CPU; enough to run
#                             the job locally)
#   scripts/setup.sh --dev    .venv plus test tooling, a pinned helm binary in .tools/bin, and .venv-mlflow: the
#                             MLflow tracking server the tests start (apart: it needs older packages than .venv)
#   scripts/setup.sh --image  .venv-image: the Ray image's library versions (requirements-image.txt) on Python
#                             3.13, as in the image ($PYTHON_IMAGE picks the interpreter)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
install() {  # venv-dir python requirements-file
  [[ -x "$1/bin/python" ]] || "$2" -m venv "$1"
  # Quiet pip, so one line says what the wait is for (a fresh .venv: ~2 minutes, mostly torch).
  echo "setup: pip install -r $3 into $1 ..." >&2
  local t0=$SECONDS
  "$1/bin/python" -m pip install --quiet --disable-pip-version-check -r "$3"
  echo "setup: $1 ready ($((SECONDS - t0)) s, $(du -sh "$1/" | cut -f1))" >&2
}
case "${1:-}" in
  --image)
    # The first Python 3.13 that runs: on PATH, else pyenv's (a pyenv shim for a version that is not selected exists
    # on PATH but fails to run, so each candidate is tried, not just looked up).
    python=${PYTHON_IMAGE:-}
    if [[ -z "$python" ]]; then
      for candidate in python3.13 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.13*/bin/python3.13; do
        if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 13)' 2>/dev/null; then
          python=$candidate; break
        fi
      done
    fi
    [[ -n "$python" ]] || { echo "setup: no Python 3.13 found (set PYTHON_IMAGE to one)" >&2; exit 1; }
    install .venv-image "$python" requirements-image.txt ;;
  --dev)
    install .venv "${PYTHON:-python3}" requirements-dev.txt
    install .venv-mlflow "${PYTHON:-python3}" requirements-mlflow.txt
    PYTHON=.venv/bin/python bash scripts/install-helm.sh ;;
  "") install .venv "${PYTHON:-python3}" requirements.txt ;;
  *) echo "usage: scripts/setup.sh [--dev|--image]" >&2; exit 2 ;;
esac
