"""The benchmark script end to end on CPU: tiny model, baseline and our loop under both launchers, one table."""

import json
import subprocess
import sys

from conftest import REPO


def test_benchmark_runs_every_launcher_and_prints_the_table(tmp_path):
    out = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, "scripts/benchmark.py", "--preset", "qwen2-tiny", "--seq-len", "32", "--cpu", "--gpus", "2",
         "--steps", "4", "--log-every", "1", "--skip", "1", "--only", "hf,default,best-ray", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["variant"], r["launcher"], r["gpus"]) for r in rows] == [
        ("hf", "hf", 2), ("default", "torchrun", 2), ("best-ray", "ray", 2)]
    for r in rows:
        assert "error" not in r and r["tokens_per_s_per_device"] > 0
        assert abs(r["step_time_s"] - r["batch"] * 32 / r["tokens_per_s_per_device"]) < 0.05 * r["step_time_s"]
    table = result.stdout.splitlines()[-4:]
    assert table[0].split()[:2] == ["variant", "launcher"] and table[3].startswith("best-ray")
    assert table[1].split()[-1] == "1.00"  # the baseline's ratio to itself
