#!/usr/bin/env bash
# Create .venv with the pinned dependencies (CPU torch) on a fresh machine; idempotent.
#   scripts/setup.sh          runtime only (enough to run the job locally)
#   scripts/setup.sh --dev    plus test tooling and a pinned helm binary in .tools/bin
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$python" -m venv .venv
requirements=requirements.txt
[[ "${1:-}" == "--dev" ]] && requirements=requirements-dev.txt
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r "$requirements"
if [[ "${1:-}" == "--dev" ]]; then
  PYTHON=.venv/bin/python bash scripts/install-helm.sh
fi
