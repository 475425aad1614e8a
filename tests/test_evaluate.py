"""Exact-match scoring, generation and task evaluation, and a 2-worker GSM8K run whose held-out loss falls."""

import json
import os
from pathlib import Path

import pytest
import torch

from job.worker.evaluation import generate, heldout, task
from tests.conftest import tiny_run_config

REPO = Path(__file__).resolve().parents[1]
SHARED = next((p for p in (REPO.parent / "shared" / "data", REPO.parent.parent / "shared" / "data") if p.exists()), None)
GSM8K = SHARED / "gsm8k" if SHARED else None
needs_gsm8k = pytest.mark.skipif(GSM8K is None, reason="shared GSM8K data not found")


# ---- scorer -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reference, expected", [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),
    ("... so she has 1,000 dollars.\n#### 1,000", "1000"),
    ("#### -3", "-3"),
    ("#### 0.50", "0.5"),
    ("#### $18.00", "18"),
    ("#### 5 apples", "5"),
    ("no marker 42", None),
    ("####", None),
])
def test_gsm8k_reference(reference, expected):
    assert task.gsm8k_reference(reference) == expected


@pytest.mark.parametrize("generated, expected", [
    ("She sold 24 in May, 48 + 24 = 72.\n#### 72", "72"),
    ("#### 72\nQuestion: something 9", "72"),  # after ####, the first number, not the last of the text
    ("First 3 then 5. The answer is $1,250.", "1250"),  # no ####: the last number
    ("The total is 18.0.", "18"),
    ("#### -4", "-4"),
    ("I don't know", None),
    ("", None),
])
def test_gsm8k_prediction(generated, expected):
    assert task.gsm8k_prediction(generated) == expected


def exact(generated, reference):
    return task.score("gsm8k", generated, reference)[1]


def test_gsm8k_exact_match_hand_checked():
    ref = "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"
    assert exact("0.2 x 50 = 10\n#### 10", ref)
    assert exact("She earned $10.00", ref)
    assert not exact("0.2 per minute\n#### 0.2", ref)
    assert not exact("She earned 100", ref)
    assert not exact("#### 10", "no final answer here")
    assert not exact("10", "#### 1")


@needs_gsm8k
def test_gsm8k_references_all_parse_and_match_themselves():
    with open(GSM8K / "test.jsonl") as f:
        answers = [json.loads(line)["answer"] for line in f]
    assert all(task.gsm8k_reference(a) is not None for a in answers)
    assert all(exact(a, a) for a in answers)


# ---- generation -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, world", [(10, 2), (7, 2), (5, 3), (1, 2)])
def test_rank_slots_equal_length_and_cover_every_item_once(n, world):
    slots = [heldout._rank_slots(n, r, world) for r in range(world)]
    assert len({len(index) for index, _ in slots}) == 1  # same number of held-out batches on every rank
    real = sorted(i for index, weight in slots for i, w in zip(index, weight) if w)
    assert real == list(range(n))


def test_left_pad():
    ids, mask = generate.left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


