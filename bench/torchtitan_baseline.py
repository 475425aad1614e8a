#!/usr/bin/env python3
"""Comparison baseline: torchtitan 0.2.2's own Trainer and training loop, the same model shape as ours.

Trains a randomly initialised torchtitan `qwen3` model of our preset's shape (nothing is downloaded) on uniform
random tokens for --steps steps and prints ONE JSON line (rank 0) with tokens/s per device, MFU, the median
step time after --warmup steps and peak GPU memory: the contract of bench/hf_trainer_baseline.py, so that
bench/benchmark.py reads both alike (launcher "titan").

GPU (needs torchtitan==0.2.2, torchdata, tyro: `bash bench/device-wheels.sh titan`; docs/device.md, "torchtitan"):
    torchrun --nproc-per-node N bench/torchtitan_baseline.py --batch 4 --seq-len 4096 --steps 14 --warmup 4
Checks without a GPU (torchtitan installed):
    python bench/torchtitan_baseline.py --meta         # its config parses; the model on the meta device, counted
    python bench/torchtitan_baseline.py --cpu --preset qwen2-tiny --seq-len 64 --batch 2 --steps 4 --warmup 1 \
        --no-compile                                      # the whole loop on CPU (gloo); smoke test only, see below

The model. torchtitan has no Qwen2 (its `qwen3` is the same decoder without the q/k/v biases and with an optional
q/k RMSNorm); we build its `Qwen3Model` with the preset's dimensions (Qwen2.5-1.5B: 28 layers, hidden 1536, SwiGLU
8960, 12 query / 2 key-value heads of 128, vocab 151936, tied embeddings, RoPE theta 1e6, RMSNorm eps 1e-6) and
qk_norm off, as in Qwen2.5: 1,543,656,960 parameters, the 28 × 2,048 q/k/v biases (57,344) fewer than our Qwen2's
1,543,714,304 (a tied head counted once; `--meta` prints both), so the FLOPs per token (11.376e9 at T=4096) differ by
0.003 %: the same model to measure.

What it takes (torchtitan's data path wants a Hugging Face dataset and tokenizer files): the script registers a
TrainSpec of its own, `qwen3_random` (torchtitan's public `register_train_spec`), that is torchtitan's `qwen3`
spec with three builders replaced: a dataloader of random tokens (torchtitan's own `ParallelAwareDataloader`, a
torchdata StatefulDataLoader, over an IterableDataset yielding ({"input": x[:-1]}, x[1:])), no tokenizer (only
flex/varlen attention masks and HF datasets use it), no validator; and torchtitan's own metrics processor with one
logger put in front of the one it builds, which records what torchtitan logs at each step and passes it on. Nothing
of torchtitan is patched for a GPU run; the config is torchtitan's JobConfig, parsed by its ConfigManager from the
command line a user would write (`titan_argv`). On more than one GPU torchtitan shards the tied embedding and head
in two FSDP groups (two `fully_shard` calls): torch 2.13 refuses that ("shared with a parameter already managed by
another FSDP group"); torch 2.11, the device's, predates that check and may run with the two sharded apart, untied,
so the JSON line says whether the trained model's head is still its embedding (`tied`), and `params` (MFU) counts
the model as built, `params_trained` what the optimizer holds. Untested here (one process on CPU only, below).

Its settings, as a user configures it for speed: torchtitan's defaults (fp32 master weights; FSDP2 with bf16
params and fp32 reduce when there is more than one GPU, else `torch.autocast` bf16, torchtitan's single-device
path: it applies FSDP only for a data-parallel shard degree > 1; fused AdamW, `optimizer.implementation=fused`;
grad-norm clipping at 1.0; its SDPA wrapper, which prefers cuDNN attention, then Flash, with enable_gqa; plain
cross-entropy on the full fp32-upcast logits), `torch.compile` of each TransformerBlock and of the loss
(`compile.enable`, components model and loss, on by default here; --no-compile), no activation checkpointing
(`activation_checkpoint.mode=none`; torchtitan's default is selective), lr 1e-5 with a 1-step warm-up.

Timing: torchtitan's own per-step metrics (`metrics.log_freq=1`): each step ends with the loss's `.item()`, so
`time_metrics/end_to_end(s)` is the wall time of one whole step (data, forward, loss, backward, clipping,
optimizer, logging), as the HF baseline's synchronized step ends. `step_time_s` is the median over steps
warmup+2 .. steps (the HF baseline's intervals: the first step also holds the build and compilation);
`tokens_per_s_per_device = batch × grad_accum × seq_len / step_time_s`; `mfu` by job.worker.metrics' formula and peak
table (6·N + 12·L·H·T with the tied head counted once), like the HF baseline; torchtitan's own figures are beside
them (`titan_tps`, `titan_mfu`: its FLOPs leave the tied head's matmul out, so its MFU reads lower). Peak memory:
torchtitan resets CUDA's peak statistics at each log, so the peak is the largest of the per-step peaks, read just
before each reset.

--cpu (a smoke test of this script, not a benchmark): torchtitan 0.2.2 has no CPU path (with no accelerator it
takes "cuda" as its device type), so --cpu makes torch report "cpu" as the available device type before torchtitan
is imported, replaces its device-memory monitor with one that reports zeros and skips the shortening of the process
groups' timeouts after step 1 (a barrier with device_ids=["cpu"], which gloo refuses); gloo, fp32 (autocast to bf16 on
CPU is not what a GPU run does, so --cpu sets training.mixed_precision_param=float32); one process only (its FSDP
reduce-scatters with ReduceOp.PREMUL_SUM, which gloo lacks).
"""

