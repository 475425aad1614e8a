#!/usr/bin/env python3
"""Comparison baseline: Hugging Face `transformers.Trainer` (+ accelerate FSDP2) throughput.

Trains a randomly initialised Qwen2 causal LM (nothing is downloaded) on synthetic random
tokens for --steps steps and prints ONE JSON line (rank 0) with tokens/s per device, the
median step time after --warmup steps, and peak GPU memory.

GPU (bf16 autocast, SDPA attention, FSDP2 full-shard of Qwen2DecoderLayer, fused AdamW):
    torchrun --nproc-per-node N bench/hf_trainer_baseline.py --preset qwen2.5-1.5b \
        --seq-len 4096 --batch 4 --steps 15 --warmup 5
  (N=1 also goes through FSDP2, so the code path matches N>1; --fsdp off for plain 1-GPU.)
  --grad-accum K: K micro-batches per optimizer step; a step's tokens are batch × K × seq-len.
  --liger: `TrainingArguments(use_liger_kernel=True)`, the Trainer with Liger's Triton kernels (RMSNorm, SwiGLU,
  RoPE, fused linear cross-entropy; needs the liger-kernel package and a CUDA device).
  --lora-rank R: LoRA with `peft` (rank R, alpha 2R, the job's default targets), as its users set it up: the base
  loaded in bf16 and frozen, the adapters in fp32 (peft's autocast_adapter_dtype), bf16 autocast; MFU counts the
  frozen base as the job does (4 FLOPs per frozen parameter and token). Use with --fsdp off on one GPU.
  --load-in-4bit (with --lora-rank): QLoRA as peft's users run it, the frozen linear layers in bitsandbytes' 4-bit
  NF4 with double-quantized scales and bf16 compute (what `from_pretrained(quantization_config=BitsAndBytesConfig(
  load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=bf16))`
  builds, here from the random init), then peft's `prepare_model_for_kbit_training`; add --grad-ckpt as its recipe
  does. Needs the bitsandbytes package (carried slimmed: bench/device-wheels.sh).
  --overrides JSON: the model's dimensions over the preset's, e.g. Qwen2.5-7B's (bench/benchmark.py QWEN_7B).
CPU (CI): python bench/hf_trainer_baseline.py --preset qwen2-tiny --seq-len 32 --batch 2 --steps 3 --warmup 1
  (fp32, one process, no FSDP.)

Timing: a TrainerCallback synchronizes CUDA at every step end; step time is the interval
between consecutive step ends (everything the Trainer does per step: data, forward, loss,
backward, grad clipping, optimizer, callbacks). `compute_step_time_s` is step begin -> end.
Requires accelerate (the Trainer needs it); it is in the device image.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# The same architectures as the job's (`model.preset`), so both sides of the benchmark train the same model.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.benchmark import peer_parser  # noqa: E402
from job.common.presets import PRESETS  # noqa: E402
from job.worker.metrics import (
    flops_per_token,
    peak_flops,  # noqa: E402
)


class RandomTokens(torch.utils.data.Dataset):
    """`length` sequences of `seq_len` uniform random token ids (labels = input_ids; the model shifts)."""

    def __init__(self, length: int, seq_len: int, vocab: int, seed: int = 0):
        self.length, self.seq_len, self.vocab, self.seed = length, seq_len, vocab, seed

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        ids = torch.randint(0, self.vocab, (self.seq_len,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_timer_callback():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.begin, self.ends, self.compute = None, [], []

        def on_step_begin(self, args, state, control, **kw):
            _sync()
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            _sync()
            t = time.perf_counter()
            self.ends.append(t)
            if self.begin is not None:
                self.compute.append(t - self.begin)

    return StepTimer()


def load_in_4bit(model: torch.nn.Module, compute_dtype: torch.dtype) -> None:
    """Swap every linear layer but the head for bitsandbytes' `Linear4bit` (NF4, double-quantized scales), in
    place, quantizing its weight on the model's device: what Transformers' bitsandbytes integration builds."""
    import bitsandbytes as bnb

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and name != "lm_head":
                layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4",
                                          device="meta")
                layer.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=True,
                                                 quant_type="nf4").to(child.weight.device)
                layer.bias = child.bias
                setattr(module, name, layer)
    model.is_loaded_in_4bit = True  # what peft's prepare_model_for_kbit_training looks for


def parse_args(argv=None):
    p = peer_parser(__doc__, steps=15, warmup=5, warmup_help="steps left out of the median")
    p.add_argument("--fsdp", choices=["auto", "on", "off"], default="auto",
                   help="auto: FSDP2 when on CUDA and launched by torchrun")
    p.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing of each decoder layer")
    p.add_argument("--sdpa-backend", choices=["default", "cudnn"], default="default",
                   help="cudnn: force SDPA's cuDNN attention, as our job's model.sdpa_backend does (a fairness "
                        "check of the comparison; the reference baseline keeps PyTorch's default choice)")
    p.add_argument("--liger", action="store_true",
                   help="TrainingArguments(use_liger_kernel=True): Liger's fused RMSNorm, SwiGLU, RoPE and linear "
                        "cross-entropy (the fp32 logits are never materialised); Triton kernels, so CUDA only")
    p.add_argument("--lora-rank", type=int, help="LoRA with peft at this rank (alpha twice the rank)")
    p.add_argument("--load-in-4bit", action="store_true", help="QLoRA: the frozen linear layers in bitsandbytes' NF4")
    p.add_argument("--overrides", type=json.loads, default={}, help="model dimensions over the preset's (JSON)")
    a = p.parse_args(argv)
    if a.lora_rank is not None and importlib.util.find_spec("peft") is None:
        p.error("--lora-rank needs the peft package (carry its wheel to the GPU machines)")
    if a.load_in_4bit and (a.lora_rank is None or importlib.util.find_spec("bitsandbytes") is None):
        p.error("--load-in-4bit needs --lora-rank and the bitsandbytes package (bench/device-wheels.sh carries it)")
    if a.steps <= a.warmup + 1:
        p.error("--steps must exceed --warmup + 1 (need at least two timed step ends)")
    if a.sdpa_backend == "cudnn" and not torch.cuda.is_available():
        p.error("--sdpa-backend cudnn needs a CUDA device")
    if a.liger and not torch.cuda.is_available():
        p.error("--liger needs a CUDA device (Liger's kernels are Triton GPU kernels)")
    if a.liger and importlib.util.find_spec("liger_kernel") is None:
        p.error("--liger needs the liger-kernel package (bench/device-wheels.sh carries it to the GPU machines)")
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    import transformers
    from transformers import AutoModelForCausalLM, Qwen2Config, Trainer, TrainingArguments

    cuda = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_fsdp = a.fsdp == "on" or (a.fsdp == "auto" and cuda and "WORLD_SIZE" in os.environ)

    torch.manual_seed(a.seed)
    cfg = Qwen2Config(**{**PRESETS[a.preset], **a.overrides}, use_cache=False)
    # Build directly on this process's GPU (random init of 1.5B params on CPU is slow);
    # fp32 master weights, bf16 compute via the Trainer's autocast / FSDP2 mixed precision.
    base_dtype = torch.bfloat16 if cuda and a.lora_rank else torch.float32  # a frozen base needs no fp32 master
    with torch.device(f"cuda:{local_rank}" if cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=base_dtype)
    n_base = sum(p.numel() for p in model.parameters())  # counted before 4-bit packing halves the numel
    if a.load_in_4bit:
        from peft import prepare_model_for_kbit_training

        load_in_4bit(model, torch.bfloat16 if cuda else torch.float32)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=a.grad_ckpt)
    if a.lora_rank:
        from peft import LoraConfig, get_peft_model

        from job.config import LORA_DEFAULT_TARGETS

        model = get_peft_model(model, LoraConfig(r=a.lora_rank, lora_alpha=2 * a.lora_rank, lora_dropout=0.0,
                                                 target_modules=LORA_DEFAULT_TARGETS, task_type="CAUSAL_LM"))
    n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_params = n_base + (n_trained if a.lora_rank else 0)
    n_frozen = n_params - n_trained

    fsdp_kw = {}
    if use_fsdp:
        fsdp_kw = dict(
            # transformers 5.x: fsdp=True + fsdp_config (the string form "full_shard" is
            # deprecated; reshard_after_forward=True is FSDP2's full shard).
            fsdp=True,
            fsdp_config={
                "version": 2,
                "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"],
                "reshard_after_forward": True,
                "activation_checkpointing": a.grad_ckpt,
            },
        )
    if a.grad_ckpt and not use_fsdp and not a.load_in_4bit:  # prepare_model_for_kbit_training enabled it
        fsdp_kw["gradient_checkpointing"] = True  # only passed when used (renamed in newer 5.x)
    out_dir = tempfile.mkdtemp(prefix="hf_baseline_")
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=a.grad_accum,
        max_steps=a.steps,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        optim="adamw_torch_fused" if cuda else "adamw_torch",
        bf16=cuda,
        use_cpu=not cuda,
        logging_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        ddp_find_unused_parameters=False,
        seed=a.seed,
        use_liger_kernel=a.liger,
        **fsdp_kw,
    )
    data = RandomTokens(a.steps * a.batch * a.grad_accum * world, a.seq_len, cfg.vocab_size, seed=a.seed)
    timer = make_timer_callback()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[timer])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    attention = (sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if a.sdpa_backend == "cudnn" else contextlib.nullcontext())
    t0 = time.perf_counter()
    with attention:
        out = trainer.train()
    wall = time.perf_counter() - t0

    # What the Trainer actually did (accelerate falls back to DDP on CPU even with --fsdp on).
    fsdp_version = None
    if getattr(trainer, "is_fsdp_enabled", False):
        fsdp_version = getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1)
    intervals = [b - e for e, b in zip(timer.ends, timer.ends[1:])][a.warmup:]
    step = statistics.median(intervals)
    tokens = a.batch * a.grad_accum * a.seq_len
    # MFU by the job's own formula and peak table, so the benchmark's columns compare like with like.
    peak = peak_flops(torch.device("cuda", local_rank), None) if cuda else None
    flops = flops_per_token(n_params, cfg.num_hidden_layers, cfg.hidden_size, a.seq_len, frozen=n_frozen)
    res = {
        "impl": "hf_trainer" + (f"_fsdp{fsdp_version}" if fsdp_version else ""),
        "wrapped": type(trainer.model_wrapped).__name__,
        "preset": a.preset,
        "params": n_params,
        "trainable_params": n_params - n_frozen,
        "lora_rank": a.lora_rank,
        "load_in_4bit": (f"bitsandbytes {importlib.metadata.version('bitsandbytes')}" if a.load_in_4bit else None),
        "world_size": world,
        "seq_len": a.seq_len,
        "batch_per_device": a.batch,
        "grad_accum": a.grad_accum,
        "steps": len(timer.ends),
        "warmup": a.warmup,
        "grad_ckpt": a.grad_ckpt,
        "sdpa_backend": a.sdpa_backend,
        "liger": importlib.metadata.version("liger-kernel") if a.liger else None,
        "dtype": "bf16-autocast" if cuda else "fp32",
        "step_time_s": round(step, 5),
        "compute_step_time_s": round(statistics.median(timer.compute[a.warmup + 1:]), 5),
        "tokens_per_s_per_device": round(tokens / step, 1),
        "tokens_per_s_total": round(tokens * world / step, 1),
        "mfu": round(tokens / step * flops / peak, 4) if peak else None,
        "final_loss": round(float(out.training_loss), 4),
        "peak_mem_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "peak_mem_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
        "train_wall_s": round(wall, 2),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if rank == 0:
        print(json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main()
    # The result is out: leave without interpreter teardown. The Trainer's last all_gather (`store_flos`) can
    # leave a gloo worker thread freeing a Python-owned tensor, which needs the GIL while the main thread holds
    # it to destroy the process group: a deadlock or "terminate called without an active exception" on CPU
    # (pytorch/pytorch#190489), intermittently failing the CPU smoke of the benchmark.
    sys.stdout.flush()
    os._exit(0)