class FixedAnswers:
    """Stands in for `greedy_generate`: answers '#### 7' to every prompt and records each batch's size."""

    def __init__(self, tokenizer):
        self.answer = tokenizer("#### 7", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        self.calls = []

    def __call__(self, lm, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, capture_allowed=None):
        from job.worker.evaluation.generate import Generated

        assert capture_allowed is None  # decoded in the loop's own thread: its graphs are never held back
        assert (attention_mask[:, -1] == 1).all()  # left padded
        assert eos_token_id is not None  # stops at EOS
        self.calls.append(input_ids.shape[0])
        new = torch.tensor(self.answer)
        return Generated(torch.cat([input_ids, new.expand(input_ids.shape[0], -1)], 1), "eager")


def test_task_evaluate_deals_items_round_robin_and_scores_each_once(monkeypatch):
    from types import SimpleNamespace

    from job.common import sources

    tok = sources.train_bpe_tokenizer(["Question: what is 3 + 4?\nAnswer: #### 7"] * 5, 300)
    items = [{"question": f"q{i}", "prompt": f"Question: {i}\nAnswer: ", "reference": f"#### {7 if i % 2 else 8}"}
             for i in range(7)]
    cfg = SimpleNamespace(task="gsm8k", task_max_examples=0, task_batch_size=2, task_max_new_tokens=12, task_log_examples=2)
    monkeypatch.setattr(task.dist, "all_reduce", lambda t: None)  # one rank's view; the sum is checked below
    records, answers = [], []
    for rank in range(2):
        answers.append(FixedAnswers(tok))
        monkeypatch.setattr(task, "greedy_generate", answers[-1])
        records.append(task.task_evaluate(None, tok, items, cfg, rank, 2, torch.device("cpu"), step=5))
    assert answers[0].calls == [2, 2] and answers[1].calls == [2, 1]  # items 0,2,4,6 and 1,3,5: no padding slots
    assert records[0]["n"] + records[1]["n"] == 7
    correct = sum(r["exact_match"] * r["n"] for r in records)
    assert correct == 3  # items 1, 3, 5
    assert records[0]["examples"][0] == {"question": "q0", "expected": "8", "got": "#### 7", "correct": False}
    assert records[0]["kind"] == "task_eval" and records[0]["task"] == "gsm8k" and records[0]["step"] == 5
    assert records[0]["decode"] == "eager"  # how the generation ran, as greedy_generate said


# ---- end to end -------------------------------------------------------------------------------------------------------


@needs_gsm8k
def test_two_worker_gsm8k_run_lowers_held_out_loss_and_scores_the_task(tmp_path, ray_cluster):
    from job import config as config_lib
    from job.driver import launch

    raw = tiny_run_config(
        tmp_path,
        data={"format": "prompt_completion", "train": str(GSM8K / "train.jsonl"),
              "validation": {"path": str(GSM8K / "test.jsonl")}, "max_rows": 600,
              "columns": {"prompt": "question", "completion": "answer"},
              "prompt_template": "Question: {prompt}\nAnswer: "},
        train={"max_steps": 60, "micro_batch_size": 4, "seq_len": 128, "lr": 3e-3, "warmup_steps": 5},
        eval={"every_steps": 20, "max_batches": 4, "task": "gsm8k", "task_max_examples": 6, "task_batch_size": 3,
              "task_max_new_tokens": 24, "task_log_examples": 2},
        logging={"every_steps": 10},
    )
    cfg = config_lib.load_dict(raw)
    run_dir = launch.run_directory(cfg)
    launch.run_with_ray(cfg, launch.prepare(cfg, run_dir))
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    evals = {r["step"]: r["eval_loss"] for r in records if r["kind"] == "eval"}
    # From the untrained baseline (step 0, about ln 512 = 6.24) the held-out loss falls at every evaluation.
    assert list(evals) == [0, 20, 40, 60], evals
    losses = list(evals.values())
    assert all(a > b for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 1.0, evals
    assert losses[-1] < losses[1] - 0.2, evals  # and keeps falling after the first, easy drop
    before, task = [r for r in records if r["kind"] == "task_eval"]
    assert before["step"] == 0 and before["n"] == 6  # the score before training, then after
    assert task["step"] == 60 and task["n"] == 6 and 0 <= task["exact_match"] <= 1
    assert len(task["examples"]) == 2 and set(task["examples"][0]) == {"question", "expected", "got", "correct"}
    assert task["examples"][0]["question"].startswith("Question: ")
    run_record = json.load(open(os.path.join(run_dir, "run.json")))
    assert run_record["status"] == "succeeded"
    assert run_record["evaluation"] == [{k: v for k, v in r.items() if k != "time"} for r in (before, task)]
    assert run_record["data"]["fingerprint"]["train"]["files"][0]["sha256"]
    start = next(r for r in records if r["kind"] == "start")
    fp = start["data"]
    assert fp["train"]["rows_kept"] == 600 and fp["validation"]["rows_kept"] == 600 and fp["tokenizer"]["sha256"]


@pytest.mark.parametrize("n_blocks, world, mb", [(10, 2, 4), (7, 3, 2), (1, 2, 4)])
def test_eval_batches_are_full_and_cover_every_block_once(n_blocks, world, mb):
    per_rank = [heldout.eval_batches(n_blocks, rank, world, mb, 0) for rank in range(world)]
    assert len({len(batches) for batches in per_rank}) == 1  # the same number of forwards on every rank
    assert all(len(index) == len(real) == mb for batches in per_rank for index, real in batches)
    real = sorted(i for batches in per_rank for index, ok in batches for i, r in zip(index, ok) if r)
    assert real == list(range(n_blocks))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_heldout_eval_runs_the_training_steps_compiled_graph(tmp_path, monkeypatch, dropout):
    """With parallel.compile, the held-out loss is computed by the graph the training step compiled (no graph
    of its own), and equals the loss of a plain no-grad eval-mode forward; a model with dropout is evaluated
    in eval mode instead, which takes a graph of its own."""
    import functools
    import weakref

    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    from job import config as config_lib
    from job.worker.model.causal_lm import CausalLMWithLoss, build_causal_lm
    from job.worker.model.parallelize import parallelize

    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))  # traced, not built
    cfg = config_lib.load_dict(tiny_run_config(tmp_path, parallel={"compile": True}, scaling={"num_workers": 1},
                                               train={"micro_batch_size": 2, "seq_len": 16}))
    cfg.model.overrides["attention_dropout"] = dropout
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = parallelize(CausalLMWithLoss(build_causal_lm(cfg.model, 512, 0)), cfg.parallel,
                            init_device_mesh("cpu", (1,)), False)
        blocks = heldout.synthetic_heldout(512, 5, 16, seed=0)  # 5 blocks in micro-batches of 2: the last one filled up
        first = blocks.select(torch.arange(2))
        model(input_ids=first.input_ids, labels=first.labels, position_ids=first.position_ids)[0].backward()
        graphs = counters["stats"]["unique_graphs"]
        outputs, alive = [], []  # each forward's loss; how many earlier ones are still alive as the next begins
        model.register_forward_pre_hook(lambda *_: alive.append(sum(ref() is not None for ref in outputs)))
        model.register_forward_hook(lambda module, args, out: outputs.append(weakref.ref(out[0])))
        loss = heldout.evaluate(model, blocks, cfg, 0, 1, torch.device("cpu"))
        assert alive == [0, 0, 0]  # 3 micro-batches, and no batch's graph (activations) outlives it
        assert (counters["stats"]["unique_graphs"] == graphs) == (dropout == 0.0)
        assert model.training and all(p.grad is not None for p in model.parameters())  # left as training found it
        model.eval()
        with torch.no_grad():
            total, n = model(input_ids=blocks.input_ids, labels=blocks.labels, position_ids=blocks.position_ids)
        assert loss == pytest.approx((total / n).item(), rel=1e-5)
    finally:
        dist.destroy_process_group()


