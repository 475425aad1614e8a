"""Preference tuning (`train.objective: dpo`, `data.format: preference`) and the pairs a model makes itself
(`mode: pairs`): the data and its errors, DPO's loss against its formula, runs on 2 CPU Ray Train workers (full and
LoRA; held-out margin; exact resume after a killed worker, the reference log-probabilities read back), and pairs."""

import gc
import json
import random

import pytest
import torch
import torch.nn.functional as F
from test_checkpoint import MAX_STEPS, _assert_same_training, _config, _records, _run

from conftest import tensorboard_scalars
from job import config as config_lib
from job.commands import compare, report
from job.common import sources
from job.config import ConfigError
from job.driver import launch
from job.records import run_record
from job.worker import data as data_lib
from job.worker.model.causal_lm import CausalLMWithLoss, build_causal_lm
from job.worker.objective import DirectPreference

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GOOD = ["apple", "river", "stone", "cloud", "green", "light"]
BAD = ["error", "wrong", "broken", "noise", "dark", "empty"]


def write_pairs(path, n: int = 400, seed: int = 0) -> str:
    """Pairs whose chosen answers draw words from one set and rejected from another: a preference DPO can learn and
    carry to held-out prompts."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            k = rng.randint(2, 4)
            f.write(json.dumps({"question": f"Question {i}: name {rng.randint(2, 5)} things.",
                                "chosen": " " + " ".join(rng.choice(GOOD) for _ in range(k)),
                                "rejected": " " + " ".join(rng.choice(BAD) for _ in range(k))}) + "\n")
    return str(path)


def preference_data(**kw) -> dict:
    return {"format": "preference", "columns": {"prompt": "question"}, "prompt_template": "Q: {prompt}\nA:", **kw}


def data_cfg(**kw) -> config_lib.DataConfig:
    raw = {"name": "t", "model": {"preset": "qwen2-tiny", "init": "random", "train_tokenizer_vocab": 512},
           "data": {"validation_fraction": 0, **kw}, "train": {"objective": "dpo"}, "checkpoint": {"export": False}}
    return config_lib.load_dict(raw).data


@pytest.fixture(scope="module")
def tokenizer():
    return sources.train_bpe_tokenizer(["Q: Question 1: name things.\nA: " + " ".join(GOOD + BAD),
                                        "user assistant <|im_start|> <|im_end|>"] * 5, 400)


# ---- data -------------------------------------------------------------------------------------------------------------


def test_preference_rows_string_and_conversational_train_only_on_completions(tmp_path, tokenizer):
    path = write_pairs(tmp_path / "p.jsonl", n=3)
    cfg = data_cfg(**preference_data(train=path))
    train, _, _ = sources.read_examples(cfg, seed=0)
    rows = [json.loads(line) for line in open(path)]
    assert train.items[0] == {"prompt": f"Q: {rows[0]['question']}\nA:", "chosen": rows[0]["chosen"],
                              "rejected": rows[0]["rejected"]}
    eos = tokenizer.eos_token_id
    for (prompt, chosen, rejected), row in zip(data_lib.tokenize_preference(train.items, tokenizer, None), rows):
        assert tokenizer.decode(prompt) == f"Q: {row['question']}\nA:"
        assert chosen[-1] == eos and tokenizer.decode(chosen[:-1]) == row["chosen"]
        assert rejected[-1] == eos and tokenizer.decode(rejected[:-1]) == row["rejected"]
    # TRL's conversational form: lists of messages, rendered with the chat template; the completion is what the
    # whole conversation's rendering adds after the prompt's with the generation prompt.
    user = [{"role": "user", "content": "2 + 3?"}]
    conv = {"prompt": user, "chosen": [{"role": "assistant", "content": "5"}],
            "rejected": [{"role": "assistant", "content": "6"}]}
    cfg = data_cfg(format="preference", train=str(tmp_path / "c.jsonl"), chat_template=None)
    (tmp_path / "c.jsonl").write_text(json.dumps(conv) + "\n")
    train, _, _ = sources.read_examples(cfg, seed=0)
    ((prompt, chosen, rejected),) = data_lib.tokenize_preference(train.items, tokenizer, CHATML)
    assert tokenizer.decode(prompt) == "<|im_start|>user\n2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(chosen[:-1]) == "5<|im_end|>\n" and tokenizer.decode(rejected[:-1]) == "6<|im_end|>\n"


def test_bad_preference_rows_name_the_file_and_line(tmp_path):
    good = {"question": "q", "chosen": "a", "rejected": "b"}
    cases = [({"question": "q", "chosen": "a"},
              "missing column 'rejected' (data.columns.rejected); the row has ['chosen', 'question']"),
             ({**good, "chosen": "  "}, "column 'chosen' (data.columns.chosen): empty"),
             ({**good, "rejected": "a"}, "columns 'chosen' and 'rejected': identical (nothing to prefer)"),
             ({**good, "chosen": [{"role": "assistant", "content": "a"}]},
              "column 'question' (data.columns.prompt): expected list, got str"),
             ({"question": [], "chosen": [{"role": "assistant", "content": ""}], "rejected": [{"role": "x"}]},
              "column 'chosen' (data.columns.chosen): empty")]
    for row, says in cases:
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(sources.DataError) as e:
            sources.read_examples(data_cfg(**preference_data(train=str(path))), seed=0)
        assert str(e.value) == f"data.train: {path}:2: {says} (set data.bad_rows: skip to drop such rows)"


def test_pairs_stay_whole_in_a_row_and_every_completion_token_is_a_label_once():
    rng = random.Random(0)
    ids = lambda n: [rng.randint(1, 99) for _ in range(n)]  # noqa: E731
    pairs = [(ids(rng.randint(0, 6)), ids(rng.randint(1, 8)), ids(rng.randint(1, 8))) for _ in range(40)]
    pairs.append((ids(30), ids(30), ids(30)))  # longer than a row: cut
    for packing in (True, False):
        blocks, cut = data_lib.pack_pairs(pairs, 32, packing)
        assert cut == 1 and blocks.input_ids.shape[1] == 32
        assert len(blocks) == (len(pairs) if not packing else len(blocks)) and (packing or len(blocks) == 41)
        for number, (prompt, chosen, rejected) in enumerate(pairs[:-1]):
            for k, completion in enumerate((chosen, rejected)):
                where = blocks.sequence == 2 * number + k
                rows = where.any(dim=1).nonzero().flatten().tolist()
                assert len(rows) == 1, "a completion lies in one row"
                # Its labels: the completion's tokens (the first too when there is a prompt to predict it from).
                assert blocks.labels[where].tolist() == (completion if prompt else completion[1:])
            both = ((blocks.sequence // 2) == number).any(dim=1).nonzero().flatten().tolist()
            assert len(both) == 1, "both completions of a pair in the same row"
        assert ((blocks.labels != data_lib.IGNORE_INDEX) == (blocks.sequence >= 0)).all()
    batch = blocks.select(torch.tensor([3, 1])).batch()
    assert batch["pairs"].tolist() == [1, 3] and set(batch["completion"].unique().tolist()) == {-1, 0, 1, 2, 3}


def test_config_rules_for_preference_and_pairs():
    base = {"name": "r", "model": {"preset": "qwen2-tiny", "init": "random", "train_tokenizer_vocab": 512},
            "data": {"format": "preference", "train": "/p.jsonl"}}
    with pytest.raises(ConfigError, match=r"^data.format: preference pairs are trained with train.objective: dpo"):
        config_lib.load_dict(base)
    with pytest.raises(ConfigError, match=r"^eval.task: held-out pairs carry no reference answer: set data.task_source"):
        config_lib.load_dict({**base, "train": {"objective": "dpo"}, "eval": {"task": "gsm8k"}})
    with pytest.raises(ConfigError, match=r"^train.objective: dpo trains on preference pairs: needs data.format"):
        config_lib.load_dict({**base, "data": {"format": "text", "train": "/t.jsonl"}, "train": {"objective": "dpo"}})
    with pytest.raises(ConfigError, match=r"^mode: pairs scores each sampled answer with a task"):
        config_lib.load_dict({**base, "mode": "pairs", "data": {"format": "prompt_completion", "train": "/q.jsonl"}})


def test_a_dpo_run_starts_from_an_export_not_another_runs_checkpoint(tmp_path):
    from job.common import checkpoints

    checkpoint = tmp_path / "sft" / "checkpoint_00000250"
    checkpoint.mkdir(parents=True)
    (checkpoint / checkpoints.COMPLETE).write_text("")
    cfg = config_lib.load_dict({"name": "dpo", "model": {"preset": "qwen2-tiny", "init": "random", "tokenizer": "t"},
                                "data": {"format": "preference", "train": "/p.jsonl"}, "train": {"objective": "dpo"},
                                "checkpoint": {"resume": str(checkpoint)}})
    with pytest.raises(checkpoints.ResumeRefused, match=r"^checkpoint.resume: a DPO run's reference policy is the model"):
        checkpoints.check_before_start(cfg, str(tmp_path / "dpo"))


# ---- the loss ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [0, 16])
def test_dpo_loss_is_the_formula_on_each_pair_alone(chunk):
    """Packed pairs, the model's per-token log-probabilities summed per completion, against the DPO(+NLL) formula
    computed from Transformers' own logits on each sequence alone."""
    cfg = config_lib.ModelConfig(preset="qwen2-tiny", init="random",
                                 overrides={"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
                                            "vocab_size": 300})
    lm = build_causal_lm(cfg, None, 0)
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, 300, (n,), generator=g).tolist()  # noqa: E731
    pairs = [(ids(5), ids(4), ids(6)), (ids(3), ids(7), ids(2)), (ids(8), ids(3), ids(3))]
    blocks, _ = data_lib.pack_pairs(pairs, 64, packing=True)
    assert len(blocks) == 1, "the three pairs share one row"
    blocks.reference = torch.randn(6, generator=g)
    beta, nll_weight = 0.3, 0.5
    loss, metrics = DirectPreference(config_lib.DpoConfig(beta, nll_weight)).loss(
        CausalLMWithLoss(lm, chunk), blocks.select(torch.tensor([0])).batch())

    def logp(prompt, completion):
        seq = torch.tensor([prompt + completion])
        logprobs = torch.log_softmax(lm(seq).logits[0, :-1].float(), dim=-1).gather(1, seq[0, 1:, None])[:, 0]
        return logprobs[len(prompt) - 1:].sum()

    want, margins = 0.0, []
    for i, (prompt, chosen, rejected) in enumerate(pairs):
        pc, pr = logp(prompt, chosen), logp(prompt, rejected)
        margins.append(beta * ((pc - blocks.reference[2 * i]) - (pr - blocks.reference[2 * i + 1])))
        want = want - F.logsigmoid(margins[-1]) + nll_weight * -pc / len(chosen)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(metrics["rewards/margins"], sum(margins), rtol=1e-5, atol=1e-5)
    assert metrics["rewards/accuracies"] == sum(float(m > 0) for m in margins)


