"""bench/hf_trainer_baseline.py runs end to end on CPU (qwen2-tiny preset, fp32, 1 process)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from job.common.presets import PRESETS

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "hf_trainer_baseline.py"


def test_tiny_cpu_run_prints_json_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--preset", "qwen2-tiny", "--seq-len", "32", "--batch", "2",
         "--steps", "4", "--warmup", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith('{"impl"')]
    assert len(lines) == 1, proc.stdout[-3000:]
    res = json.loads(lines[0])
    assert res["preset"] == "qwen2-tiny" and res["device"] == "cpu" and res["world_size"] == 1
    assert res["steps"] == 4
    assert res["tokens_per_s_per_device"] > 0 and res["step_time_s"] > 0
    vocab = PRESETS["qwen2-tiny"]["vocab_size"]
    assert abs(res["final_loss"] - math.log(vocab)) < 1.0  # random tokens: ~ln(vocab) at init, nothing to learn


def test_cudnn_attention_without_cuda_is_refused_by_name():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--preset", "qwen2-tiny", "--sdpa-backend", "cudnn"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--sdpa-backend cudnn needs a CUDA device" in proc.stderr


def test_liger_without_cuda_is_refused_by_name():
    """`--liger` (TrainingArguments(use_liger_kernel=True)) needs Triton on a GPU: refused cleanly on CPU."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--preset", "qwen2-tiny", "--liger"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--liger needs a CUDA device" in proc.stderr
