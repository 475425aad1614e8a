"""The benchmark script end to end on CPU: tiny model, baseline and our loop under both launchers, one table."""

import json
import subprocess
import sys

import pytest

from conftest import REPO


def test_benchmark_runs_every_launcher_and_prints_the_table(tmp_path):
    out = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, "bench/benchmark.py", "--preset", "qwen2-tiny", "--seq-len", "32", "--cpu", "--gpus", "2",
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
    table = result.stdout.splitlines()[-6:-1]
    assert result.stdout.splitlines()[-1].startswith("wall s: hf ")
    assert (tmp_path / "rows-default-2.log").exists()  # each variant's log beside the rows
    assert table[0].split()[:2] == ["variant", "launcher"] and table[4].startswith("best-ray")
    # Each baseline's ratio to itself (the ratio is to the baseline of the same global batch), and no ratio for a
    # global batch the baseline did not run; no Trainer-with-Liger row on CPU, so its column is empty.
    assert table[0].split()[-4:] == ["vs", "hf", "vs", "liger"]
    assert table[1].split()[-2] == "1.00" and table[2].split()[-2] == "1.00" and table[3].split()[-2] != "-"
    assert [line.split()[-1] for line in table[1:]] == ["-"] * 4


def load_benchmark():
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmark", REPO / "bench" / "benchmark.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    return benchmark


def test_ratios_are_to_the_baseline_as_specified_not_to_its_variants(capsys):
    """`hf-cudnn` (the baseline with an option) is a row of its own; ratios stay against plain `hf` (`vs hf`) and
    the Trainer with Liger (`vs liger`), each at the same global batch: `best-b8-fp8` has only a Liger peer here
    (the plain Trainer's global batch 8 is `hf-accum2`), a skipped variant no figures."""
    benchmark = load_benchmark()
    row = dict(gpus=1, batch=4, accum=1, mfu=None, step_time_s=1.0, peak_mem_gib=None)
    benchmark.print_table([
        {**row, "variant": "hf", "launcher": "hf", "tokens_per_s_per_device": 100.0},
        {**row, "variant": "hf-cudnn", "launcher": "hf", "tokens_per_s_per_device": 110.0},
        {**row, "variant": "hf-liger", "launcher": "hf", "tokens_per_s_per_device": 125.0},
        {**row, "variant": "best-cudnn", "launcher": "torchrun", "tokens_per_s_per_device": 150.0},
        {**row, "variant": "hf-liger-b8", "launcher": "hf", "batch": 8, "tokens_per_s_per_device": 140.0},
        {**row, "variant": "best-b8-fp8", "launcher": "torchrun", "batch": 8, "tokens_per_s_per_device": 175.0},
        {**row, "variant": "best-fp8", "launcher": "torchrun", "skipped": "--budget 400 s used up"},
    ])
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[-2:] for line in lines[:-1]] == [
        ["1.00", "0.80"], ["1.10", "0.88"], ["1.25", "1.00"], ["1.50", "1.20"], ["-", "1.00"], ["-", "1.25"]]
    assert lines[-1].startswith("best-fp8") and lines[-1].endswith("SKIPPED --budget 400 s used up")


def test_lora_rows_are_compared_with_the_trainer_and_peft(capsys):
    """A LoRA row's ratios are to the Trainer with peft (plain, and with Liger) at its global batch, never to the
    full fine-tune's Trainer rows; the full fine-tune's ratios stay with those."""
    benchmark = load_benchmark()
    row = dict(gpus=1, batch=4, accum=1, mfu=None, step_time_s=1.0, peak_mem_gib=None)
    benchmark.print_table([
        {**row, "variant": "hf", "launcher": "hf", "tokens_per_s_per_device": 100.0},
        {**row, "variant": "hf-peft-liger", "launcher": "hf", "tokens_per_s_per_device": 80.0},
        {**row, "variant": "best-cudnn-lora", "launcher": "torchrun", "tokens_per_s_per_device": 120.0},
        {**row, "variant": "best-cudnn", "launcher": "torchrun", "tokens_per_s_per_device": 110.0},
        {**row, "variant": "hf-peft-b2", "launcher": "hf", "batch": 2, "tokens_per_s_per_device": 50.0},
        {**row, "variant": "best-b2-cudnn-lora", "launcher": "torchrun", "batch": 2, "tokens_per_s_per_device": 70.0},
    ])
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[-2:] for line in lines] == [
        ["1.00", "-"], ["-", "1.00"], ["-", "1.50"], ["1.10", "-"], ["1.00", "-"], ["1.40", "-"]]