@pytest.mark.parametrize("frozen_head", [False, True])
def test_chunked_log_probs_have_the_plain_gradients(frozen_head):
    """The chunked head's log-probabilities and their gradients (a different weight per token, as DPO's) equal
    autograd's through plain logits; with a frozen head (LoRA), through the gradients kept in forward."""
    from job.worker.model.loss import token_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=not frozen_head)
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[::5] = data_lib.IGNORE_INDEX
    upstream = torch.randn(37, generator=g, dtype=torch.float64)
    grads = []
    for chunk in (0, 8):
        out = token_logprobs(hidden, weight, labels, chunk)
        assert (out[::5] == 0).all()
        grads.append(torch.autograd.grad((out.double() * upstream).sum(), [hidden] + ([] if frozen_head else [weight])))
        grads[-1] = (out.detach(), *grads[-1])
    for plain, chunked in zip(*grads):
        torch.testing.assert_close(chunked.double(), plain.double(), rtol=1e-5, atol=1e-5)


def test_measuring_forwards_free_each_batchs_activations_before_the_next(tmp_path, tokenizer, single_process):
    """Under `parallel.compile` the reference pass and the held-out pairs' evaluation run with autograd on, as
    training's forwards do: each batch's graph must be gone before the next forward starts, else two batches'
    activations are held at once (a 1.5B full fine-tune at micro-batch 16 ran out of an 80 GB H100 so)."""
    from job.worker.evaluation.preference import PreferenceEvaluation, compute_reference
    from job.worker.metrics import Timeline
    from job.worker.parts import Worker

    raw = {"name": "t", "storage_path": str(tmp_path),
           "model": {"preset": "qwen2-tiny", "init": "random", "train_tokenizer_vocab": 512,
                     "overrides": {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}},
           "data": preference_data(train=write_pairs(tmp_path / "pairs.jsonl", n=40), validation_fraction=0.25),
           "train": {"objective": "dpo", "micro_batch_size": 2, "seq_len": 64, "max_steps": 4, "warmup_steps": 0},
           "parallel": {"compile": True}, "checkpoint": {"export": False}}
    cfg = config_lib.load_dict(raw)
    dataset = data_lib.build(cfg.data, cfg.train, tokenizer)
    model = CausalLMWithLoss(build_causal_lm(cfg.model, len(tokenizer), 0))
    device = torch.device("cpu")

    def holding_graphs() -> set[int]:  # tensors that still hold a forward's graph (its activations)
        return {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None}

    before = holding_graphs()  # other tests' leftovers in this process
    alive_at_forward, grad_enabled, forward = [], set(), model.forward

    def counting_forward(*args, **kwargs):
        grad_enabled.add(torch.is_grad_enabled())
        alive_at_forward.append(len(holding_graphs() - before))
        return forward(*args, **kwargs)

    model.forward = counting_forward
    worker = Worker(cfg, str(tmp_path), device, 0, 1, False, Timeline(0.0, device), None)
    compute_reference(model, dataset, cfg, str(tmp_path), "key", 0, 1, device)
    reference_forwards = len(alive_at_forward)
    PreferenceEvaluation(worker, model, dataset.validation, 0).measure(0)
    assert grad_enabled == {True}, "the forwards ran with autograd on, as under parallel.compile"
    assert reference_forwards >= 2 and len(alive_at_forward) - reference_forwards >= 2
    assert alive_at_forward == [0] * len(alive_at_forward), "a batch's activations outlived its forward"


