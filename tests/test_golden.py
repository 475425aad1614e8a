"""Pinned losses (like torchtune's recipe tests): a tiny Qwen2 trained from a fixed seed on fixed text, on 2 CPU
workers with FSDP2 over gloo, must reproduce these per-step train losses and this held-out loss.

The equivalence tests (torchrun = Ray, resume = uninterrupted, HSDP = FSDP) compare two runs of the same code,
so a bug both sides share (a shifted label, a wrong mask, a broken warm-up or weight decay, a changed init) passes
them; it does not pass this. The numbers are the same, to the last digit, on both dependency sets (torch 2.13.0
CPU with Ray 2.60/transformers 5.24 on Python 3.11, and the image's torch 2.13.0 CUDA build with Ray 2.58/
transformers 5.13 on Python 3.13, run on CPU), so there is one pin. The tolerance (1e-5) leaves room for float
summation order on another CPU only: the smallest step-to-step change here is 0.01 and any of the bugs above
moves the losses by more than 1e-3.

If a deliberate change moves the numbers (another tokenizer trainer, model init, data order), rerun this test,
check the new losses still start near ln 512 = 6.24 and fall, and pin them in the same commit, saying why.
"""

import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, SHARED_DATA, tiny_run_config

TRAIN_LOSSES = [6.251729965209961, 6.221432685852051, 6.104432106018066, 6.024391174316406, 5.967250347137451,
                5.956872940063477]
EVAL_LOSS_AT_STEP_6 = 5.938655853271484


@pytest.mark.image_set
def test_tiny_model_reproduces_the_pinned_losses(tmp_path):
    raw = tiny_run_config(tmp_path, name="golden", data={"train": str(SHARED_DATA / "tinyshakespeare" / "input.txt")},
                          train={"max_steps": 6, "warmup_steps": 2}, logging={"every_steps": 1},
                          checkpoint={"export": False})
    config = tmp_path / "golden.yaml"
    config.write_text(yaml.safe_dump(raw))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "-m", "job", "--config", str(config)],
                   cwd=REPO, check=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(tmp_path / "runs" / "golden" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in train] == pytest.approx(TRAIN_LOSSES, rel=0, abs=1e-5)
    [final_eval] = [r for r in rows if r["kind"] == "eval" and r["step"] == 6]
    assert final_eval["eval_loss"] == pytest.approx(EVAL_LOSS_AT_STEP_6, rel=0, abs=1e-5)
