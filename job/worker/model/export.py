"""The checked Hugging Face export: write the trained model once, reload it in a fresh process, and accept it only
if it reproduces the final in-training held-out loss. Its layout is `common/exports.py`'s.

The weights come from the unsharded copy the final task evaluation also uses (one gather for both), in training's
compute dtype, so the reloaded model computes what the trained one did. The check runs in a new interpreter
(`python -m job accept`), so nothing of the training process (FSDP, hooks, in-memory weights) leaks into it; it
reads the held-out blocks from the export and checks that the tokenizer reloads with the same vocabulary. That
interpreter starts before training (`AcceptanceProcess`), so its imports are done long before the export is
written, and waits without touching the GPU; it checks the export while training's process runs the final task
evaluation.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ... import PACKAGE_DIR
from ... import config as config_lib
from ... import storage
from ...common.exports import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, EXPORT_DIR, HELDOUT, MERGED, VALID, earlier_exports,
                               keep_accepted)
from .. import data as data_lib
from ..data import vocabulary_sha256
from ..evaluation.generate import greedy_generate
from .causal_lm import CausalLMWithLoss, build_causal_lm
from .lora import add_adapters, merged_state_dict
from .nf4 import cast_unquantized

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class ExportError(RuntimeError):
    """The exported model failed its fresh-process acceptance check."""


class AcceptanceProcess:
    """The fresh interpreter of the acceptance check (`python -m job accept --wait`), started ahead of the export:
    it imports what it needs, then waits for `send` to give it the export directory."""

    def __init__(self):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [os.path.dirname(PACKAGE_DIR), os.environ.get("PYTHONPATH", "")])}
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen([sys.executable, "-m", "job", "accept", "--wait"], stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, stderr=self._stderr, env=env, text=True)

    def send(self, export_dir: str) -> None:
        """Hands the process the export directory to check (it writes `acceptance.json` there); returns at once."""
        try:
            self._proc.stdin.write(export_dir + "\n")
            self._proc.stdin.close()
        except BrokenPipeError:  # it died before reading its input: `wait` says how
            pass

    def wait(self) -> str:
        """Wait for the check; returns the exit status and the tail of stderr (the cause, without acceptance.json)."""
        self._proc.wait()
        self._stderr.seek(0)
        return f"acceptance process exited {self._proc.returncode}: {self._stderr.read()[-2000:]}"

    def close(self) -> None:
        """Ends the process if no check was asked of it (e.g. the final task evaluation failed)."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._stderr.close()


def start_acceptance() -> AcceptanceProcess | None:
    """The acceptance process, on rank 0 (the rank that writes and checks the export); None on the others."""
    return AcceptanceProcess() if dist.get_rank() == 0 else None


def start_export(lm: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, cfg: config_lib.RunConfig,
                 run_dir: str, reference: dict, heldout: data_lib.Blocks, batches: list[list[int]],
                 acceptance: AcceptanceProcess | None, adapters: dict[str, torch.Tensor] | None = None) -> dict | None:
    """Rank 0 writes the export of the unsharded `lm` (staged beside `<run>/export/`), hands it to `acceptance` and
    returns at once, so the check runs beside the final task evaluation. `reference`: the final in-training
    held-out loss and how it was measured, on the micro-batches `batches` of `heldout`. With LoRA, `adapters` are
    the export, `lm` (merged) written only with `model.lora.merged_export`. Returns what `finish_export` needs on
    rank 0, None elsewhere."""
    if dist.get_rank() != 0:
        return None
    if torch.cuda.is_available():
        # The acceptance process shares this GPU: hand back the allocator's cached blocks, or it may run out of
        # memory.
        torch.cuda.empty_cache()
    start = time.perf_counter()
    final = storage.join(run_dir, EXPORT_DIR)
    stage = tempfile.mkdtemp(prefix="export-") if storage.is_remote(run_dir) else f"{final}.partial"
    try:
        _write(lm, tokenizer, cfg, reference, heldout, batches, stage, adapters)
    except Exception as e:  # reported on every rank by `finish_export`, so no rank waits forever
        return {"final": final, "error": f"{type(e).__name__}: {e}"}
    acceptance.send(stage)
    return {"stage": stage, "final": final, "run_dir": run_dir, "step": reference["step"],
            "write_s": time.perf_counter() - start, "sent_at": time.perf_counter()}


