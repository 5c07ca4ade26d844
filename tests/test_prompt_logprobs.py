"""Prompt logprobs (vLLM's `prompt_logprobs`, OpenAI's `echo`) are the training forward's bits.

* Each prompt position's logprob the engine reports equals, bit for bit, `model.token_logprobs`
  of the prompt, in fp32 and bf16, cold and with the prompt's prefix in the prefix cache, and
  with other requests in the batch.
* The top k are the sampler's: at a prompt's last position they equal, bit for bit, the top
  logprobs the sampler reports for the token generated there; a token's rank counts the tokens
  strictly more likely, and its value is the one its top entry holds.
* Twin: with stock ops ("torch" mode) the training forward's logprobs of a sequence change with
  its batch, the drift the engine's single-prompt forward would otherwise inherit.
"""
from __future__ import annotations

import pytest
import torch

import tonp_kernels as tk
from conftest import assert_bitwise, num_threads
from test_generation import prompts, tiny_model
from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM
from tonp_models.engine import Engine, Request, SamplingParams


def _run(engine: Engine, reqs):
    for r in reqs:
        engine.add(r)
    while engine.has_work:
        engine.step()
    return reqs


def _values(r: Request) -> torch.Tensor:
    return torch.tensor([p.logprob for p in r.prompt_logprobs], dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prompt_logprobs_equal_the_training_forward_cold_and_cached(dtype):
    model = tiny_model(dtype)
    p, other = (x.tolist() for x in prompts((45, 30), seed=31))
    with torch.no_grad():
        want = model.token_logprobs([torch.tensor(p)])[0]
    engine = Engine(model, max_batch_size=4, max_step_tokens=16)
    cold, = _run(engine, [Request("cold", p, SamplingParams(3, prompt_logprobs=4))])
    assert cold.cache_hit == 0
    assert_bitwise(_values(cold), want, "cold")
    # the same prompt again, beside another request: its generation reads the prefix cache
    hot, _ = _run(engine, [Request("hot", p, SamplingParams(3, prompt_logprobs=4)),
                           Request("other", other, SamplingParams(3, temperature=1.0))])
    assert hot.cache_hit > 0
    assert_bitwise(_values(hot), want, "prefix-cache hit")
    assert [q.rank for q in hot.prompt_logprobs] == [q.rank for q in cold.prompt_logprobs]


def test_prompt_top_logprobs_are_the_samplers():
    model = tiny_model(torch.float32)
    p = prompts((20,), seed=32)[0].tolist()
    engine = Engine(model, max_batch_size=2)
    gen, = _run(engine, [Request("g", p, SamplingParams(1, temperature=0.8, seed=4,
                                                         top_logprobs=5))])
    tok = gen.completion[0]
    scored, = _run(engine, [Request("s", p + [tok], SamplingParams(
        0, temperature=0.8, prompt_logprobs=5))])
    last = scored.prompt_logprobs[-1]
    assert last.logprob == gen.logprobs[0] and last.top == gen.top_logprobs[0]
    for q, t in zip(scored.prompt_logprobs, p[1:] + [tok]):
        assert len(q.top) == 5
        above = sum(v > q.logprob for _, v in q.top)
        assert q.rank == 1 + above if above < 5 else q.rank >= 6
        if t in dict(q.top):
            assert dict(q.top)[t] == q.logprob and q.rank <= 5


def test_max_new_tokens_0_scores_the_prompt_only():
    model = tiny_model(torch.float32)
    p = prompts((9,), seed=33)[0].tolist()
    engine = Engine(model, max_batch_size=2)
    r, = _run(engine, [Request("z", p, SamplingParams(0, prompt_logprobs=0))])
    assert r.finish == "length" and r.completion == [] and len(r.prompt_logprobs) == 8
    assert all(q.top == [] for q in r.prompt_logprobs)
    one, = _run(engine, [Request("one", p[:1], SamplingParams(0, prompt_logprobs=2))])
    assert one.prompt_logprobs == []


def _wide_model():
    """One dense layer of hidden size 1024: MKL's fp32 GEMMs there change their blocking with M
    on CPUs (an AVX-512 Xeon) where the tiny model's narrow ones happen not to."""
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig.preset("tiny", num_hidden_layers=1, hidden_size=1024, intermediate_size=256,
                                mlp_only_layers=[0])
    return Qwen3MoeForCausalLM(cfg, dtype=torch.float32).eval()


def test_twin_stock_ops_change_a_sequences_logprobs_with_its_batch():
    """Stock ops (MKL GEMMs split by M over 2 threads) give a sequence other bits in some batch
    arrangement of some model (the tiny one on AMD EPYC; at 1 thread MKL happens to agree on it,
    and on an Intel Xeon it agrees at 2 as well, where the wider model's GEMMs do not); tonp's
    kernels give the same bits in every one, at 1 and 2 threads."""
    p, *others = prompts((45, 70, 9, 33, 101, 250, 400), seed=31)
    batches = [[p] + others[:k] for k in range(1, len(others) + 1)] + [others[::-1] + [p]]
    models = (tiny_model(torch.float32), _wide_model())
    stock_differs = False
    for model in models:
        with tk.use("torch"), torch.no_grad(), num_threads(2):
            alone = model.token_logprobs([p])[0]
            stock = [model.token_logprobs(b)[[x is p for x in b].index(True)] for b in batches]
        stock_differs |= any(not torch.equal(alone, s) for s in stock)
    assert stock_differs, "precondition: stock ops gave the same bits in every batch of both models"
    for model in models:
        with torch.no_grad():   # tonp's kernels: the same bits either way
            mine = model.token_logprobs([p])[0]
        for threads in (1, 2):
            with torch.no_grad(), num_threads(threads):
                for b in batches:
                    got = model.token_logprobs(b)[[x is p for x in b].index(True)]
                    assert torch.equal(mine, got), f"{threads} thread(s), batch of {len(b)}"


def _scored_after_a_hit(model, a, b):
    """Prompt b's logprobs as an engine that reads them off its prefill would get them after a
    prefix-cache hit on a (vLLM's way): b's rows past the cached prefix fed through the cache."""
    from test_engine import _feed
    from tonp_models.engine import PageAllocator, PrefixCache
    cache = PageAllocator(model.new_cache(4, 64))
    prefix = PrefixCache(cache)
    _feed(model, cache, prefix, a)
    logits, n = _feed(model, cache, prefix, b)                  # rows n.. of b, cache hit
    lsm = torch.log_softmax(logits[:-1].double(), -1).float()  # stock log-softmax either way
    return lsm.gather(1, torch.tensor(b[n + 1:]).unsqueeze(1)).squeeze(1), n


def test_twin_stock_ops_score_a_prompt_differently_after_a_cache_hit():
    """The seam scores the prompt with one forward without the cache, so a hit cannot change
    its bits. Reading them off a cached prefill instead keeps them only on tonp's kernels:
    with stock ops the rows after the hit differ from the training forward (at any thread
    count: the attention over cached pages is another computation)."""
    model = tiny_model(torch.float32)
    a = prompts((40,), seed=4)[0].tolist()
    b = a + [9, 8, 7, 6, 5, 4]

    def pair():
        hit, n = _scored_after_a_hit(model, a, b)
        train = torch.log_softmax(model(torch.tensor(b), torch.tensor(
            [0, len(b)], dtype=torch.int32)).double(), -1).float()
        return hit, train[n:-1].gather(1, torch.tensor(b[n + 1:]).unsqueeze(1)).squeeze(1)
    with tk.use("torch"), torch.no_grad():
        hit, train = pair()
    assert len(hit) == 5 and not torch.equal(hit, train), \
        "precondition: stock ops agreed after a hit"
    with torch.no_grad():
        hit, train = pair()
    assert torch.equal(hit, train)