def test_generated_lengths_count_up_to_the_first_eos_and_quantiles_name_the_tail():
    eos = 2
    new = torch.tensor([[5, 2, 0, 0], [5, 5, 5, 2], [5, 5, 5, 5], [2, 2, 0, 0]])
    assert generate.generated_lengths(new, eos) == [2, 4, 4, 1]
    assert generate.generated_lengths(new, None) == [4, 4, 4, 4]
    assert task.length_quantiles(list(range(1, 101))) == {"p50": 51, "p90": 91, "p99": 100, "max": 100}
    assert task.length_quantiles([]) == {}


# ---- the task baseline beside the first held-out evaluation -----------------------------------------------------------


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of one rank, for the task record's all-reduce."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _baseline_part(tmp_path, records, rank=0, world=1):
    """A `TaskEvaluation` of a tiny random Qwen2 (not sharded) on BPE-tokenized GSM8K-style items, on CPU, logging
    into `records`."""
    from types import SimpleNamespace

    from job.common import sources
    from job.worker.metrics import Timeline
    from job.worker.model.causal_lm import CausalLMWithLoss
    from tests.test_generate import tiny_lm

    tok = sources.train_bpe_tokenizer([f"Question: what is {i} + 4?\nAnswer: #### {i + 4}" for i in range(20)], 64)
    items = [{"question": f"q{i}", "prompt": f"Question: what is {i} + 4?\nAnswer: ", "reference": f"#### {i + 4}"}
             for i in range(5)]
    cfg = SimpleNamespace(eval=SimpleNamespace(task="gsm8k", task_max_examples=0, task_batch_size=2,
                                               task_max_new_tokens=20, task_log_examples=5))
    lm = tiny_lm(vocab_size=len(tok))
    lm.config.eos_token_id = tok.eos_token_id
    device = torch.device("cpu")
    worker = SimpleNamespace(cfg=cfg, device=device, rank=rank, world=world, bf16=False,
                             timeline=Timeline(0.0, device), log=records.append)
    return task.TaskEvaluation(worker, CausalLMWithLoss(lm), None, tok, items, start_step=0, baseline=None)