# ---- runs -------------------------------------------------------------------------------------------------------------


def dpo_config(tmp_path, name, **sections) -> config_lib.RunConfig:
    data = preference_data(train=write_pairs(tmp_path / "pairs.jsonl"), validation_fraction=0.1)
    # The chunked head (its backward computes the logits again from the FSDP2-gathered head) on 2 sharded workers.
    return _config(tmp_path, name, data=data, train={"objective": "dpo", "dpo": {"beta": 0.5}, "lr": 3e-3,
                                                     "loss_chunk_size": 16, **sections.pop("train", {})},
                   eval={"every_steps": 10}, **sections)


@pytest.fixture(scope="module")
def dpo_reference(ray_cluster, tmp_path_factory):
    """The uninterrupted DPO run (full fine-tune), with its export."""
    return _run(dpo_config(tmp_path_factory.mktemp("dpo-ref"), "dpo-reference", checkpoint={"export": True}))


def test_dpo_raises_the_held_out_margin_and_logs_trls_names(dpo_reference, tmp_path):
    evals = _records(dpo_reference, "eval")
    first, last = evals[0], evals[-1]
    assert [r["step"] for r in evals] == [0, 10, 20]
    # At the start the policy is the reference: every reward is 0 (the precomputed log-probabilities are the model's).
    assert abs(first["eval_rewards/margins"]) < 1e-4 and first["eval_loss"] == pytest.approx(0.6931, abs=1e-3)
    assert last["eval_rewards/margins"] > 1.0 and last["eval_rewards/accuracies"] > 0.9
    assert last["eval_preference_accuracy"] > first["eval_preference_accuracy"]
    train = _records(dpo_reference, "train")
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected"} <= set(train[-1])
    (reference,) = _records(dpo_reference, "reference")
    assert reference["rows_computed"] > 0 and reference["file"].startswith(f"{dpo_reference}/reference/")
    export = _records(dpo_reference, "export")[0]
    assert export["abs_diff"] < 1e-3, "the export's check (held-out loss per token) passes"
    tags = tensorboard_scalars(f"{dpo_reference}/tensorboard")
    assert {"train/rewards/margins", "train/logps/chosen", "eval/eval_rewards/accuracies"} <= set(tags)
    report.write_report(dpo_reference, str(tmp_path), plots=False)
    text = (tmp_path / "report.md").read_text()
    assert f"| held-out preference accuracy | {first['eval_preference_accuracy']:.4g} |" in text


