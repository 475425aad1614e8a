#!/usr/bin/env bash
# Set up the environments, then run every test on the pinned dependency set (.venv) and the tests marked
# `image_set` again on the Ray image's library versions (.venv-image, Python 3.13). Extra arguments go to both
# pytest runs; IMAGE_SET=0 skips the second (for a quick local run; CI runs both).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh --dev
.venv/bin/python -m pytest -q "$@" tests
[[ "${IMAGE_SET:-1}" == 0 ]] && exit 0
bash scripts/setup.sh --image
echo "# the image's library versions: $(.venv-image/bin/python -c 'import platform, ray, torch, transformers
print(f"Python {platform.python_version()}, Ray {ray.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")')"
status=0
.venv-image/bin/python -m pytest -q -m image_set "$@" tests || status=$?
# Extra arguments may select no image_set test (pytest exit 5): that is not a failure of this set.
[[ $status == 5 ]] && exit 0
exit $status
