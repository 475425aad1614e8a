#!/usr/bin/env bash
# Set up .venv with test tooling and helm, then run every test. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh --dev
exec .venv/bin/python -m pytest -q "$@" tests
