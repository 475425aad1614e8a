"""FSDP2 fine-tuning of Hugging Face causal LMs under Ray Train, shipped by a Helm chart.

Its folders say the architecture (docs/architecture.md): `driver/`, `worker/`, `commands/` (reading runs),
`records/` (writing them), `common/` (shared without torch), with `config`, `rules`, `storage`, `packages` and
`signals` under all. Imports point one way: driver -> worker -> commands -> records -> common -> shared.
"""

import os

__version__ = "0.2.0"

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
"""Where this package's files are (the chart mounts them at /opt/job/job): what the run record's job sha256 is
taken over, and the directory above it is where a fresh interpreter imports it from."""
