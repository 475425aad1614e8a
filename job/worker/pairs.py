"""Preference pairs a model makes itself (`mode: pairs`): answers sampled for `data.train`'s questions, scored by
`eval.task`, each worker decoding its share; rank 0 writes `<run>/pairs.jsonl` (the rows with `chosen` and
`rejected` added: a `data.format: preference` source with the same columns) and `<run>/pairs.json` (counts,
settings, the model's and the data's fingerprints).
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
    """Samples and scores this worker's share of the questions; rank 0 writes the pairs and returns the results for
    the run record."""
    cfg, start = loop_config.cfg, time.perf_counter()
    with timeline.phase("data"):
        tokenizer = run_tokenizer(loop_config)
        box = [to_examples(load_source(cfg.data.train, "data.train", cfg.data.max_rows), cfg.data, "data.train")
               if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        items = task_items(box[0].items, cfg.data, tokenizer)
    with timeline.phase("model"), torch.device(device):
        lm = build_causal_lm(cfg.model, len(tokenizer) if cfg.model.train_tokenizer_vocab else None, cfg.train.seed)
        lm = lm.eval().to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    with timeline.phase("task_eval"):
        shares = [None] * dist.get_world_size()
        dist.all_gather_object(shares, sample_and_score(lm, tokenizer, items, cfg, device))
    if dist.get_rank() != 0:
        return {}
    scored = {i: samples for share in shares for i, samples in share.items()}
    summary = write_pairs(loop_config.run_dir, cfg, box[0], items, [scored[i] for i in range(len(items))])
    summary["seconds"] = round(time.perf_counter() - start, 3)
    storage.write_atomic(storage.join(loop_config.run_dir, PAIRS_RECORD), json.dumps(summary, indent=1))
    logger = MetricsLogger(loop_config.run_dir, 1)
    logger.log({"kind": "pairs", "step": 0, **{k: v for k, v in summary.items() if k not in ("data", "model")}})
    logger.close()
    return {"weights": summary["model"], "pairs": summary, "time": timeline.summary()}


def sample_and_score(lm, tokenizer, items: list[dict], cfg: RunConfig, device: torch.device) -> dict:
    """{question index: [(answer, correct?)]} of this rank's questions (every `world`-th), `pairs.samples` each,
    decoded `eval.task_batch_size` rows at a time."""
    rank, world, k = dist.get_rank(), dist.get_world_size(), cfg.pairs.samples
    mine, per_batch, scored = list(range(rank, len(items), world)), max(1, cfg.eval.task_batch_size // k), {}
    for number, first in enumerate(range(0, len(mine), per_batch)):
        batch = mine[first : first + per_batch]
        prompts = tokenizer([items[i]["prompt"] for i in batch], add_special_tokens=False)["input_ids"]
        ids, mask = left_pad([p for p in prompts for _ in range(k)], pad_id(tokenizer))
        sampling = Sampling(cfg.pairs.temperature, cfg.pairs.top_p, seed=hash((cfg.train.seed, rank, number)) & 0x7FFFFFFF)
        out = greedy_generate(lm, ids.to(device), mask.to(device), cfg.eval.task_max_new_tokens,
                              tokenizer.eos_token_id, pad_id(tokenizer), sampling=sampling).ids
        for j, i in enumerate(batch):
            texts = [decode_continuation(tokenizer, row, ids.shape[1]) for row in out[j * k : (j + 1) * k]]
            scored[i] = [(text, score(cfg.eval.task, text, items[i]["reference"])[1]) for text in texts]
    return scored


def write_pairs(run_dir: str, cfg: RunConfig, examples, items: list[dict], scored: list[list]) -> dict:
    """`<run>/pairs.jsonl` from every question's scored samples; returns `pairs.json`'s record."""
    counts = dict.fromkeys(("questions", "samples", "correct_samples", "all_correct", "none_correct",
                            "without_pairs", "pairs"), 0)
    rows = []
    for row, item, samples in zip(examples.rows, items, scored):
        right = sum(ok for _, ok in samples)
        chosen = choose_pairs(samples, item["reference"], cfg.pairs.per_question)
        for key, n in (("questions", 1), ("samples", len(samples)), ("correct_samples", right),
                       ("all_correct", right == len(samples)), ("none_correct", right == 0),
                       ("without_pairs", not chosen), ("pairs", len(chosen))):
            counts[key] += n
        rows += [as_completion(row, item["prompt"], c, r, cfg) for c, r in chosen]
    text = "".join(json.dumps(row) + "\n" for row in rows)
    storage.write_atomic(storage.join(run_dir, PAIRS_FILE), text)
    sampling = {"samples": cfg.pairs.samples, "temperature": cfg.pairs.temperature, "top_p": cfg.pairs.top_p,
                "max_new_tokens": cfg.eval.task_max_new_tokens, "rows_per_batch": cfg.eval.task_batch_size,
                "seed": cfg.train.seed, "world_size": dist.get_world_size()}
    return {"file": storage.join(run_dir, PAIRS_FILE), "sha256": hashlib.sha256(text.encode()).hexdigest(), **counts,
            "sample_accuracy": counts["correct_samples"] / max(counts["samples"], 1), "sampling": sampling,
            "task": cfg.eval.task, "data": examples.info, "model": weights_fingerprint(cfg.model)}
