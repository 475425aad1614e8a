"""Greedy generation (job/worker/evaluation/generate.py) against Transformers' own greedy loop, token for token, on CPU."""

import threading

import pytest
import torch

from job.worker.evaluation import generate


def tiny_lm(heads: int = 6, kv_heads: int = 2, attention: str = "sdpa", seed: int = 0, vocab_size: int = 64):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=48, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=96, max_position_embeddings=256,
                         tie_word_embeddings=True, initializer_range=0.5)  # wide init: varied greedy tokens
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()


def left_padded_batch():
    torch.manual_seed(1)
    ids = torch.randint(3, 64, (5, 10))
    mask = torch.ones_like(ids)
    mask[1, :3] = mask[3, :6] = mask[4, :9] = 0  # rows of 10, 7, 10, 4 and 1 real tokens
    return ids.masked_fill(mask == 0, 0), mask


def reference(lm, ids, mask, max_new, eos):
    """What Transformers' `generate` decodes, on a copy of `lm` with its stock attention."""
    stock = tiny_lm(lm.config.num_attention_heads, lm.config.num_key_value_heads)
    stock.load_state_dict(lm.state_dict())
    return generate.hf_generate(stock, ids, mask, max_new, eos, pad_token_id=0)


def eos_candidates(full: torch.Tensor, width: int) -> tuple[int, int]:
    """Two stand-in EOS tokens from an EOS-free generation: one that every row produces, first at different
    steps, the last not at a multiple of CHECK_EVERY (so the batch stops early, between two looks); and one
    that some rows produce and others never (so the batch runs to the end)."""
    new = [row[width:].tolist() for row in full]
    first = {t: [row.index(t) if t in row else None for row in new] for t in {t for row in new for t in row}}
    every = [t for t, at in sorted(first.items())
             if None not in at and len(set(at)) > 1 and (max(at) + 1) % CHECK_EVERY]
    some = [t for t, at in sorted(first.items()) if None in at and any(a not in (None, 0) for a in at)]
    return every[0], some[0]


CHECK_EVERY = generate.CHECK_EVERY


@pytest.mark.image_set
@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4)])  # grouped-query attention, and none
def test_greedy_generate_is_transformers_generate_token_for_token(heads, kv_heads):
    lm = tiny_lm(heads, kv_heads)
    ids, mask = left_padded_batch()
    want = reference(lm, ids, mask, 30, eos=None)
    got = generate.greedy_generate(lm, ids, mask, 30, eos_token_id=None, pad_token_id=0)
    assert got.decode == "eager"  # on CPU
    assert torch.equal(got.ids, want)

    # Stopping at EOS: rows end at different steps and are padded after it, and the output is cut where
    # `generate` stops, although the loop only looks every CHECK_EVERY steps; or it runs to the end when a row
    # never produces EOS.
    every, some = eos_candidates(want, ids.shape[1])
    for eos, stops_early in ((every, True), (some, False)):
        want_eos = reference(lm, ids, mask, 30, eos=eos)
        got = generate.greedy_generate(lm, ids, mask, 30, eos_token_id=eos, pad_token_id=0)
        assert (want_eos.shape[1] < ids.shape[1] + 30) == stops_early
        assert torch.equal(got.ids, want_eos)


@pytest.mark.image_set
def test_one_new_token_is_the_prefill_s():
    lm = tiny_lm()
    ids, mask = left_padded_batch()
    assert torch.equal(generate.greedy_generate(lm, ids, mask, 1, None, 0).ids, reference(lm, ids, mask, 1, None))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate.greedy_generate(lm, ids, mask, 0, None, 0)


class ReplayedStep:
    """Stands in for a captured CUDA graph: each replay runs the step it was captured from."""

    def __init__(self, decoder):
        self.decoder, self.replays = decoder, 0

    def replay(self):
        self.replays += 1
        self.decoder.step()


def test_graph_replays_take_over_after_the_eager_warm_up_steps():
    """The bookkeeping around the capture (which the CPU cannot do): capturing runs no step, the warm-up steps
    run eagerly, every later step is a replay, and the result is `generate`'s."""
    lm = tiny_lm()
    ids, mask = left_padded_batch()
    generate.use_grouped_decode(lm)
    decoder = generate.StaticDecoder(lm, ids, mask, 20, eos_token_id=None, pad_token_id=0)
    graphs = []
    decoder.capture = lambda: (graphs.append(ReplayedStep(decoder)) or graphs[-1], "cuda_graph")
    assert decoder.run(cuda_graph=True) == "cuda_graph"
    assert len(graphs) == 1 and graphs[0].replays == 20 - 1 - generate.WARMUP_STEPS
    assert torch.equal(torch.cat([ids, decoder.new_tokens()], 1), reference(lm, ids, mask, 20, None))


