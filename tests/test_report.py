"""Tests of job/commands/report.py: report.md and PNG plots from a fake run directory."""

import json
import sys
from pathlib import Path

import pytest

from job.commands import report
from job.records import run_record

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _fake_run(run_dir: Path, monkeypatch, with_record=True):
    for var in ("JOB_CHART", "JOB_IMAGE", "KUBERNETES_SERVICE_HOST", "POD_NAME", "POD_NAMESPACE"):
        monkeypatch.delenv(var, raising=False)
    run_dir.mkdir(parents=True)
    rows = [{"kind": "start", "params": 1000, "world_size": 2}]
    for step in range(1, 21):
        rows.append({"kind": "train", "step": step, "loss": 4.0 - 0.1 * step, "lr": 1e-4, "grad_norm": 0.9,
                     "tokens_per_s": 4000.0 + step, "tokens_per_s_per_device": 2000.0 + step / 2,
                     "mfu": 0.30 + step / 1000, "peak_mem_gib": 12.5})
        if step % 10 == 0:
            rows.append({"kind": "eval", "step": step, "eval_loss": {10: 3.25, 20: 3.5}[step], "eval_ppl": 26.0})
    question = {"question": "Question: 2 + 2?", "expected": "4"}
    rows.insert(1, {"kind": "eval", "step": 0, "eval_loss": 6.0, "eval_ppl": 403.4})
    rows.insert(2, {"kind": "task_eval", "step": 0, "task": "arithmetic", "exact_match": 0.25, "n": 40,
                    "examples": [{**question, "got": "five", "correct": False}]})
    rows.append({"kind": "task_eval", "step": 20, "task": "arithmetic", "exact_match": 0.75, "n": 40,
                 "examples": [{**question, "got": "2 + 2 = 4 | #### 4", "correct": True}]})
    time = {"wall_s": 100.0, "goodput": 0.6, "checkpoint_blocking_s": [0.5, 0.75],
            "phases_s": {"startup": 20.0, "train": 60.0, "eval": 5.0, "export": 15.0, "other": 0.0},
            "startup_s": {"driver": 4.0, "ray": 5.0, "prepare": 1.0, "workers": 9.0, "preflight": 1.0}}
    rows.append({"kind": "time", "step": 20, **time})
    rows.append({"kind": "sample", "step": 20, "prompt": "hi", "text": "hello"})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if with_record:
        config = {"model": {"name_or_path": "tiny-llama"}, "train": {"lr": 1e-4, "max_steps": 20, "seed": 7},
                  "unrelated": {"x": 1}}
        rec = run_record.start_record(str(run_dir), config=config, config_text="model: ...\n", seed=7,
                                    pods=[{"digest": "unknown", "reason": "not running in Kubernetes"}], env={})
        run_record.finish_record(str(run_dir), rec, dataset={"source": "shared/data/tiny.jsonl", "rows": 128},
                               tokenizer_sha256="ab" * 32, checkpoints={"dir": str(run_dir / "checkpoints")},
                               time=time)


