#!/usr/bin/env python3
"""DPO throughput: our `train.objective: dpo` against TRL's `DPOTrainer` (with peft for LoRA, with Liger's kernels),
the same model, pairs, lengths, batch and device; one table.

    # GPU (Qwen2.5-1.5B's shape, random init; pairs of a 128-token prompt and two 383-token answers, 1,024 tokens
    # a pair with the EOS; 8 pairs a step):
    python bench/dpo_peer.py --batch 8 --steps 14 --warmup 4
    # CPU smoke (tiny model; TRL rows need trl installed, else they report its absence):
    python bench/dpo_peer.py --cpu --preset qwen2-tiny --prompt 8 --completion 23 --batch 2 --steps 4 --warmup 1

Pairs: random words, each one token of a tokenizer trained on them (saved beside the pairs), so both sides read the
same text and tokenize it to the same lengths, one pair per row on our side (`data.packing: false`, `seq_len` the
pair's length). Every variant is its own process (a fresh GPU). Ours: the job under torchrun, its best settings
(compiled layers, chunked loss, cuDNN attention, parameters kept gathered), the step time read from metrics.jsonl
(median after `--warmup` steps), the reference log-probabilities computed before the first step (`ref s`). TRL
(`--peer`, run in a child): DPOConfig as its users set it for a fair speed comparison: bf16 autocast over fp32 master
weights, fused AdamW, no gradient checkpointing (its default is on), a constant learning rate, β 0.1; the full
fine-tune's reference is a bf16 copy of the model (TRL's per-step reference forward), `trl-full-pre` computes its
reference log-probabilities before training instead (`precompute_ref_log_probs`, timed as `ref s`); LoRA through
peft (rank 16, alpha 32, our targets; the reference is the base with the adapters off). Columns: pairs/s and tokens/s
of the steps, tokens/s over the whole pass (steps plus the reference pass: one epoch of the bench's pairs), peak
memory, and both tokens/s ratios to TRL's plain row of the same method.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.benchmark import last_step_logged, stop  # noqa: E402

LORA = {"rank": 16, "alpha": 32}
VARIANTS = {  # name: (side, method, options)
    "ours-full": ("ours", "full", {}),
    "trl-full": ("trl", "full", {}),
    "trl-full-pre": ("trl", "full", {"precompute": True}),
    "trl-full-liger": ("trl", "full", {"liger": True}),
    "ours-lora": ("ours", "lora", {}),
    "trl-lora": ("trl", "lora", {}),
    "trl-lora-liger": ("trl", "lora", {"liger": True}),
}


def make_pairs(folder: Path, args) -> dict:
    """`pairs.jsonl` and the tokenizer (`tokenizer/`) in `folder`; returns the pairs' token count each."""
    from job.common.sources import train_bpe_tokenizer

    rng = random.Random(0)
    words = sorted({"".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5)) for _ in range(400)})
    tok = train_bpe_tokenizer([" ".join(rng.sample(words, len(words))) for _ in range(50)], 2000)
    tok.save_pretrained(folder / "tokenizer")
    text = lambda n: "".join(" " + rng.choice(words) for _ in range(n))  # noqa: E731
    rows = [{"prompt": text(args.prompt), "chosen": text(args.completion), "rejected": text(args.completion)}
            for _ in range(args.batch * args.steps)]
    (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lengths = [sum(len(tok(r[k], add_special_tokens=False)["input_ids"]) for k in ("prompt", "chosen", "prompt", "rejected"))
               + 2 for r in rows]  # each completion ends with EOS
    return {"tokens_per_pair": statistics.mean(lengths), "longest_pair": max(lengths)}


def run_ours(args, name: str, method: str, folder: Path, shape: dict) -> dict:
    gpu = {} if args.cpu else {"parallel": {"compile": True, "reshard_after_forward": False}}
    run = {
        "name": name, "storage_path": str(folder / "runs"),
        "model": {"preset": args.preset, "init": "random", "tokenizer": str(folder / "tokenizer"),
                  **({"lora": LORA} if method == "lora" else {}), **({} if args.cpu else {"sdpa_backend": "cudnn"})},
        "data": {"format": "preference", "train": str(folder / "pairs.jsonl"), "validation_fraction": 0,
                 "packing": False},
        "train": {"objective": "dpo", "max_steps": args.steps, "micro_batch_size": args.batch,
                  "seq_len": shape["longest_pair"], "lr": 1e-6, "warmup_steps": 1, "loss_chunk_size": 4096},
        "scaling": {"num_workers": 1, "use_gpu": not args.cpu},
        "logging": {"every_steps": 1},
        "checkpoint": {"export": False, "async_save": False},
        **gpu,
    }
    config = folder / f"{name}.yaml"
    config.write_text(yaml.safe_dump(run))
    metrics = folder / "runs" / name / "metrics.jsonl"
    log = folder / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                                 "-m", "job", "--config", str(config)], cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        while proc.poll() is None and not last_step_logged(metrics, args.steps):
            time.sleep(1)
        stop(proc)  # the figures are in; its final checkpoint measures nothing
    if args.out:  # its whole log beside the rows (the work directory goes at the end)
        Path(args.out).with_name(f"{Path(args.out).stem}-{name}.log").write_text(log.read_text())
    if not last_step_logged(metrics, args.steps):
        return {"error": " | ".join(log.read_text().splitlines()[-6:])[-1500:]}
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"][args.warmup:]
    step = statistics.median(args.batch * shape["longest_pair"] / r["tokens_per_s_per_device"] for r in train)
    reference = next(r for r in records if r["kind"] == "reference")
    return {"step_time_s": step, "ref_s": reference["seconds"], "peak_mem_gib": max(r["peak_mem_gib"] or 0 for r in train),
            "loss": train[-1]["loss"]}


