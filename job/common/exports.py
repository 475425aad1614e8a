"""The export's place in the run directory and whether it was accepted, without torch: the driver asks before it
starts a finished run again. Writing and checking an export is `worker/model/export.py`'s; writing a pairs run's
`pairs.jsonl` and `pairs.json` (written last) is `worker/pairs.py`'s.

    <run>/export/   model.safetensors (or, with LoRA, the PEFT adapter and `merged/`), config.json,
                    generation_config.json, tokenizer files,
                    reference.json   what the acceptance check must reproduce (loss, step, how it was measured)
                    heldout.safetensors   the held-out blocks of that final evaluation, in its micro-batches
                    acceptance.json  the check's result; `_VALID` once it passed (written last)
    <run>/exports/step-<N>/   each earlier accepted export of the run (a finished run extended), as it was
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


PAIRS_FILE = "pairs.jsonl"
PAIRS_RECORD = "pairs.json"
"""What `python -m job pairs` writes into its run directory: the preference pairs and their counts."""
EARLIER_DIR = "exports"
"""Where an accepted export goes when a later step's export takes `export/` (`keep_accepted`)."""
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


def accepted_step(export_dir: str) -> int | None:
    """The step of the accepted export in `export_dir` (its `_VALID` marker), or None."""
    try:
        return int(json.loads(storage.read_bytes(storage.join(export_dir, VALID)))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def keep_accepted(run_dir: str, step: int) -> None:
    """Before the export of `step` takes `<run>/export/`: an accepted export of another step there (a finished run
    extended) moves to `<run>/exports/step-<N>/`, whole, so the model an earlier attempt ended with stays."""
    final = storage.join(run_dir, EXPORT_DIR)
    earlier = accepted_step(final)
    if earlier is None or earlier == step:
        return
    fs, path = storage.filesystem(final)
    fs.mv(path, storage.filesystem(storage.join(run_dir, EARLIER_DIR, f"step-{earlier:08d}"))[1], recursive=True)


def earlier_exports(run_dir: str) -> list[dict]:
    """`{"step", "dir"}` of every earlier accepted export kept in `<run>/exports/`, oldest first."""
    fs, path = storage.filesystem(storage.join(run_dir, EARLIER_DIR))
    if not fs.exists(path):
        return []
    found = []
    for entry in fs.ls(path, detail=False):
        uri = storage.join(run_dir, EARLIER_DIR, entry.rstrip("/").rsplit("/", 1)[-1])
        if (step := accepted_step(uri)) is not None:
            found.append({"step": step, "dir": uri})
    return sorted(found, key=lambda e: e["step"])
