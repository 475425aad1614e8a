"""FSDP2 fine-tuning of Hugging Face causal LMs under Ray Train, shipped by a Helm chart.

A tree whose folders say the architecture (docs/architecture.md): `driver/` (resolving the run, launching the
workers, watching them), `worker/` (what runs in each training process), `commands/` (reading runs: the index,
report, compare), `records/` (writing a run's record), `common/` (what driver and workers share without torch),
with `config`, `rules`, `storage`, `packages` and `signals` under all; `__main__` is the command line. Imports
point one way: driver -> worker -> commands -> records -> common -> shared.
"""

import os

__version__ = "0.2.0"

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
"""Where this package's files are (the chart mounts them at /opt/job/job): what the run record's job sha256 is
taken over, and the directory above it is where a fresh interpreter imports it from."""