from __future__ import annotations

import argparse
import dataclasses
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.benchmark import peer_parser  # noqa: E402
from job.common.presets import PRESETS  # noqa: E402
from job.worker.metrics import (
    flops_per_token,
    peak_flops,  # noqa: E402
)

TORCHTITAN_VERSION = "0.2.2"  # the version this script is written against (its Trainer's internals differ by version)
SPEC = "qwen3_random"


def parse_args(argv=None):
    p = peer_parser(__doc__, steps=14, warmup=4, warmup_help="steps left out of the median (after the first)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="torchtitan's compile.enable: torch.compile of each TransformerBlock and of the loss")
    p.add_argument("--overrides", type=json.loads, default={},
                   help="JSON object of dimensions over the preset's (e.g. Qwen2.5-7B's, as benchmark.py's QWEN_7B)")
    p.add_argument("--ac", choices=["none", "selective", "full"], default="none",
                   help="torchtitan's activation_checkpoint.mode")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--meta", action="store_true",
                      help="no training: parse the config, build the model on the meta device, print its counts")
    mode.add_argument("--cpu", action="store_true", help="smoke test on CPU (gloo, fp32); not a benchmark")
    a = p.parse_args(argv)
    if a.steps <= a.warmup + 1:
        p.error("--steps must exceed --warmup + 1 (the first step holds the build and compilation)")
    if a.cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        p.error("--cpu runs one process: torchtitan's FSDP reduce-scatters with PREMUL_SUM, which gloo does not have")
    if not (a.meta or a.cpu) and not torch.cuda.is_available():
        p.error("needs a CUDA device (torchtitan 0.2.2 trains on an accelerator; --meta or --cpu check the script)")
    if importlib.util.find_spec("torchtitan") is None:
        p.error(f"needs torchtitan=={TORCHTITAN_VERSION} (with torchdata and tyro): "
                "`bash bench/device-wheels.sh titan` carries them to the GPU machines; docs/device.md")
    have = importlib.metadata.version("torchtitan")
    if have != TORCHTITAN_VERSION:
        print(f"torchtitan_baseline: written for torchtitan {TORCHTITAN_VERSION}, found {have}", file=sys.stderr)
    return a


def dims(args) -> dict:
    """The model's dimensions: the preset's, with `--overrides` over them."""
    return {**PRESETS[args.preset], **args.overrides}


def model_args(c: dict, seq_len: int):
    """torchtitan's Qwen3ModelArgs with dimensions `c` (`dims`; a Qwen2 without the q/k/v biases)."""
    from torchtitan.models.qwen3 import Qwen3ModelArgs

    return Qwen3ModelArgs(
        dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"],
        n_kv_heads=c["num_key_value_heads"], head_dim=c["hidden_size"] // c["num_attention_heads"],
        hidden_dim=c["intermediate_size"], vocab_size=c["vocab_size"], norm_eps=c["rms_norm_eps"],
        rope_theta=c["rope_parameters"]["rope_theta"], max_seq_len=seq_len, qk_norm=False,
        enable_weight_tying=c["tie_word_embeddings"], attn_type="sdpa",
    )


def qwen2_params(c: dict) -> int:
    """Parameters of our Qwen2 model of dimensions `c`, built on the meta device as the HF baseline builds it (a tied head
    counted once)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**c))
    return sum(p.numel() for p in model.parameters())


class StepRecorder:
    """A torchtitan metric logger (its `BaseLogger` protocol) in front of the one torchtitan built: keeps each
    step's metrics, with CUDA's peak memory read before torchtitan's monitor resets it (right after its loggers)."""

    def __init__(self):
        self.steps: list[tuple[int, dict]] = []
        self.inner = None  # the logger torchtitan built (tensorboard/wandb when enabled; else one that does nothing)

    def log(self, metrics: dict, step: int) -> None:
        self.inner.log(metrics, step)
        cuda = torch.cuda.is_available()
        mem = {"alloc": torch.cuda.max_memory_allocated() if cuda else 0,
               "reserved": torch.cuda.max_memory_reserved() if cuda else 0}
        self.steps.append((step, {**metrics, "_peak": mem}))

    def close(self) -> None:
        self.inner.close()