def test_the_task_baseline_decodes_in_a_thread_and_is_charged_only_its_wait(tmp_path, monkeypatch, one_rank):
    """`start_baseline` decodes on a copy of the not yet sharded model in a thread while the main thread works
    (the data's tokenizing), capturing no CUDA graph until the main thread waits for it; `finish_pending` charges the
    `task_eval` phase only the wait. Without it (no room beside), `baseline_at_step_0` decodes at once, inside the
    phase: the same record either way."""
    import threading
    from types import SimpleNamespace

    records = []
    part = _baseline_part(tmp_path, records)
    threads, decoded, capture_allowed = [], threading.Event(), []
    decode = task.task_decode

    def task_decode(*args):
        threads.append(threading.current_thread())
        capture_allowed.append(args[7] if len(args) > 7 else None)
        share = decode(*args)
        decoded.set()
        return share

    monkeypatch.setattr(task, "task_decode", task_decode)
    pending = task.start_baseline(part.model, part.tokenizer, part.items, part.worker.cfg, 0, 1, part.worker.device,
                                  bf16=False)
    assert pending.background and decoded.wait(timeout=300)  # the data would be tokenized meanwhile
    (gate,) = capture_allowed
    assert not gate.is_set(), "no capture while the main thread may synchronize the device"
    state = SimpleNamespace(task_results=[])
    part.finish_pending(state, 0, pending)
    assert gate.is_set()

    (record,) = records
    assert threads[0] is not threading.main_thread()
    assert record["kind"] == "task_eval" and record["step"] == 0 and record["n"] == 5 and len(record["examples"]) == 5
    assert record["decode"] == "eager" and record["decode_steps"] > 0
    assert record["seconds"] > 0 and state.task_results == [record]
    # Done before the wait: all of it overlapped, and the phase holds none of it.
    assert record["overlapped_s"] == pytest.approx(record["seconds"], abs=0.05)
    timeline = part.worker.timeline
    assert timeline.seconds["task_eval"] < 0.5

    part.baseline = pending
    monkeypatch.setattr(part, "copy", lambda: pytest.fail("gathered a copy"))
    assert part.baseline_at_step_0() is pending and len(threads) == 1  # nothing gathered, nothing decoded
    records.clear()
    monkeypatch.setattr(part, "copy", lambda: part.model.lm)
    part.baseline = None
    part.finish_pending(state, 0, part.baseline_at_step_0())
    assert threads[1] is threading.main_thread() and capture_allowed[1] is None
    assert records[0]["overlapped_s"] == 0.0 and timeline.seconds["task_eval"] >= records[0]["seconds"]
    same = lambda r: {k: v for k, v in r.items() if k not in ("seconds", "overlapped_s")}  # noqa: E731
    assert same(records[0]) == same(record)


def test_a_background_decoding_needs_room_for_twice_its_kv_cache_beside_the_headroom(tmp_path, monkeypatch):
    part = _baseline_part(tmp_path, [])
    lm, cuda = part.model.lm, torch.device("cuda", 0)  # only a name here: the memory figures are the patched ones
    config = lm.config
    longest = max(len(part.tokenizer(x["prompt"], add_special_tokens=False)["input_ids"]) for x in part.items)
    # Batches of 2: per layer, keys and values of 2 rows x (prompt + 20 new tokens) x kv heads x head dim, fp32.
    cache = 2 * config.num_hidden_layers * 2 * (longest + 20) * config.num_key_value_heads * \
        (config.hidden_size // config.num_attention_heads) * 4
    total = 100 * cache
    cached_unused = 3 * cache  # held by the caching allocator, free to reuse
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 10 * cache)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 10 * cache - cached_unused)
    needed = 2 * cache + task.DECODE_HEADROOM * total
    room = lambda device: task.room_to_decode_beside(device, lm, part.tokenizer, part.items, part.cfg, 0, 1)  # noqa: E731
    for free, fits in ((needed - cached_unused, True), (needed - cached_unused - 1, False)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, total))
        assert room(cuda) is fits
    assert room(torch.device("cpu"))


def _baseline_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """One spawned rank of `test_a_rank_without_room_for_the_baseline_...`: rank 0 began its baseline in `build`,
    rank 1 had no room; a copy is "gathered" by an all-reduce, so a rank gathering alone would block."""
    import datetime
    import json
    import os
    from pathlib import Path
    from types import SimpleNamespace

    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        records = []
        part = _baseline_part(Path(out_dir), records, rank, world)
        if rank == 0:
            part.baseline = task.start_baseline(part.model, part.tokenizer, part.items, part.worker.cfg, rank, world,
                                                part.worker.device, bf16=False)
        gathered = []

        def copy():
            dist.all_reduce(torch.ones(1))
            gathered.append(rank)
            return part.model.lm

        part.copy = copy
        pending = part.baseline_at_step_0()
        part.finish_pending(SimpleNamespace(task_results=[]), 0, pending)
        out = {"gathered": len(gathered), "background": pending.background, "n": records[0]["n"]}
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))


def test_a_rank_without_room_for_the_baseline_makes_every_rank_gather_with_it(tmp_path):
    """The ranks stay in step: when one rank could not begin the baseline beside the build, every rank takes part
    in gathering the copy it decodes on (those with their own decoding then drop it)."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(_baseline_rank, args=(2, port, str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")
    try:
        while not ctx.join(timeout=5):
            pass
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [o["gathered"] for o in outs] == [1, 1]
    assert [o["background"] for o in outs] == [True, False]
    assert [o["n"] for o in outs] == [5, 5]