def test_report_writes_markdown_and_pngs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    run_dir, out = tmp_path / "runs" / "demo", tmp_path / "out"
    _fake_run(run_dir, monkeypatch)
    assert report.main([str(run_dir), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert text.startswith("# Run report: demo\n")
    assert "| Status | succeeded |" in text
    assert "- `model.name_or_path`: tiny-llama" in text and "- `train.lr`: 0.0001" in text
    assert "unrelated" not in text  # only highlights
    assert "- `source`: shared/data/tiny.jsonl" in text and "tokenizer sha256: " + "ab" * 32 in text
    assert "| final eval loss | 3.5 |" in text and "| best eval loss | 3.25 (step 10) |" in text
    assert "| tokens/s per device | 2008 |" in text  # median of steps 11..20
    assert "| MFU | 31.6% |" in text and "| peak memory (GiB) | 12.5 |" in text
    # Before and after: the first and the last evaluation, and the same question's generations side by side.
    assert "| | step 0 | step 20 |" in text and "| held-out loss | 6 | 3.5 |" in text
    assert "| exact match | 0.25 | 0.75 |" in text and "| task examples scored | 40 | 40 |" in text
    assert "| Question: 2 + 2? | 4 | ✗ five | ✓ 2 + 2 = 4 \\| #### 4 |" in text
    assert "| train | 60.0 | 60.0% |" in text and "goodput **60.0%**" in text and "(s): 0.50, 0.75." in text
    assert "Startup by step (s): driver 4.0, ray 5.0, prepare 1.0, workers 9.0, preflight 1.0." in text
    assert "not running in Kubernetes" in text
    # A CPU run says so; the CPU's name is not an accelerator, torch's CUDA build not the run's.
    assert "- devices: **CPU run**, no accelerator (1 x " in text and "(not used)" in text and "GPU run" not in text
    assert "| Duration (this attempt's record) |" in text and "Wall: from the driver's start" in text
    plots = ["loss.png", "throughput.png", "mfu.png", "task.png", "time.png"]
    for name in plots:
        assert f"![{name[:-4]}]({name})" in text
        data = (out / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 1000
        pixels = matplotlib.image.imread(out / name)
        assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
        assert pixels.std() > 0  # something was drawn
    assert "wrote" in capsys.readouterr().out


def test_report_defaults_to_run_dir_and_handles_missing_inputs(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "metrics-only"
    _fake_run(run_dir, monkeypatch, with_record=False)
    assert report.main([str(run_dir), "--no-plots"]) == 0
    text = (run_dir / "report.md").read_text()
    assert "# Run report: (no run.json)" in text and f"no run.json at {run_dir / 'run.json'}" in text
    assert "| final eval loss | 3.5 |" in text and not list(run_dir.glob("*.png"))

    empty = tmp_path / "empty"
    empty.mkdir()
    assert report.main([str(empty)]) == 2
    assert "has neither run.json nor metrics.jsonl" in capsys.readouterr().err


def test_report_lists_each_attempts_logs_and_quotes_the_end_of_the_newest(tmp_path, monkeypatch):
    """The driver's output and the workers' tracebacks, on the storage after the pods are gone (logs/<stamp>/)."""
    run_dir = tmp_path / "runs" / "demo"
    _fake_run(run_dir, monkeypatch)
    first, last = run_dir / "logs" / "20261206T010000Z", run_dir / "logs" / "20261206T020000Z"
    first.mkdir(parents=True)
    last.mkdir(parents=True)
    (first / "driver.log").write_text("resolved config\nrun failed: infrastructure/worker_lost\n")
    (last / "driver.log").write_text("".join(f"line {i}\n" for i in range(40)) + "run directory: /runs/demo\n")
    (last / "rank1.log").write_text("Traceback (most recent call last):\nOSError: [Errno 28] No space left on device\n")
    assert report.main([str(run_dir), "--no-plots"]) == 0
    text = (run_dir / "report.md").read_text()
    assert "- `20261206T010000Z/`: driver.log (2 lines)" in text
    assert "- `20261206T020000Z/`: driver.log (41 lines), rank1.log (2 lines)" in text
    assert "The end of `20261206T020000Z/driver.log`:\n\n```\nline 26\n" in text and "run directory: /runs/demo\n```" in text
    assert "line 25\n" not in text and "OSError: [Errno 28] No space left on device\n```" in text


def test_report_without_matplotlib(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    _fake_run(run_dir, monkeypatch, with_record=False)
    # A None entry in sys.modules makes `import matplotlib` raise ImportError.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert report.main([str(run_dir)]) == 0  # the README's setup has no matplotlib: the report still works
    [line] = capsys.readouterr().err.splitlines()
    assert "no plots: matplotlib is not installed" in line and "pip install matplotlib" in line
    assert "pip install matplotlib" in (run_dir / "report.md").read_text()
    assert not list(run_dir.glob("*.png"))


def test_report_names_a_gpu_runs_devices():
    hardware = {"nodes": 2, "world_size": 16, "accelerator_type": "cuda", "accelerators": {"NVIDIA H100 80GB HBM3": 16},
                "driver_versions": ["570.1"], "cuda_version": "13.0", "nccl_version": "2.29.7"}
    text = report.render_markdown({"hardware": hardware}, {}, [], [])
    assert "- devices: **GPU run** (cuda): 16 x NVIDIA H100 80GB HBM3" in text
    assert "- driver: 570.1; CUDA 13.0; NCCL 2.29.7" in text and "CPU run" not in text