def test_dpo_resumes_exactly_after_a_killed_worker_and_reuses_the_reference(dpo_reference, tmp_path):
    cfg = dpo_config(tmp_path, "dpo-killed", scaling={"num_workers": 2, "max_failures": 1},
                     debug={"fail_at_step": 7, "fail_rank": 1})
    run_dir = _run(cfg)
    (resume,) = _records(run_dir, "resume")
    assert resume["step"] == 4
    first, again = _records(run_dir, "reference")
    assert first["rows_computed"] > 0 and again["rows_computed"] == 0, "the resumed attempt read them back"
    _assert_same_training(run_dir, dpo_reference)


def test_dpo_with_lora_trains_the_adapters_from_the_base(dpo_reference, tmp_path):
    cfg = dpo_config(tmp_path, "dpo-lora", model={"lora": {"rank": 4, "alpha": 8}}, train={"lr": 2e-2},
                     checkpoint={"export": True})
    run_dir = _run(cfg)
    start = _records(run_dir, "start")[0]
    assert start["method"] == "lora"
    evals = _records(run_dir, "eval")
    assert abs(evals[0]["eval_rewards/margins"]) < 1e-4 and evals[-1]["eval_rewards/margins"] > 0.5
    assert len(_records(run_dir, "train")) == MAX_STEPS
    results = {key for key, _, _ in compare.compare_records(run_record.load_record(dpo_reference),
                                                            run_record.load_record(run_dir))["results"]}
    assert {"method", "preference.eval_rewards/margins"} <= results