def run_trl(args, method: str, options: dict, folder: Path) -> dict:
    """One TRL variant in this process (`--peer`)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config
    from trl import DPOConfig, DPOTrainer

    from bench.hf_trainer_baseline import make_timer_callback
    from job.common.presets import PRESETS
    from job.config import LORA_DEFAULT_TARGETS

    cuda = torch.cuda.is_available() and not args.cpu
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(folder / "tokenizer")
    with torch.device("cuda" if cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**PRESETS[args.preset], use_cache=False),
                                                 attn_implementation="sdpa",
                                                 dtype=torch.bfloat16 if cuda and method == "lora" else torch.float32)
    ref, peft_config = None, None
    if method == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                                 target_modules=LORA_DEFAULT_TARGETS, task_type="CAUSAL_LM")
    elif not options.get("precompute"):  # precomputed: TRL reads the policy as it starts, and keeps no copy
        ref = copy.deepcopy(model).to(torch.bfloat16 if cuda else torch.float32).eval()
    rows = [json.loads(line) for line in (folder / "pairs.jsonl").read_text().splitlines()]
    config = DPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-dpo-"), per_device_train_batch_size=args.batch, max_steps=args.steps,
        learning_rate=1e-6, lr_scheduler_type="constant", optim="adamw_torch_fused" if cuda else "adamw_torch",
        bf16=cuda, use_cpu=not cuda, beta=0.1, max_length=None, gradient_checkpointing=False,
        precompute_ref_log_probs=bool(options.get("precompute")), use_liger_kernel=bool(options.get("liger")),
        logging_steps=10**6, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        seed=0)
    timer = make_timer_callback()
    started = time.perf_counter()
    trainer = DPOTrainer(model=model, ref_model=ref, args=config, train_dataset=Dataset.from_list(rows),
                         processing_class=tok, peft_config=peft_config, callbacks=[timer])
    setup = time.perf_counter() - started
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    out = trainer.train()
    intervals = [b - a for a, b in zip(timer.ends, timer.ends[1:])][args.warmup:]
    return {"step_time_s": statistics.median(intervals), "ref_s": setup if options.get("precompute") else 0.0,
            "setup_s": setup, "loss": out.training_loss,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def run_variant(args, name: str, folder: Path, shape: dict) -> dict:
    side, method, options = VARIANTS[name]
    row = {"variant": name, "method": method}
    started = time.time()
    if options.get("liger") and args.cpu:
        return {**row, "error": "skipped: Liger's kernels need a CUDA device"}
    if side == "ours":
        row.update(run_ours(args, name, method, folder, shape))
    else:
        argv = [f"--{k}={getattr(args, k)}" for k in ("preset", "prompt", "completion", "batch", "steps", "warmup")]
        done = subprocess.run([sys.executable, __file__, *argv, *(["--cpu"] if args.cpu else []), "--peer", name,
                               "--folder", str(folder)], cwd=REPO, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            row["error"] = " | ".join((done.stdout + done.stderr).strip().splitlines()[-6:])[-1500:]
        else:
            row.update(json.loads(lines[-1]))
    row["wall_s"] = round(time.time() - started)
    if "step_time_s" in row:
        row["pairs_per_s"] = args.batch / row["step_time_s"]
        row["tokens_per_s"] = row["pairs_per_s"] * shape["tokens_per_pair"]
        pass_s = args.steps * row["step_time_s"] + row["ref_s"]
        row["tokens_per_s_with_ref"] = args.steps * args.batch * shape["tokens_per_pair"] / pass_s
    return row


def print_table(rows: list[dict]) -> None:
    base = {r["method"]: r for r in rows if r["variant"] == f"trl-{r['method']}" and "tokens_per_s" in r}
    print(f"{'variant':<16}{'pairs/s':>9}{'tok/s':>10}{'ref s':>8}{'tok/s+ref':>11}{'mem GiB':>9}{'vs trl':>8}"
          f"{'vs trl+ref':>11}")
    for r in rows:
        if "tokens_per_s" not in r:
            print(f"{r['variant']:<16}  FAILED {r.get('error')}")
            continue
        b = base.get(r["method"])
        mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") else "-"
        ratios = (f"{r['tokens_per_s'] / b['tokens_per_s']:>8.2f}{r['tokens_per_s_with_ref'] / b['tokens_per_s_with_ref']:>11.2f}"
                  if b else f"{'-':>8}{'-':>11}")
        print(f"{r['variant']:<16}{r['pairs_per_s']:>9.2f}{r['tokens_per_s']:>10.0f}{r['ref_s']:>8.1f}"
              f"{r['tokens_per_s_with_ref']:>11.0f}{mem:>9}{ratios}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-1.5b", choices=["qwen2.5-1.5b", "qwen2-tiny"])
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--completion", type=int, default=383, help="tokens of each answer, before its EOS")
    p.add_argument("--batch", type=int, default=8, help="pairs per step")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the median")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--only", default=",".join(VARIANTS))
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--peer", help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.peer:
        _, method, options = VARIANTS[args.peer]
        print(json.dumps(run_trl(args, method, options, Path(args.folder))), flush=True)
        os._exit(0)  # as hf_trainer_baseline.py: no interpreter teardown after the result is out
    names = args.only.split(",")
    if unknown := [n for n in names if n not in VARIANTS]:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="dpo-peer-") as tmp:
        shape = make_pairs(Path(tmp), args)
        print(json.dumps({"pairs": args.batch * args.steps, **shape}), flush=True)
        for name in names:
            rows.append(run_variant(args, name, Path(tmp), shape))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    print_table(rows)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