def register_spec(args, recorder: StepRecorder) -> None:
    """`qwen3_random`: torchtitan's qwen3 TrainSpec with random-token data, no tokenizer and no validator, our
    preset as its one flavour, and torchtitan's metrics processor with `recorder` added."""
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.metrics import build_metrics_processor
    from torchtitan.models import qwen3
    from torchtitan.protocols.train_spec import register_train_spec

    class RandomTokens(IterableDataset):
        """Endless rows of seq_len + 1 uniform random ids: ({"input": x[:-1]}, x[1:]), as torchtitan's text
        datasets yield them; each data-parallel rank its own stream."""

        def __init__(self, seq_len: int, vocab: int, seed: int):
            self.seq_len, self.vocab, self.seed = seq_len, vocab, seed

        def __iter__(self):
            g = torch.Generator().manual_seed(self.seed)
            while True:
                x = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=g)
                yield {"input": x[:-1]}, x[1:]

    def build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, **kwargs):
        data = RandomTokens(job_config.training.seq_len, dims(args)["vocab_size"],
                            args.seed * 1_000_003 + dp_rank)
        return ParallelAwareDataloader(data, dp_rank=dp_rank, dp_world_size=dp_world_size,
                                       batch_size=job_config.training.local_batch_size)

    def build_metrics(*a, **kw):
        processor = build_metrics_processor(*a, **kw)
        recorder.inner, processor.logger = processor.logger, recorder  # on every rank (rank 0's logs, others' not)
        return processor

    spec = dataclasses.replace(
        qwen3.get_train_spec(), model_args={args.preset: model_args(dims(args), args.seq_len)},
        build_dataloader_fn=build_dataloader, build_tokenizer_fn=None, build_validator_fn=None,
        build_metrics_processor_fn=build_metrics)
    register_train_spec(SPEC, spec)


def titan_argv(args, dump_folder: str, world: int) -> list[str]:
    """torchtitan's command line for this run (its ConfigManager parses it, as `torchtitan/train.py` does)."""
    argv = [
        f"--job.dump_folder={dump_folder}", "--job.description=torchtitan_baseline",
        f"--model.name={SPEC}", f"--model.flavor={args.preset}",
        f"--training.local_batch_size={args.batch}", f"--training.seq_len={args.seq_len}",
        f"--training.global_batch_size={args.batch * args.grad_accum * world}", f"--training.steps={args.steps}",
        f"--optimizer.lr={args.lr}", "--optimizer.implementation=fused", "--lr_scheduler.warmup_steps=1",
        f"--activation_checkpoint.mode={args.ac}", "--metrics.log_freq=1", "--metrics.disable_color_printing",
        f"--debug.seed={args.seed}",
    ]
    if args.compile:
        argv.append("--compile.enable")
    if args.cpu:
        argv.append("--training.mixed_precision_param=float32")
    return argv


def allow_cpu() -> None:
    """--cpu only: make torchtitan (which falls back to "cuda" with no accelerator) see "cpu" as the device type,
    give it a device-memory monitor that reports zeros, skip its timeout change. Before torchtitan is imported."""
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    from torchtitan.components import metrics

    class CpuMemoryMonitor:
        device_name, device_capacity_gib = "cpu", 0.0

        def get_peak_stats(self):
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self):
            pass

    metrics.build_device_memory_monitor = CpuMemoryMonitor
    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_pg_timeouts = lambda **kw: None  # after step 1: a barrier with device_ids=["cpu"]: gloo refuses


