"""Preference pairs a model makes itself (`mode: pairs`, `python -m job pairs`): `pairs.samples` answers sampled per
question of `data.train` by the fast decoder, each scored by `eval.task`; a question with an incorrect answer gives
pairs of a correct one (a correct sample, else the reference solution) over an incorrect one. Each worker decodes
its share of the questions; rank 0 writes `<run>/pairs.jsonl` (the source's rows, each with `chosen` and `rejected`
added: a `data.format: preference` source for `train.objective: dpo` with the same columns) and `<run>/pairs.json`
(counts, settings, the model's and the data's fingerprints).
"""

from __future__ import annotations

import hashlib
import json
import time

import torch
import torch.distributed as dist

from .. import storage
from ..common.exports import PAIRS_FILE, PAIRS_RECORD
from ..common.sources import load_source, to_examples
from ..config import RunConfig
from .build import run_tokenizer
from .contract import Launcher, LoopConfig
from .data import pad_id
from .evaluation.generate import Sampling, decode_continuation, greedy_generate, left_pad
from .evaluation.task import score, task_items
from .metrics import MetricsLogger, Timeline
from .model.causal_lm import build_causal_lm, weights_fingerprint

def choose_pairs(samples: list[tuple[str, bool]], reference: str, per_question: int) -> list[tuple[str, str]]:
    """(chosen, rejected) of one question from its scored samples: each distinct non-empty incorrect answer, up to
    `per_question`, beside a distinct correct one in turn (the reference solution when none is correct)."""
    correct = list(dict.fromkeys(text for text, ok in samples if ok)) or [reference]
    incorrect = list(dict.fromkeys(text for text, ok in samples if not ok and text.strip()))[:per_question]
    return [(correct[i % len(correct)], text) for i, text in enumerate(incorrect)]


def as_completion(row: dict, prompt: str, chosen: str, rejected: str, cfg: RunConfig) -> dict:
    """The source row with the pair added, in the row's own form: strings beside a prompt column, assistant messages
    (and the conversation before the answer as `prompt`) beside a conversation."""
    cols = cfg.data.columns
    if cfg.data.format == "chat":
        messages = row[cols.messages]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        turn = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
        return {**row, cols.prompt: messages[:last], cols.chosen: turn(chosen), cols.rejected: turn(rejected)}
    # TRL's `prompt` too: the prompt as rendered, so that its trainers read the same pairs.
    return {**row, "prompt": prompt, cols.chosen: chosen, cols.rejected: rejected}


def make_pairs(loop_config: LoopConfig, launcher: Launcher, device: torch.device, record: dict | None,
               timeline: Timeline) -> dict:
    """Samples, scores and, on rank 0, writes the pairs; returns the results for the run record."""
    cfg, run_dir = loop_config.cfg, loop_config.run_dir
    rank, world, pairs_cfg = dist.get_rank(), dist.get_world_size(), cfg.pairs
    start = time.perf_counter()
    with timeline.phase("data"):
        tokenizer = run_tokenizer(loop_config)
        box = [to_examples(load_source(cfg.data.train, "data.train", cfg.data.max_rows), cfg.data, "data.train")
               if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        examples = box[0]
        items = task_items(examples.items, cfg.data, tokenizer)
    with timeline.phase("model"), torch.device(device):
        lm = build_causal_lm(cfg.model, len(tokenizer) if cfg.model.train_tokenizer_vocab else None, cfg.train.seed).eval()
        if device.type == "cuda":
            lm = lm.to(torch.bfloat16)
    questions = max(1, cfg.eval.task_batch_size // pairs_cfg.samples)
    mine = list(range(rank, len(items), world))
    scored: dict[int, list[tuple[str, bool]]] = {}
    with timeline.phase("task_eval"):
        for batch_number, first in enumerate(range(0, len(mine), questions)):
            batch = mine[first : first + questions]
            prompts = tokenizer([items[i]["prompt"] for i in batch], add_special_tokens=False)["input_ids"]
            ids, mask = left_pad([p for p in prompts for _ in range(pairs_cfg.samples)], pad_id(tokenizer))
            sampling = Sampling(pairs_cfg.temperature, pairs_cfg.top_p,
                                seed=(cfg.train.seed * 1_000_003 + rank) * 1_000_003 + batch_number)
            out = greedy_generate(lm, ids.to(device), mask.to(device), cfg.eval.task_max_new_tokens,
                                  tokenizer.eos_token_id, pad_id(tokenizer), sampling=sampling).ids
            for k, i in enumerate(batch):
                texts = [decode_continuation(tokenizer, row, ids.shape[1])
                         for row in out[k * pairs_cfg.samples : (k + 1) * pairs_cfg.samples]]
                scored[i] = [(text, score(cfg.eval.task, text, items[i]["reference"])[1]) for text in texts]
    shares = [None] * world
    dist.all_gather_object(shares, scored)
    if rank != 0:
        return {}
    scored = {i: samples for share in shares for i, samples in share.items()}
    rows, counts = [], dict.fromkeys(("questions", "samples", "correct_samples", "all_correct", "none_correct",
                                      "without_pairs", "pairs"), 0)
    for i in range(len(items)):
        samples = scored[i]
        right = sum(ok for _, ok in samples)
        counts["questions"] += 1
        counts["samples"] += len(samples)
        counts["correct_samples"] += right
        counts["all_correct"] += right == len(samples)
        counts["none_correct"] += right == 0
        chosen = choose_pairs(samples, items[i]["reference"], pairs_cfg.per_question)
        counts["without_pairs"] += not chosen  # every answer correct (or empty)
        rows += [as_completion(examples.rows[i], items[i]["prompt"], c, r, cfg) for c, r in chosen]
    counts["pairs"] = len(rows)
    text = "".join(json.dumps(row) + "\n" for row in rows)
    storage.write_atomic(storage.join(run_dir, PAIRS_FILE), text)
    summary = {"file": storage.join(run_dir, PAIRS_FILE), "sha256": hashlib.sha256(text.encode()).hexdigest(), **counts,
               "sample_accuracy": counts["correct_samples"] / max(counts["samples"], 1),
               "sampling": {"samples": pairs_cfg.samples, "temperature": pairs_cfg.temperature,
                            "top_p": pairs_cfg.top_p, "max_new_tokens": cfg.eval.task_max_new_tokens,
                            "questions_per_batch": questions, "seed": cfg.train.seed, "world_size": world},
               "task": cfg.eval.task, "data": examples.info, "model": weights_fingerprint(cfg.model),
               "seconds": round(time.perf_counter() - start, 3)}
    storage.write_atomic(storage.join(run_dir, PAIRS_RECORD), json.dumps(summary, indent=1))
    logger = MetricsLogger(run_dir, 1)
    logger.log({"kind": "pairs", "step": 0, **{k: v for k, v in summary.items() if k not in ("data", "model")}})
    logger.close()
    return {"weights": summary["model"], "pairs": summary, "time": timeline.summary()}