def test_a_failed_capture_goes_on_eagerly_and_says_why():
    lm = tiny_lm()
    ids, mask = left_padded_batch()
    generate.use_grouped_decode(lm)
    decoder = generate.StaticDecoder(lm, ids, mask, 12, eos_token_id=None, pad_token_id=0)
    decoder.capture = lambda: (None, "eager (CUDA graph capture failed: RuntimeError: not capturable)")
    assert decoder.run(cuda_graph=True).startswith("eager (CUDA graph capture failed")
    assert torch.equal(torch.cat([ids, decoder.new_tokens()], 1), reference(lm, ids, mask, 12, None))


def test_a_decoding_beside_other_work_captures_only_once_allowed():
    """A decoding in a thread beside other device work (the task baseline beside the data and the model's build)
    steps eagerly until `capture_allowed` is set, since a capture would fail that work's device-wide synchronizes;
    then it captures and replays as usual, and the result is still `generate`'s."""
    lm = tiny_lm()
    ids, mask = left_padded_batch()
    generate.use_grouped_decode(lm)
    decoder = generate.StaticDecoder(lm, ids, mask, 20, eos_token_id=None, pad_token_id=0)
    allowed, events, step = threading.Event(), [], decoder.step
    allowed_after = generate.WARMUP_STEPS + 4

    class Replayed:
        def replay(self):
            events.append("replay")
            step()

    def eager_step():
        events.append("eager")
        step()
        if events.count("eager") == allowed_after:
            allowed.set()  # the other thread now only waits for this one

    decoder.step = eager_step
    decoder.capture = lambda: (events.append("capture"), (Replayed(), "cuda_graph"))[1]
    assert decoder.run(cuda_graph=True, capture_allowed=allowed) == "cuda_graph"
    assert events == ["eager"] * allowed_after + ["capture"] + ["replay"] * (20 - 1 - allowed_after)
    assert torch.equal(torch.cat([ids, decoder.new_tokens()], 1), reference(lm, ids, mask, 20, None))


def test_the_generation_copy_switches_its_own_attention_not_the_training_models():
    from job.worker.model.causal_lm import CausalLMWithLoss
    from job.worker.model.parallelize import gathered_copy

    model = CausalLMWithLoss(tiny_lm())
    copy = gathered_copy(model, torch.float32, torch.device("cpu"))
    generate.use_grouped_decode(copy)
    assert copy.config._attn_implementation == generate.GROUPED_DECODE
    assert model.lm.config._attn_implementation == "sdpa"
    assert all(torch.equal(a, b) for a, b in zip(copy.state_dict().values(), model.lm.state_dict().values()))


def test_models_it_does_not_cover_go_through_generate():
    lm = tiny_lm(attention="eager")
    ids, mask = left_padded_batch()
    got = generate.greedy_generate(lm, ids, mask, 8, None, 0)
    assert got.decode == "generate (attention eager)"
    assert torch.equal(got.ids, generate.hf_generate(lm, ids, mask, 8, None, 0))


@pytest.mark.image_set
def test_grouped_decode_attention_is_repeated_key_value_attention_and_decode_steps_use_it(monkeypatch):
    """`sdpa_grouped_decode` against attention over explicitly repeated key/value heads (what Transformers' SDPA
    path computes with a mask), for a left-padded decode step; then every decode step of a generation goes
    through its grouped branch."""
    torch.manual_seed(0)
    batch, kv_heads, groups, length, dim = 3, 2, 3, 9, 8
    query = torch.randn(batch, kv_heads * groups, 1, dim)
    key, value = torch.randn(2, batch, kv_heads, length, dim)
    mask = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    mask[1, ..., :4] = False  # a left-padded row
    module = torch.nn.Module()
    module.num_key_value_groups = groups
    out, _ = generate.sdpa_grouped_decode(module, query, key, value, mask, scaling=0.3)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), attn_mask=mask, scale=0.3)
    assert out.shape == (batch, 1, kv_heads * groups, dim)
    torch.testing.assert_close(out, expected.transpose(1, 2))

    grouped_steps = []
    real = generate.sdpa_grouped_decode

    def counting(module, query, *args, **kwargs):
        grouped_steps.append(query.shape[2] == 1)
        return real(module, query, *args, **kwargs)

    monkeypatch.setattr(generate, "sdpa_grouped_decode", counting)
    lm = tiny_lm()
    ids, pad = left_padded_batch()
    generate.greedy_generate(lm, ids, pad, 12, eos_token_id=None, pad_token_id=0)
    assert lm.config._attn_implementation == generate.GROUPED_DECODE
    assert grouped_steps.count(True) == 11 * lm.config.num_hidden_layers  # every decode step after the prefill


