"""The benchmark script end to end on CPU: tiny model, baseline and our loop under both launchers, one table."""

import json
import subprocess
import sys

from conftest import REPO


def test_benchmark_runs_every_launcher_and_prints_the_table(tmp_path):
    out = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, "scripts/benchmark.py", "--preset", "qwen2-tiny", "--seq-len", "32", "--cpu", "--gpus", "2",
         "--steps", "4", "--log-every", "1", "--skip", "1", "--only", "hf,hf-accum2,default,best-ray", "--out", str(out),
         "--profile-step", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["variant"], r["launcher"], r["gpus"], r["accum"]) for r in rows] == [
        ("hf", "hf", 2, 1), ("hf-accum2", "hf", 2, 2), ("default", "torchrun", 2, 1), ("best-ray", "ray", 2, 1)]
    for r in rows:
        assert "error" not in r and r["tokens_per_s_per_device"] > 0
        tokens_per_step = r["batch"] * r["accum"] * 32
        assert abs(r["step_time_s"] - tokens_per_step / r["tokens_per_s_per_device"]) < 0.05 * r["step_time_s"]
    # Our variants were profiled at step 3: device time by category in the row, the kernel table beside it.
    assert rows[2]["profile"]["by_category_ms"]["matmul"] > 0 and "profile" not in rows[0]
    assert (tmp_path / "rows-best-ray-2.profile.txt").read_text().startswith("step 3 on cpu")
    table = result.stdout.splitlines()[-5:]
    assert table[0].split()[:2] == ["variant", "launcher"] and table[4].startswith("best-ray")
    # Each baseline's ratio to itself (the ratio is to the baseline of the same global batch), and no ratio for a
    # global batch the baseline did not run.
    assert table[1].split()[-1] == "1.00" and table[2].split()[-1] == "1.00" and table[3].split()[-1] != "-"


def test_ratios_are_to_the_baseline_as_specified_not_to_its_variants(capsys):
    """`hf-cudnn` (the baseline with an option) is a row of its own; ratios stay against plain `hf`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmark", REPO / "scripts" / "benchmark.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    row = dict(gpus=1, batch=4, accum=1, mfu=None, step_time_s=1.0, peak_mem_gib=None)
    benchmark.print_table([
        {**row, "variant": "hf", "launcher": "hf", "tokens_per_s_per_device": 100.0},
        {**row, "variant": "hf-cudnn", "launcher": "hf", "tokens_per_s_per_device": 110.0},
        {**row, "variant": "best-cudnn", "launcher": "torchrun", "tokens_per_s_per_device": 150.0},
    ])
    ratios = [line.split()[-1] for line in capsys.readouterr().out.splitlines()[1:]]
    assert ratios == ["1.00", "1.10", "1.50"]