def test_qlora_rows_are_compared_with_the_trainer_peft_and_bitsandbytes_of_the_same_shape(capsys):
    """The 7B QLoRA row's ratios are to the Trainer + peft + bitsandbytes 4-bit of the 7B shape (plain and with
    Liger), the 7B LoRA row's to the Trainer + peft of that shape; the 32B row has no peer."""
    benchmark = load_benchmark()
    row = dict(gpus=1, batch=1, accum=1, mfu=None, step_time_s=1.0, peak_mem_gib=None)
    benchmark.print_table([
        {**row, "variant": "hf-qlora-7b", "launcher": "hf", "tokens_per_s_per_device": 100.0},
        {**row, "variant": "hf-qlora-liger-7b", "launcher": "hf", "tokens_per_s_per_device": 125.0},
        {**row, "variant": "qlora-7b", "launcher": "torchrun", "tokens_per_s_per_device": 150.0},
        {**row, "variant": "hf-peft-7b", "launcher": "hf", "tokens_per_s_per_device": 200.0},
        {**row, "variant": "lora-7b", "launcher": "torchrun", "tokens_per_s_per_device": 300.0},
        {**row, "variant": "qlora-32b", "launcher": "torchrun", "tokens_per_s_per_device": 30.0},
    ])
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[-2:] for line in lines] == [
        ["1.00", "0.80"], ["1.25", "1.00"], ["1.50", "1.20"], ["1.00", "-"], ["1.50", "-"], ["-", "-"]]
    v = benchmark.VARIANTS
    assert v["hf-qlora-7b"].overrides["load-in-4bit"] and v["qlora-7b"].overrides["model.lora.quantize_base"] == "nf4"


def test_liger_and_fp8_variants_pass_their_options():
    """`hf-liger` passes the baseline script's `--liger` flag; the FP8 rows are best-cudnn plus rowwise float8."""
    benchmark = load_benchmark()
    v = benchmark.VARIANTS
    assert v["hf-liger"].overrides == {"liger": True} and (v["hf-liger"].batch, v["hf-liger-b8"].batch) == (4, 8)
    assert v["best-fp8"].overrides == {**v["best-cudnn"].overrides, "parallel.float8": "rowwise"}
    assert (v["best-fp8"].batch, v["best-b8-fp8"].batch) == (4, 8)


@pytest.mark.parametrize("variant, refusal", [
    ("hf-liger", "--liger needs a CUDA device"),  # the baseline script got the --liger flag
    ("titan", "torchtitan_baseline.py: error: needs a CUDA device"),  # torchtitan's script ran, with the options
])
def test_peer_rows_reach_their_scripts_which_refuse_them_without_cuda(tmp_path, variant, refusal):
    """On CPU a peer's GPU-only row fails with its script's own message: the benchmark ran that script under
    torchrun with the row's options (and the ones every peer script takes, `peer_parser`)."""
    out = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, "bench/benchmark.py", "--preset", "qwen2-tiny", "--seq-len", "32", "--cpu", "--gpus", "1",
         "--steps", "4", "--log-every", "1", "--skip", "1", "--only", variant, "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    [row] = json.loads(out.read_text())
    assert row["variant"] == variant and row["launcher"] == load_benchmark().VARIANTS[variant].launcher
    assert refusal in row["error"]


def test_titan_rows_are_variants_with_ratios_to_both_baselines(capsys):
    """torchtitan's rows (launcher "titan") are divided by the Trainer's rows of their global batch, never used as
    a baseline themselves: `titan` has a plain-Trainer peer only, `titan-b8` a Liger one only."""
    benchmark = load_benchmark()
    row = dict(gpus=1, accum=1, mfu=None, step_time_s=1.0, peak_mem_gib=None)
    benchmark.print_table([
        {**row, "variant": "titan", "launcher": "titan", "batch": 4, "tokens_per_s_per_device": 120.0},
        {**row, "variant": "hf", "launcher": "hf", "batch": 4, "tokens_per_s_per_device": 100.0},
        {**row, "variant": "titan-b8", "launcher": "titan", "batch": 8, "tokens_per_s_per_device": 175.0},
        {**row, "variant": "hf-liger-b8", "launcher": "hf", "batch": 8, "tokens_per_s_per_device": 140.0},
    ])
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[-2:] for line in lines] == [["1.20", "-"], ["1.00", "-"], ["-", "1.25"], ["-", "1.00"]]
    v = benchmark.VARIANTS
    assert (v["titan"].launcher, v["titan"].batch, v["titan-b8"].batch) == ("titan", 4, 8)
