#!/usr/bin/env python3
"""The token lengths bench/decode_step.py decodes: a run's task-evaluation prompts and reference answers.

    python bench/task_lengths.py --config run.yaml [--set KEY=VALUE ...] --out DIR

Writes `DIR/prompt-lengths.json` (each held-out task item's prompt in tokens, as task evaluation renders and
tokenizes it) and `DIR/answer-lengths.json` (each reference answer's tokens plus its EOS: a proxy for how long a
fine-tuned model's generations run). Needs the run's tokenizer (`model.path`, no weights read) and its data; runs on
a CPU, so decode_step.py on the GPU machine needs neither.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from job import config as config_lib  # noqa: E402
from job.common import sources  # noqa: E402
from job.worker.evaluation import task  # noqa: E402
from job.worker.model.causal_lm import load_tokenizer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    cfg = config_lib.load(args.config, args.set)
    if not cfg.eval.task:
        parser.error("the config has no eval.task")
    tokenizer = load_tokenizer(cfg.model)
    _, heldout, _ = sources.read_examples(cfg.data, cfg.train.seed)
    items = task.task_items(heldout.items, cfg.data, tokenizer)
    tokens = lambda texts: [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]  # noqa: E731
    lengths = {"prompt": tokens([x["prompt"] for x in items]),
               "answer": [n + 1 for n in tokens([x["reference"] for x in items])]}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for name, ns in lengths.items():
        Path(args.out, f"{name}-lengths.json").write_text(json.dumps(ns))
        q = statistics.quantiles(ns, n=100)
        print(f"{name}s: {len(ns)}, min {min(ns)}, median {q[49]:.0f}, p90 {q[89]:.0f}, max {max(ns)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