def finish_export(pending: dict | None, acceptance: AcceptanceProcess | None) -> dict:
    """Wait for the check `start_export` began; rank 0 marks a passed export `_VALID` and moves it into place
    (collective). `ExportError` on every rank when the check failed."""
    result = None
    if dist.get_rank() == 0:
        try:
            result = {"ok": False, **pending} if "error" in pending else _collect(pending, acceptance)
        except Exception as e:
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        result.setdefault("export_dir", pending["final"])
    box = [result]
    dist.broadcast_object_list(box, src=0)
    result = box[0]
    if not result.get("ok"):
        raise ExportError(f"export {result['export_dir']} failed its acceptance check: "
                          f"{result.get('error') or json.dumps(result)}")
    return result


def _write(lm: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, cfg: config_lib.RunConfig,
           reference: dict, heldout: data_lib.Blocks, batches: list[list[int]], stage: str,
           adapters: dict[str, torch.Tensor] | None) -> None:
    """The export's files in directory `stage`: model (or LoRA adapter, and the merged model in `merged/` if
    asked), tokenizer, the held-out blocks and `reference.json`."""
    from safetensors.torch import save_file

    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(stage)
    if adapters is None:
        lm.save_pretrained(stage, safe_serialization=True)
    else:
        save_file(adapters, os.path.join(stage, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(stage, ADAPTER_CONFIG), "w") as f:
            json.dump(peft_adapter_config(cfg, sorted({key.split(".")[-3] for key in adapters})), f, indent=1)
        if cfg.model.lora.merged_export:
            lm.save_pretrained(os.path.join(stage, MERGED), state_dict=merged_state_dict(lm), safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(os.path.join(stage, MERGED))
    if tokenizer is not None:
        tokenizer.save_pretrained(stage)
    order = torch.tensor([i for batch in batches for i in batch], dtype=torch.long)
    blocks = heldout.select(order)
    save_file({"input_ids": blocks.input_ids, "labels": blocks.labels, "position_ids": blocks.position_ids},
              os.path.join(stage, HELDOUT))
    reference = {**reference, "tokenizer_vocabulary_sha256": vocabulary_sha256(tokenizer), "dtype": str(lm.dtype)}
    with open(os.path.join(stage, "reference.json"), "w") as f:
        json.dump({**reference, "batch_sizes": [len(b) for b in batches], "config": config_lib.to_dict(cfg)}, f, indent=1)


def peft_adapter_config(cfg: config_lib.RunConfig, target_modules: list[str]) -> dict:
    """PEFT's `adapter_config.json` of the run's adapters (what `peft.PeftModel.from_pretrained` and vLLM read):
    plain LoRA (no rsLoRA, DoRA or bias training), scaling `lora_alpha / r`."""
    lora = cfg.model.lora
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": cfg.model.path,
            "revision": cfg.model.revision, "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": target_modules, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "use_dora": False, "modules_to_save": None, "init_lora_weights": True, "inference_mode": True}


def merged_room_problem(run_dir: str, merged_bytes: int) -> str | None:
    """Why the merged export (`merged_bytes` of weights) would not fit where it is staged, or None."""
    where = tempfile.gettempdir() if storage.is_remote(run_dir) else storage.local_path(run_dir)
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    free = shutil.disk_usage(where).free
    if free >= merged_bytes * 1.05:  # and the config, tokenizer and adapter beside the weights
        return None
    return (f"model.lora.merged_export: the merged weights need {merged_bytes / 1e9:.2f} GB and {where} has "
            f"{free / 1e9:.2f} GB free; give the storage more room or set model.lora.merged_export: false")


def _collect(pending: dict, acceptance: AcceptanceProcess) -> dict:
    """The acceptance process's verdict on the staged export, with timings; publishes the export."""
    waited = time.perf_counter()
    outcome = acceptance.wait()
    stage, final = pending["stage"], pending["final"]
    try:
        with open(os.path.join(stage, "acceptance.json")) as f:
            result = json.load(f)
    except FileNotFoundError:
        result = {"ok": False, "error": outcome}
    result["export_dir"] = final
    now = time.perf_counter()
    result.setdefault("timings", {}).update(write_s=pending["write_s"], check_s=now - pending["sent_at"],
                                            waited_s=now - waited)
    with open(os.path.join(stage, "acceptance.json"), "w") as f:
        json.dump(result, f, indent=1)
    if result.get("ok"):
        with open(os.path.join(stage, VALID), "w") as f:
            f.write(json.dumps({"step": pending["step"], "eval_loss": result["eval_loss"], "time": time.time()}) + "\n")
    keep_accepted(pending["run_dir"], pending["step"])
    _publish(stage, final)
    result["earlier"] = earlier_exports(pending["run_dir"])
    return result


def _publish(stage: str, final: str) -> None:
    """Moves the staged export into place; the `_VALID` marker (if any) lands last."""
    if not storage.is_remote(final):
        shutil.rmtree(final, ignore_errors=True)
        os.replace(stage, final)
        return
    storage.remove(final)
    names = sorted((os.path.relpath(os.path.join(top, name), stage) for top, _, files in os.walk(stage) for name in files),
                   key=lambda n: n == VALID)
    for name in names:
        with open(os.path.join(stage, name), "rb") as f:
            storage.write_atomic(storage.join(final, *name.split(os.sep)), f.read())
    shutil.rmtree(stage, ignore_errors=True)


def prepare_acceptance() -> None:
    """`accept`'s imports (~20 s on a GPU machine), before it has an export. The device is initialized only once
    an export arrives, so the waiting process holds no GPU memory."""
    import safetensors.torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401


def accept(export_dir: str) -> dict:
    """The acceptance check, in a fresh process: reload the export, compute the held-out loss on the final
    evaluation's blocks, check the tokenizer, generate greedily. Writes `acceptance.json`: `ok` when the loss
    matches within `checkpoint.export_tolerance`; `timings`."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    clock = time.perf_counter()
    timings = {}

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = now - clock
        clock = now

    with open(os.path.join(export_dir, "reference.json")) as f:
        ref = json.load(f)
    cfg = config_lib.load_dict(ref["config"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result: dict = {"ok": False, "export_dir": export_dir, "reference_eval_loss": ref["eval_loss"],
                    "tolerance": cfg.checkpoint.export_tolerance, "device": str(device), "timings": timings}
    try:
        tokenizer = (AutoTokenizer.from_pretrained(export_dir)
                     if os.path.exists(os.path.join(export_dir, "tokenizer_config.json")) else None)
        if vocabulary_sha256(tokenizer) != ref["tokenizer_vocabulary_sha256"]:
            raise ExportError("the reloaded tokenizer's vocabulary or special tokens differ from the training tokenizer's")
        adapter = os.path.exists(os.path.join(export_dir, ADAPTER_CONFIG))
        lm = (base_with_adapter(export_dir, cfg, tokenizer, ref["dtype"], device) if adapter
              else _load_full(export_dir, device))
        result["dtype"] = str(lm.dtype)
        lap("load_s")
        blocks = load_file(os.path.join(export_dir, HELDOUT))
        # Eager, the loss included: compiling in this one-shot process took most of the pass's 10-13 s (1.5B).
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            loss, n_targets = _heldout_loss(lm, cfg, blocks, ref["batch_sizes"], device)
            lap("heldout_s")
            if adapter and cfg.model.lora.quantize_base:
                result["bf16_base"] = _served_on_16_bits(export_dir, cfg, tokenizer, ref, blocks, device,
                                                         sum(p.numel() for p in lm.parameters()), loss)
                lap("bf16_base_s")
            if adapter and os.path.exists(os.path.join(export_dir, MERGED)):
                merged = _load_full(os.path.join(export_dir, MERGED), device)
                result["merged_eval_loss"], _ = _heldout_loss(merged, cfg, blocks, ref["batch_sizes"], device)
                del merged
                lap("merged_s")
            if tokenizer is not None and cfg.eval.sample_prompt is not None:
                prompt = tokenizer(cfg.eval.sample_prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
            else:
                prompt = blocks["input_ids"][:1, :8]
            out = greedy_generate(lm, prompt.to(device), torch.ones_like(prompt).to(device), cfg.eval.sample_tokens,
                                  eos_token_id=None, pad_token_id=0).ids
            lap("generate_s")
        new = out[0, prompt.shape[1]:].tolist()
        diff = max(abs(x - ref["eval_loss"]) for x in (loss, result.get("merged_eval_loss", loss)))
        result.update({
            "eval_loss": loss,
            "eval_ppl": math.exp(min(loss, 50)),
            "abs_diff": diff,
            "target_tokens": n_targets,
            "generation": {"prompt_ids": prompt[0].tolist(), "token_ids": new,
                           "text": tokenizer.decode(new) if tokenizer is not None else None},
            "ok": bool(math.isfinite(loss) and diff <= cfg.checkpoint.export_tolerance and len(new) > 0),
        })
        if not result["ok"]:
            merged = f" (merged weights: {result['merged_eval_loss']:.6f})" if "merged_eval_loss" in result else ""
            result["error"] = (f"held-out loss of the reloaded export {loss:.6f}{merged} differs from the final "
                               f"in-training evaluation {ref['eval_loss']:.6f} by {diff:.3g} "
                               f"(> checkpoint.export_tolerance {cfg.checkpoint.export_tolerance})")
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(export_dir, "acceptance.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def _load_full(path: str, device: torch.device) -> PreTrainedModel:
    """A Hugging Face model directory, loaded in its saved dtype onto `device`."""
    from transformers import AutoModelForCausalLM

    # Straight onto the device where Transformers can (it needs accelerate for that, which the image may lack).
    on_device = {"device_map": str(device)} if importlib.util.find_spec("accelerate") else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype="auto", **on_device).to(device)


def base_with_adapter(export_dir: str, cfg: config_lib.RunConfig, tokenizer: PreTrainedTokenizerBase | None,
                      dtype: str, device: torch.device, quantized: bool = True) -> PreTrainedModel:
    """The run's base model (`model.path`, or the seeded random init again) with the export's adapter merged as
    PEFT computes it, `W + (lora_alpha / r)·B·A`, in `dtype`: what a PEFT loader gets, without PEFT (not in the
    image). QLoRA's base is quantized again as in training (bit for bit: the same weights, the same quantization)
    and the adapters computed beside its NF4 weights, as training did; `quantized` False merges them into its
    16-bit weights instead (how peft and vLLM serve a QLoRA adapter)."""
    from safetensors.torch import load_file

    with open(os.path.join(export_dir, ADAPTER_CONFIG)) as f:
        adapter = json.load(f)
    scaling = adapter["lora_alpha"] / adapter["r"]
    with torch.device(device):
        lm = build_causal_lm(cfg.model, len(tokenizer) if cfg.model.train_tokenizer_vocab else None, cfg.train.seed,
                             quantized)
    weights = load_file(os.path.join(export_dir, ADAPTER_WEIGHTS), device=str(device))
    prefix, suffix = "base_model.model.", ".lora_A.weight"
    if quantized and cfg.model.lora.quantize_base:  # QLoRA as trained: the adapters beside the NF4 weights
        add_adapters(lm, cfg.model.lora)
        lm.load_state_dict({key[len(prefix):]: value for key, value in weights.items()}, strict=False)
    else:
        with torch.no_grad():
            for key in (k for k in weights if k.endswith(suffix)):
                module = key[len(prefix):-len(suffix)]
                a, b = weights[key].float(), weights[f"{prefix}{module}.lora_B.weight"].float()
                lm.get_submodule(module).weight.add_(scaling * (b @ a))
    cast_unquantized(lm.parameters(), getattr(torch, dtype.removeprefix("torch.")))
    return lm.eval()


def _served_on_16_bits(export_dir: str, cfg: config_lib.RunConfig, tokenizer: PreTrainedTokenizerBase | None,
                       ref: dict, blocks: dict[str, torch.Tensor], device: torch.device, params: int,
                       quantized_loss: float) -> dict:
    """A QLoRA adapter as peft and vLLM serve it, on the base in 16 bits: its held-out loss and the difference from
    the quantized base's (informative, not held to the tolerance: what serving without the quantization changes),
    or why it was not measured (no room on the device for the `params` base in fp32 beside training's process)."""
    if device.type == "cuda" and torch.cuda.mem_get_info(device)[0] < 4.4 * params:
        return {"skipped": f"needs {4 * params / 2**30:.1f} GiB of the device for the base in fp32"}
    lm = base_with_adapter(export_dir, cfg, tokenizer, ref["dtype"], device, quantized=False)
    loss, _ = _heldout_loss(lm, cfg, blocks, ref["batch_sizes"], device)
    del lm
    return {"eval_loss": loss, "minus_quantized": loss - quantized_loss}


def _heldout_loss(lm: PreTrainedModel, cfg: config_lib.RunConfig, blocks: dict[str, torch.Tensor],
                  batch_sizes: list[int], device: torch.device) -> tuple[float, int]:
    """`lm`'s mean loss on the held-out blocks in the final evaluation's micro-batches, and their target count."""
    model = CausalLMWithLoss(lm, cfg.train.loss_chunk_size).eval()  # as lean on memory as the training eval
    totals = torch.zeros(2, dtype=torch.float64)
    start = 0
    for size in batch_sizes:
        batch = {k: v[start : start + size].to(device) for k, v in blocks.items()}
        start += size
        loss_sum, n = model(**batch)
        totals += torch.stack([loss_sum.double().cpu(), n.double().cpu()])
    return (totals[0] / totals[1]).item(), int(totals[1].item())
