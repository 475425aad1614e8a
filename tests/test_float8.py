"""`parallel.float8` (torchao float8 training of the linear layers): never on by default, refused clearly where it
cannot run (no CUDA GPU of compute capability >= 8.9, no torchao, fp32 compute), and, where torchao is
installed (requirements-dev.txt), the conversion swaps exactly the decoder layers' projections of a tiny model.
The float8 GEMMs themselves need the GPU (bench/device-bench.sh issue19, bench/fp8_parity.py)."""

import re
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO
from job import config as config_lib
from job import packages
from job.config import ModelConfig, ParallelConfig
from job.worker.model.causal_lm import CausalLMWithLoss, build_causal_lm
from job.worker.model.parallelize import check_float8_device, convert_to_float8, parallelize

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def tiny_lm(**overrides):
    cfg = ModelConfig(preset="qwen2-tiny", init="random", overrides={"num_hidden_layers": 2, **overrides})
    return build_causal_lm(cfg, None, seed=0)


def test_off_by_default():
    assert ParallelConfig().float8 == "none"
    assert config_lib.load_dict({"name": "r", "model": {"preset": "qwen2-tiny", "init": "random"}}).parallel.float8 == "none"


def test_without_a_capable_gpu_the_worker_stops_naming_the_field():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this machine can run float8")
    with pytest.raises(RuntimeError, match=r"^parallel\.float8: rowwise needs (a CUDA GPU|compute capability >= 8\.9)"):
        check_float8_device("rowwise", "cuda" if torch.cuda.is_available() else "cpu")
    # parallelize() checks before it touches the model (the mesh is not needed for that).
    with pytest.raises(RuntimeError, match=r"^parallel\.float8: tensorwise needs a CUDA GPU"):
        parallelize(CausalLMWithLoss(tiny_lm()), ParallelConfig(float8="tensorwise"), SimpleNamespace(device_type="cpu"),
                    bf16=True)


def test_without_torchao_the_driver_and_the_worker_name_the_package_and_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    cfg = config_lib.load_dict({"name": "r", "model": {"preset": "qwen2-tiny", "init": "random"},
                                "scaling": {"use_gpu": True}, "parallel": {"float8": "rowwise"}})
    fix = f"torchao=={packages.TORCHAO_VERSION}"
    with pytest.raises(packages.MissingPackage, match=rf"^parallel\.float8: rowwise needs the Python package 'torchao'.*{fix}"):
        packages.check_config(cfg)
    with pytest.raises(packages.MissingPackage, match=r"^parallel\.float8: rowwise needs the Python package 'torchao'"):
        convert_to_float8(tiny_lm(), "rowwise")


def test_torchao_pin_is_the_same_everywhere():
    dev = dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", (REPO / "requirements-dev.txt").read_text(), re.M))
    wheels = re.findall(r"^\s+torchao==(\S+)$", (REPO / "bench" / "device-wheels.sh").read_text(), re.M)
    assert dev["torchao"] == packages.TORCHAO_VERSION and wheels == [packages.TORCHAO_VERSION]


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_conversion_swaps_the_projections_but_not_the_head(recipe):
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    lm = tiny_lm()
    before = {name: p for name, p in lm.named_parameters()}
    converted = convert_to_float8(lm, recipe)
    assert converted == [f"model.layers.{i}.{proj}" for i in range(2) for proj in PROJECTIONS]
    swapped = {name for name, m in lm.named_modules() if isinstance(m, Float8Linear)}
    assert swapped == set(converted) and not isinstance(lm.lm_head, Float8Linear)
    # The same parameters under the same names: checkpoints, the export and gathered_copy are unaffected.
    assert {name: p for name, p in lm.named_parameters()} == before
    assert lm.lm_head.weight is lm.model.embed_tokens.weight


def test_conversion_skips_layers_whose_widths_are_not_multiples_of_16():
    pytest.importorskip("torchao.float8")
    converted = convert_to_float8(tiny_lm(intermediate_size=100), "rowwise")  # gate/up 128 -> 100, down 100 -> 128
    assert converted == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]


def test_parity_script_runs_bf16_and_reports_a_float8_run_that_cannot_start(tmp_path):
    """bench/fp8_parity.py on CPU: the bf16 run trains and is tabled; the float8 one is refused by the job's config
    check (CPU workers) and reported as FAILED, so the verdict is not PASS."""
    import json
    import subprocess

    import yaml

    from conftest import tiny_run_config

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_run_config(tmp_path, scaling={"num_workers": 1})))
    proc = subprocess.run(
        [sys.executable, "bench/fp8_parity.py", "--config", str(config), "--steps", "6", "--eval-every", "3",
         "--log-every", "2", "--skip", "1", "--storage", str(tmp_path / "parity")],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:] + proc.stderr[-3000:]
    assert "rowwise: FAILED" in out and "parallel.float8: rowwise needs scaling.use_gpu: true" in out
    table = out[out.index("parallel.float8 "):].splitlines()
    assert table[1].split()[0] == "none" and table[-1].startswith("FAIL")
    metrics = [json.loads(line) for line in (tmp_path / "parity" / "parity-none" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if r["kind"] == "eval"] == [0, 3, 6]
    assert not list((tmp_path / "parity" / "parity-none").glob("checkpoint_*"))  # deleted once read