@pytest.mark.image_set  # the cache's rows are Transformers' internals: checked on the image's version too
def test_rows_that_ended_leave_the_steps_and_the_step_is_captured_again(monkeypatch):
    """Rows ending at different steps are dropped (their cache rows too) once few enough are still going; each
    smaller batch runs one eager step and is then captured again, and the replays run the batch last captured. The
    output is still `generate`'s, token for token, the dropped rows padded after their EOS."""
    monkeypatch.setattr(generate, "CHECK_EVERY", 2)
    lm = tiny_lm()
    torch.manual_seed(2)
    ids = torch.randint(3, 64, (12, 6))
    mask = torch.ones_like(ids)
    mask[::3, :4] = 0  # some left-padded rows
    ids = ids.masked_fill(mask == 0, 0)
    every, _ = eos_candidates(reference(lm, ids, mask, 40, eos=None), ids.shape[1])
    want = reference(lm, ids, mask, 40, eos=every)
    generate.use_grouped_decode(lm)
    decoder = generate.StaticDecoder(lm, ids, mask, 40, eos_token_id=every, pad_token_id=0)
    events = []  # ("eager" | "capture" | "replay" | "drop", rows decoded)
    step, drop = decoder.step, decoder.drop_ended

    class Replayed:
        def replay(self):
            events.append(("replay", decoder.rows.numel()))
            step()

    decoder.step = lambda: (events.append(("eager", decoder.rows.numel())), step())
    decoder.drop_ended = lambda: (drop(), events.append(("drop", decoder.rows.numel())))
    decoder.capture = lambda: (events.append(("capture", decoder.rows.numel())), (Replayed(), "cuda_graph"))[1]
    assert decoder.run(cuda_graph=True) == "cuda_graph"

    assert torch.equal(torch.cat([ids, decoder.new_tokens()], 1), want)
    batches = [n for kind, n in events if kind == "drop"]
    assert len(batches) >= 2 and batches == sorted(batches, reverse=True) and batches[-1] < 12
    assert all(layer.keys.shape[0] == batches[-1] for layer in decoder.cache.layers)
    captured = None
    for i, (kind, n) in enumerate(events):
        if kind == "drop":  # the next step runs eagerly on the smaller batch, the one after is a new capture
            assert events[i + 1] == ("eager", n) and events[i + 2] == ("capture", n)
            captured = None
        elif kind == "capture":
            captured = n
        elif kind == "replay":
            assert n == captured


# ---- sampling (the pairs a model makes itself) -----------------------------------------------------------------------


def first_token_draws(lm, sampling: generate.Sampling, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first sampled token of `rows` copies of one prompt, and the reference distribution: the softmax of the
    model's own last logits / temperature, computed by Transformers' forward."""
    prompt = torch.randint(3, 16, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        probs = torch.softmax(lm(prompt).logits[0, -1].double() / sampling.temperature, dim=-1)
    ids = prompt.expand(rows, -1).contiguous()
    out = generate.greedy_generate(lm, ids, torch.ones_like(ids), 1, None, 0, sampling=sampling).ids[:, -1]
    return torch.bincount(out, minlength=probs.numel()).double() / rows, probs


def test_sampling_draws_tokens_as_the_softmax_of_the_logits_says():
    lm = tiny_lm(vocab_size=16)
    freq, probs = first_token_draws(lm, generate.Sampling(temperature=0.7, top_p=1.0, seed=0), rows=4000)
    assert (freq - probs).abs().max() < 4 * (probs * (1 - probs) / 4000).sqrt().max() + 1e-3
    # Nucleus: only the likeliest tokens whose probability reaches top_p, in proportion to theirs.
    freq, probs = first_token_draws(lm, generate.Sampling(temperature=1.0, top_p=0.6, seed=1), rows=4000)
    ordered, order = probs.sort(descending=True)
    nucleus = order[: int((ordered.cumsum(0) < 0.6).sum()) + 1]
    assert set(freq.nonzero().flatten().tolist()) <= set(nucleus.tolist()) and len(nucleus) > 1
    kept = probs[nucleus] / probs[nucleus].sum()
    assert (freq[nucleus] - kept).abs().max() < 4 * (kept * (1 - kept) / 4000).sqrt().max() + 1e-3


def test_sampling_is_seeded_and_a_tiny_nucleus_is_greedy():
    lm = tiny_lm()
    ids, mask = left_padded_batch()
    greedy = generate.greedy_generate(lm, ids, mask, 20, eos_token_id=None, pad_token_id=0).ids
    narrow = generate.greedy_generate(lm, ids, mask, 20, None, 0, sampling=generate.Sampling(1.0, 1e-6, seed=0)).ids
    assert torch.equal(narrow, greedy)
    draw = lambda seed: generate.greedy_generate(lm, ids, mask, 20, None, 0,  # noqa: E731
                                                 sampling=generate.Sampling(1.5, 1.0, seed=seed)).ids
    assert torch.equal(draw(3), draw(3)) and not torch.equal(draw(3), draw(4)) and not torch.equal(draw(3), greedy)
