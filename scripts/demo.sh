#!/usr/bin/env bash
# The main job on an embedded local Ray cluster: set up .venv, then train the tiny demo model on 2 CPU workers.
# Extra arguments are passed on, e.g. `scripts/demo.sh --set train.max_steps=40`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 RAY_TRAIN_ENABLE_PRINT_PATCH=0
exec .venv/bin/python -m job --config examples/local-demo.yaml "$@"
