"""FSDP2 fine-tuning of Hugging Face causal LMs under Ray Train, shipped by a Helm chart.

A tree whose folders say the architecture (docs/architecture.md): `worker/` (what runs in each training process:
build, data, model, loss, the loop, evaluation, checkpoints, export, metrics), `records/` (what a run leaves and
how it is read: the run record, failures, the run index, report, compare, environment, NCCL, preflight, MLflow),
`driver/` (resolving the run, launching the workers, watching them), with `config`, `storage` and `packages`
shared by all; `__main__` is the command line. Imports point one way: driver -> worker -> records -> shared.
"""

import os

__version__ = "0.2.0"

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
"""Where this package's files are (the chart mounts them at /opt/job/job): what the run record's job sha256 is
taken over, and the directory above it is where a fresh interpreter imports it from."""
