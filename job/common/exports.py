"""The export's place in the run directory and whether it was accepted, without torch: the driver asks before it
starts a finished run again. Writing and checking an export is `worker/model/export.py`'s; writing a pairs run's
`pairs.jsonl` and `pairs.json` (written last) is `worker/pairs.py`'s.

    <run>/export/   model.safetensors (or, with LoRA, the PEFT adapter and `merged/`), config.json,
                    generation_config.json, tokenizer files,
                    reference.json   what the acceptance check must reproduce (loss, step, how it was measured)
                    heldout.safetensors   the held-out blocks of that final evaluation, in its micro-batches
                    acceptance.json  the check's result; `_VALID` once it passed (written last)
"""

from __future__ import annotations

import json

from .. import storage

EXPORT_DIR = "export"


VALID = "_VALID"
"""Marker written into the export directory once the fresh-process acceptance check passed."""


HELDOUT = "heldout.safetensors"


ADAPTER_CONFIG = "adapter_config.json"


ADAPTER_WEIGHTS = "adapter_model.safetensors"


MERGED = "merged"
"""With LoRA: the export holds a PEFT adapter (`ADAPTER_CONFIG`, `ADAPTER_WEIGHTS`), and `merged/` the merged
full weights with `model.lora.merged_export`."""


def export_is_valid(run_dir: str, step: int) -> bool:
    """Whether `<run>/export/` holds an accepted export of `step` (a finished run re-run skips the export)."""
    marker = storage.join(run_dir, EXPORT_DIR, VALID)
    try:
        return storage.exists(marker) and json.loads(storage.read_bytes(marker)).get("step") == step
    except (OSError, ValueError):
        return False


PAIRS_FILE = "pairs.jsonl"
PAIRS_RECORD = "pairs.json"
