"""LoRA (`model.lora`): only the adapters train, checkpoints hold them and resume exactly after a lost worker, and
the export is a PEFT adapter that `peft` itself loads in a fresh process, beside merged weights equal to base +
adapter. One reference run on 2 CPU Ray Train workers (FSDP2-sharded adapters and base) serves the run tests."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from test_checkpoint import MAX_STEPS, _assert_same_training, _config, _final_weights, _records, _run

from conftest import REPO, tiny_run_config
from job import config as config_lib
from job.commands import report
from job.common import checkpoints
from job.config import ConfigError, LoraConfig
from job.records import run_record
from job.worker.model.causal_lm import CausalLMWithLoss, build_causal_lm
from job.worker.model.lora import add_adapters, is_adapter
from job.worker.model.parallelize import device_mesh, parallelize
from job.worker.optimizer import build_optimizer

LORA = {"rank": 4, "alpha": 8, "merged_export": True}


@pytest.fixture(scope="module")
def lora_reference(ray_cluster, tmp_path_factory):
    """The uninterrupted LoRA run, with its adapter and merged export."""
    cfg = _config(tmp_path_factory.mktemp("lora-ref"), "lora-reference", model={"lora": LORA}, train={"lr": 2e-2},
                  eval={"every_steps": 10}, checkpoint={"export": True})
    return _run(cfg)


def train_adapters(lm, cfg: config_lib.RunConfig, steps: int = 3) -> None:
    """`steps` optimizer steps of `lm` (adapters added) on one CPU process, asserting the optimizer holds the
    adapters and nothing else."""
    model = parallelize(CausalLMWithLoss(lm), cfg.parallel, device_mesh("cpu", 1, 0), bf16=False)
    optimizer = build_optimizer(model, cfg.train)
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert {n for n, p in model.named_parameters() if id(p) in optimized} == {
        n for n, _ in model.named_parameters() if is_adapter(n)}
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        loss_sum, n = model(ids, ids)
        (loss_sum / n).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_only_the_adapters_train_and_the_base_stays_bit_identical(tmp_path, single_process):
    cfg = config_lib.load_dict(tiny_run_config(tmp_path, model={"lora": {"rank": 4}}))
    lm = build_causal_lm(cfg.model, 512, cfg.train.seed)
    base = {name: tensor.clone() for name, tensor in lm.state_dict().items()}
    with pytest.raises(ConfigError, match=r"^model\.lora\.targets: qkv match\(es\) no linear layer of Qwen2ForCausalLM"):
        add_adapters(lm, LoraConfig(rank=4, targets=["q_proj", "qkv"]))
    assert len(add_adapters(lm, cfg.model.lora)) == 2 * 7  # 2 layers x (4 attention + 3 MLP projections)
    train_adapters(lm, cfg)
    after = lm.state_dict()
    assert {k for k in after if not is_adapter(k)} == base.keys()
    changed = [name for name, tensor in base.items() if not torch.equal(after[name], tensor)]
    assert not changed, f"frozen weights changed: {changed}"
    assert all(after[k].abs().sum() > 0 for k in after if ".lora_B." in k), "the adapters trained"


def test_adapters_on_a_loaded_base_are_drawn_from_the_runs_seed(tmp_path):
    """A pretrained base draws nothing while it loads: its adapters come from the run's seed, not from whatever the
    process drew before (which differed between two runs of one config, and so did their losses from step 2), and
    are the same over the base in NF4 (QLoRA), whose module-by-module build draws values the files replace."""
    cfg = config_lib.load_dict(tiny_run_config(tmp_path))
    build_causal_lm(cfg.model, 512, cfg.train.seed).save_pretrained(tmp_path / "base")

    def adapters(drawn_before: int, **lora) -> dict[str, torch.Tensor]:
        model = config_lib.load_dict(tiny_run_config(tmp_path, model={
            "init": "pretrained", "path": str(tmp_path / "base"), "preset": None, "lora": {"rank": 4, **lora}})).model
        torch.rand(drawn_before)
        lm = build_causal_lm(model, None, cfg.train.seed)
        add_adapters(lm, model.lora)
        return {k: v for k, v in lm.state_dict().items() if ".lora_A." in k}

    first, second, quantized = adapters(1), adapters(7), adapters(3, quantize_base="nf4")
    assert first.keys() == second.keys() == quantized.keys() and first
    assert all(torch.equal(first[k], second[k]) and torch.equal(first[k], quantized[k]) for k in first)


def test_resume_refuses_another_base_or_method():
    cfg = config_lib.load_dict({"name": "r", "model": {"preset": "qwen2-tiny", "init": "random", "lora": {"rank": 8}}})
    identity = {**checkpoints.run_identity(cfg, 1, {}), **checkpoints.adapter_identity(cfg, {"files": {"a": "1"}})}
    checkpoints.check_identity("ckpt", {"identity": identity}, identity, [])
    other_base = {**identity, **checkpoints.adapter_identity(cfg, {"files": {"a": "2"}})}
    with pytest.raises(checkpoints.ResumeRefused, match=r"the frozen base weights \(model.path\): checkpoint sha256"):
        checkpoints.check_identity("ckpt", {"identity": identity}, other_base, ["data"])
    full = {k: v for k, v in identity.items() if k not in checkpoints.ADAPTER_FIELDS}
    with pytest.raises(checkpoints.ResumeRefused, match=r"model.lora \(rank, alpha, targets\): checkpoint none"):
        checkpoints.check_identity("ckpt", {"identity": full}, identity, [])


def test_a_merged_export_that_would_not_fit_is_named_before_training(tmp_path):
    import shutil

    from job.worker.model.export import merged_room_problem

    free = shutil.disk_usage(tmp_path).free
    assert merged_room_problem(str(tmp_path / "runs" / "r"), free // 2) is None
    problem = merged_room_problem(str(tmp_path / "runs" / "r"), 2 * free)
    assert problem.startswith(f"model.lora.merged_export: the merged weights need {2 * free / 1e9:.2f} GB and {tmp_path}")


def test_checkpoints_hold_the_adapters_and_resume_exactly_after_a_killed_worker(lora_reference, tmp_path):
    start = _records(lora_reference, "start")[0]
    saved = _final_weights(lora_reference)
    assert saved and all(is_adapter(k) for k in saved), "checkpoints hold the adapters alone"
    assert start["method"] == "lora" and start["lora_rank"] == 4 and start["lora_layers"] == 14
    assert start["trainable_params"] == sum(v.numel() for v in saved.values()) < start["params"] / 10
    cfg = _config(tmp_path, "lora-killed", model={"lora": {**LORA, "merged_export": False}}, train={"lr": 2e-2}, eval={"every_steps": 10},
                  scaling={"num_workers": 2, "max_failures": 1}, debug={"fail_at_step": 7, "fail_rank": 1})
    run_dir = _run(cfg)
    (resume,) = _records(run_dir, "resume")
    assert resume["step"] == 4
    _assert_same_training(run_dir, lora_reference)


PEFT_CHECK = textwrap.dedent("""
    import json, os, sys
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from job import config as config_lib
    from job.worker.model.causal_lm import CausalLMWithLoss, build_causal_lm

    export = sys.argv[1]
    ref = json.load(open(os.path.join(export, "reference.json")))
    cfg = config_lib.load_dict(ref["config"])
    base = build_causal_lm(cfg.model, len(AutoTokenizer.from_pretrained(export)), cfg.train.seed)
    base_weights = {k: v.clone() for k, v in base.state_dict().items()}
    lm = PeftModel.from_pretrained(base, export).eval()
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(export, "merged")).eval()
    blocks = load_file(os.path.join(export, "heldout.safetensors"))
    with torch.no_grad():
        batch = dict(input_ids=blocks["input_ids"][:4], position_ids=blocks["position_ids"][:4])
        logits_diff = (lm(**batch).logits - merged(**batch).logits).abs().max().item()
        model, totals, start = CausalLMWithLoss(lm.base_model.model), torch.zeros(2, dtype=torch.float64), 0
        for size in ref["batch_sizes"]:
            loss_sum, n = model(**{k: v[start:start + size] for k, v in blocks.items()})
            totals += torch.stack([loss_sum.double(), n.double()])
            start += size
    adapter = json.load(open(os.path.join(export, "adapter_config.json")))
    weights = load_file(os.path.join(export, "adapter_model.safetensors"))
    merged_weights = merged.state_dict()
    expected = dict(base_weights)
    for key in (k for k in weights if k.endswith(".lora_A.weight")):
        module = key[len("base_model.model."):-len(".lora_A.weight")]
        b = weights[key.replace("lora_A", "lora_B")]
        expected[module + ".weight"] = base_weights[module + ".weight"] + adapter["lora_alpha"] / adapter["r"] * (b @ weights[key])
    print(json.dumps({
        "lora_layers": sum(1 for m in lm.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A")),
        "logits_max_abs_diff": logits_diff,
        "peft_eval_loss": (totals[0] / totals[1]).item(), "reference_eval_loss": ref["eval_loss"],
        "merged_max_abs_diff": max((merged_weights[k] - v).abs().max().item() for k, v in expected.items()),
        "untargeted_identical": all(torch.equal(merged_weights[k], v) for k, v in base_weights.items()
                                    if k not in {m + ".weight" for m in (k2[len("base_model.model."):-len(".lora_A.weight")]
                                                                         for k2 in weights if k2.endswith(".lora_A.weight"))}),
    }))
""")


def test_peft_loads_the_adapter_in_a_fresh_process_and_the_merged_export_is_base_plus_adapter(lora_reference):
    export = f"{lora_reference}/export"
    acceptance = json.load(open(f"{export}/acceptance.json"))
    assert acceptance["ok"] and acceptance["merged_eval_loss"] == pytest.approx(acceptance["eval_loss"], abs=1e-5)
    out = subprocess.run([sys.executable, "-c", PEFT_CHECK, export], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["lora_layers"] == 14
    assert found["peft_eval_loss"] == pytest.approx(found["reference_eval_loss"], abs=1e-5)
    assert found["logits_max_abs_diff"] < 1e-4
    assert found["merged_max_abs_diff"] < 1e-6 and found["untargeted_identical"]
    summary = run_record.summarize_metrics(run_record.read_metrics(lora_reference))
    assert (summary["method"], summary["lora_rank"]) == ("lora", 4) and summary["trainable_params"] > 0
    markdown = report.render_markdown(run_record.load_record(lora_reference), summary, [], [])
    assert "| method | LoRA (rank 4) |" in markdown and f"| trainable parameters | {summary['trainable_params']} |" in markdown
    # The run learned: the adapters moved the held-out loss from the untrained model's.
    evals = _records(lora_reference, "eval")
    assert evals[-1]["step"] == MAX_STEPS and evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.05