# ---- pairs ------------------------------------------------------------------------------------------------------------


def test_choose_pairs():
    from job.worker.pairs import choose_pairs

    assert choose_pairs([("a #### 5", True), ("b #### 4", False), ("b #### 4", False), ("c", False)], "ref", 3) == [
        ("a #### 5", "b #### 4"), ("a #### 5", "c")]
    assert choose_pairs([("x", False), ("y", False)], "ref", 1) == [("ref", "x")]
    assert choose_pairs([("a", True), ("a", True)], "ref", 2) == []
    assert choose_pairs([("a", True), ("d", True), ("x", False), ("y", False)], "ref", 2) == [("a", "x"), ("d", "y")]
    assert choose_pairs([("", False), (" ", False)], "ref", 1) == [], "an empty answer is no rejected completion"


def questions(path, n: int) -> str:
    rng = random.Random(1)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"question": f"What is {a} plus {b}?", "answer": f"{a} plus {b} is {a + b}.\n#### {a + b}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def pairs_config(tmp_path, name, **sections) -> config_lib.RunConfig:
    raw = {"name": name, "storage_path": str(tmp_path / "runs"), "mode": "pairs",
           "model": {"preset": "qwen2-tiny", "init": "random", "train_tokenizer_vocab": 300,
                     "overrides": {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}},
           "data": {"format": "prompt_completion", "train": questions(tmp_path / "q.jsonl", 12),
                    "columns": {"prompt": "question", "completion": "answer"}, "prompt_template": "Q: {prompt}\nA:"},
           "eval": {"task": "gsm8k", "task_max_new_tokens": 8, "task_batch_size": 16},
           "pairs": {"samples": 4}, "scaling": {"num_workers": 2}}
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return config_lib.load_dict(raw)