def meta_check(args) -> dict:
    """The config torchtitan would run with, and the model built on the meta device: its parameter count (and
    torchtitan's own count and FLOPs per token) against our Qwen2 preset's."""
    from torchtitan.config import ConfigManager
    from torchtitan.models.qwen3 import Qwen3Model

    register_spec(args, StepRecorder())
    config = ConfigManager().parse_args(titan_argv(args, tempfile.mkdtemp(prefix="titan_baseline_"), 1))
    margs = model_args(dims(args), args.seq_len)
    with torch.device("meta"):
        model = Qwen3Model(margs)
    n = sum(p.numel() for p in model.parameters())  # a tied weight once
    titan_n, titan_flops = margs.get_nparams_and_flops(model, args.seq_len)
    c = dims(args)
    ours = qwen2_params(c)
    return {
        "check": "meta", "preset": args.preset, "params": n, "qwen2_params": ours,
        "params_rel_diff": round((n - ours) / ours, 6),
        "flops_per_token": flops_per_token(n, c["num_hidden_layers"], c["hidden_size"], args.seq_len),
        "qwen2_flops_per_token": flops_per_token(ours, c["num_hidden_layers"], c["hidden_size"], args.seq_len),
        "titan_params": titan_n, "titan_flops_per_token": titan_flops,
        "tied": model.output.weight is model.tok_embeddings.weight,
        "config": {"compile": dataclasses.asdict(config.compile), "ac": config.activation_checkpoint.mode,
                   "optimizer": config.optimizer.implementation, "dtype": config.training.dtype,
                   "param_dtype": config.training.mixed_precision_param,
                   "reduce_dtype": config.training.mixed_precision_reduce},
        "torchtitan": importlib.metadata.version("torchtitan"), "torch": torch.__version__,
    }


def main(argv=None) -> dict:
    a = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    if a.meta:
        res = meta_check(a)
        print(json.dumps(res), flush=True)
        return res
    if "LOCAL_RANK" not in os.environ:  # a plain `python` run: one process, as torchrun would set it up
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    world = int(os.environ["WORLD_SIZE"])
    if a.cpu:
        allow_cpu()
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    init_logger()
    recorder = StepRecorder()
    register_spec(a, recorder)
    config = ConfigManager().parse_args(titan_argv(a, tempfile.mkdtemp(prefix="titan_baseline_"), world))
    t0 = time.perf_counter()
    trainer = Trainer(config)
    build = time.perf_counter() - t0
    trainer.train()
    wall = time.perf_counter() - t0

    model = trainer.model_parts[0]
    with torch.device("meta"):  # the model as built, before torchtitan parallelizes it: a tied weight once
        n_params = sum(p.numel() for p in type(model)(model_args(dims(a), a.seq_len)).parameters())
    trained = sum(p.numel() for p in model.parameters())  # global sizes (DTensor numel)
    steps = [m for _, m in recorder.steps]
    timed = steps[a.warmup + 1:]
    step = statistics.median(m["time_metrics/end_to_end(s)"] for m in timed)
    tokens = a.batch * a.grad_accum * a.seq_len
    c = dims(a)
    cuda = torch.cuda.is_available()
    peak = peak_flops(torch.device("cuda", int(os.environ["LOCAL_RANK"])), None) if cuda else None
    flops = flops_per_token(n_params, c["num_hidden_layers"], c["hidden_size"], a.seq_len)
    fsdp = trainer.parallel_dims.fsdp_enabled
    res = {
        "impl": "torchtitan" + ("_fsdp2" if fsdp else "_single_device"),
        "wrapped": type(model).__name__,
        "preset": a.preset,
        "model": "qwen3 (qk_norm off, no qkv bias)",
        "params": n_params,
        "params_trained": trained,
        "tied": model.output.weight is model.tok_embeddings.weight,
        "world_size": world,
        "seq_len": a.seq_len,
        "batch_per_device": a.batch,
        "grad_accum": trainer.gradient_accumulation_steps,
        "steps": len(steps),
        "warmup": a.warmup,
        "compile": a.compile,
        "grad_ckpt": a.ac != "none",
        "dtype": ("fsdp2 bf16 params, fp32 reduce" if fsdp else "bf16-autocast") if cuda else "fp32",
        "step_time_s": round(step, 5),
        "tokens_per_s_per_device": round(tokens / step, 1),
        "tokens_per_s_total": round(tokens * world / step, 1),
        "mfu": round(tokens / step * flops / peak, 4) if peak else None,
        "titan_tps": round(statistics.median(m["throughput(tps)"] for m in timed), 1),
        "titan_mfu": round(statistics.median(m["mfu(%)"] for m in timed) / 100, 4) if cuda else None,
        "final_loss": round(float(steps[-1]["loss_metrics/global_avg_loss"]), 4),
        "peak_mem_alloc_gib": round(max(m["_peak"]["alloc"] for m in steps) / 2**30, 2) if cuda else None,
        "peak_mem_reserved_gib": round(max(m["_peak"]["reserved"] for m in steps) / 2**30, 2) if cuda else None,
        "build_s": round(build, 2),
        "train_wall_s": round(wall, 2),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "torchtitan": importlib.metadata.version("torchtitan"),
    }
    if rank == 0:
        print(json.dumps(res), flush=True)
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return res


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # as the HF baseline: the result is out, no interpreter teardown (gloo threads at exit)