def test_pairs_writes_the_pairs_its_samples_give(tmp_path, monkeypatch, single_process):
    """`make_pairs` in this process, its decoder scripted: each question's samples are known, so are its pairs."""
    from job.common import exports
    from job.worker import pairs
    from job.worker.contract import LoopConfig
    from job.worker.evaluation.generate import Generated
    from job.worker.metrics import Timeline

    cfg = pairs_config(tmp_path, "scripted", scaling={"num_workers": 1})
    rows = [json.loads(line) for line in open(cfg.data.train.path)]
    tok = sources.train_bpe_tokenizer([r["question"] + r["answer"] + " wrong 123" for r in rows], 300)
    script = {}  # prompt -> its 4 samples: all right, mixed, all wrong (twice the same), empty
    for i, r in enumerate(rows):
        right, wrong = f"so {r['answer'].split()[-1]}", f"so {int(r['answer'].split()[-1]) + 1}"
        script[f"Q: {r['question']}\nA:"] = [[right] * 4, [wrong, right, "wrong 123", wrong], [wrong] * 4, [""] * 4][i % 4]

    def scripted(lm, input_ids, attention_mask, max_new_tokens, eos, pad, sampling):
        out = []
        for row, mask in zip(input_ids, attention_mask):
            prompt = tok.decode(row[mask.bool()].tolist())
            k = sum(1 for p in out if p[0] == prompt)
            out.append((prompt, tok(script[prompt][k], add_special_tokens=False)["input_ids"] + [eos]))
        width = max(len(ids) for _, ids in out)
        new = torch.tensor([ids + [pad] * (width - len(ids)) for _, ids in out])
        return Generated(torch.cat([input_ids, new], dim=1), "scripted")

    monkeypatch.setattr(pairs, "greedy_generate", scripted)
    monkeypatch.setattr(pairs, "run_tokenizer", lambda loop_config: tok)
    run_dir = str(tmp_path / "runs" / "scripted")
    loop = LoopConfig(cfg, run_dir, 0.0)
    result = pairs.make_pairs(loop, None, torch.device("cpu"), {}, Timeline(0.0, torch.device("cpu")))
    written = [json.loads(line) for line in open(f"{run_dir}/{exports.PAIRS_FILE}")]
    expected = []
    for i, r in enumerate(rows):
        right, wrong = f"so {r['answer'].split()[-1]}", f"so {int(r['answer'].split()[-1]) + 1}"
        chosen_rejected = [[], [(right, wrong)], [(r["answer"], wrong)], []][i % 4]
        expected += [{**r, "prompt": f"Q: {r['question']}\nA:", "chosen": c, "rejected": j} for c, j in chosen_rejected]
    assert written == expected
    record = json.load(open(f"{run_dir}/{exports.PAIRS_RECORD}"))
    assert {k: record[k] for k in ("questions", "samples", "all_correct", "none_correct", "without_pairs", "pairs")} == \
        {"questions": 12, "samples": 48, "all_correct": 3, "none_correct": 6, "without_pairs": 6, "pairs": 6}
    assert record["data"]["files"][0]["sha256"] and record["model"]["init"] == "random"
    assert result["pairs"]["sha256"] == record["sha256"]


def test_pairs_run_writes_pairs_dpo_trains_on(ray_cluster, tmp_path):
    """`mode: pairs` end to end under Ray Train: sampled answers, scored, written where a DPO run reads them; a
    second run of the same name starts nothing."""
    from job.common import exports
    from job.worker.evaluation.task import score

    cfg = pairs_config(tmp_path, "pairs")
    run_dir = _run(cfg)
    record = json.load(open(f"{run_dir}/{exports.PAIRS_RECORD}"))
    rows = [json.loads(line) for line in open(f"{run_dir}/{exports.PAIRS_FILE}")]
    assert record["questions"] == 12 and record["samples"] == 48 and record["pairs"] == len(rows) > 0
    for row in rows:
        assert row["chosen"] == row["answer"] or score("gsm8k", row["chosen"], row["answer"])[1]
        assert not score("gsm8k", row["rejected"], row["answer"])[1]
    assert "already written its pairs" in launch.finished(cfg, run_dir)
    dpo = config_lib.load_dict({**config_lib.to_dict(cfg), "mode": "train", "name": "dpo",
                                "data": {**config_lib.to_dict(cfg)["data"], "format": "preference",
                                         "train": f"{run_dir}/{exports.PAIRS_FILE}", "validation_fraction": 0},
                                "train": {"objective": "dpo", "max_steps": 2, "micro_batch_size": 1, "seq_len": 64,
                                          "warmup_steps": 0}, "eval": {}, "checkpoint": {"export": False}})
    train, _, _ = sources.read_examples(dpo.data, seed=0)
    assert len(train.items) == len(rows)
