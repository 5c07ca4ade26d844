"""The rollout engine (tonp_models.engine) keeps every bit while requests come and go.

* "a cache hit changes no bit": a request's logits are the same whether its prefix K/V came from
  the prefix cache (whole pages shared, the boundary page forked) or were computed for it, and
  the same as the training forward's; twin: with stock torch ops they differ.
* "G samples of a prompt prefill it once", with and without chunked prefill.
* "chunked prefill changes no bit": a step feeds at most max_step_tokens, a long prompt is
  prefilled over several steps while another request keeps decoding; twin: not so in torch mode.
* "requests join and leave at any step", each with its own settings: each gets what it gets
  alone; aborted requests free their pages; a full cache makes requests wait, never fail.
"""
from __future__ import annotations

import pytest
import torch

import tonp_kernels as tk
from conftest import assert_bitwise
from test_generation import prompts, tiny_model
from tonp_models import generate
from tonp_models.layers import CacheFullError
from tonp_models.engine import (Engine, PageAllocator, PrefixCache, Request, SamplingParams,
                                extend, rules)
from tonp_models.engine.prefix_cache import Match

B = 16  # the tiny preset's attention block = page size


def _feed(model, cache, prefix, tokens):
    """Admit `tokens` into a new slot from the longest cached prefix (none without `prefix`)
    and feed the rest in one forward -> (logits of the fed rows, positions taken from cache)."""
    m = prefix.match(tokens, len(tokens) - 1) if prefix is not None else Match()
    slot = cache.add_sequence()
    cache.attach(slot, m.pages)
    if m.fork:
        cache.fork(slot, *m.fork)
    with torch.no_grad():
        logits = extend(model, cache, torch.tensor(tokens[m.length:]), [slot])
    if prefix is not None:
        prefix.note(slot, tokens, list(m.keys), m.length, len(tokens))
    return logits, m.length


def _variants(a):
    """Prompts against a cached 40-token prompt a: (name, tokens, positions the cache holds)."""
    other = [(t + 1) % 256 for t in a]
    return [("a again (2 pages shared, 7 rows forked)", a, 39),
            ("a + 5 tokens (2 pages, 8 rows forked)", a + [9, 8, 7, 6, 5], 40),
            ("a[:32], whole pages (1 page, 15 rows forked)", a[:32], 31),
            ("a[:20] (1 page, 3 rows forked)", a[:20], 19),
            ("a[:10] + other (9 rows forked)", a[:10] + other[10:30], 10),
            ("a[:16] + other (1 page shared)", a[:16] + other[16:30], 16),
            ("nothing in common", other, 0)]


def test_prefix_cache_hit_changes_no_bit():
    model = tiny_model(torch.float32)
    a = prompts((40,), seed=4)[0].tolist()
    cache = PageAllocator(model.new_cache(16, 64))
    prefix = PrefixCache(cache)
    _feed(model, cache, prefix, a)
    for name, tokens, cached in _variants(a):
        hit, n = _feed(model, cache, prefix, tokens)
        assert n == cached, f"{name}: {n} positions from the cache, expected {cached}"
        with torch.no_grad():
            full = model(torch.tensor(tokens))                          # training forward
        assert_bitwise(hit, full[n:], f"{name}: logits with the cache hit vs the full pass")
        miss, _ = _feed(model, cache, None, tokens)
        assert_bitwise(hit, miss[n:], f"{name}: logits with vs without the cache hit")


def test_prefix_cache_hit_changes_bits_with_stock_torch(torch_mode):
    """Twin: with stock torch ops (SDPA-style attention, MKL linears chosen by M) the rows fed
    after a cache hit differ from the same rows computed with the whole prompt."""
    model = tiny_model(torch.float32)
    a = prompts((40,), seed=4)[0].tolist()
    cache = PageAllocator(model.new_cache(16, 64))
    prefix = PrefixCache(cache)
    _feed(model, cache, prefix, a)
    differ = []
    for name, tokens, _ in _variants(a)[:-1]:
        hit, n = _feed(model, cache, prefix, tokens)
        miss, _ = _feed(model, cache, None, tokens)
        differ.append(not torch.equal(hit, miss[n:]))
    assert any(differ), "stock torch unexpectedly gave the same bits with and without the hit"


@pytest.mark.parametrize("max_step_tokens", [None, 24])
def test_grpo_group_prefills_its_prompt_once(max_step_tokens):
    """P prompts x G samples: each prompt's tokens go through the model once (the other samples
    feed only its last token), and the rollouts are the bits of the uncached engine's."""
    model = tiny_model(torch.float32)
    lens, G = (37, 5, 16, 48), 4
    group = [p for p in prompts(lens) for _ in range(G)]
    kw = dict(temperature=1.0, seed=3, max_batch_size=8, max_step_tokens=max_step_tokens)
    cached = generate(model, group, 8, **kw)
    plain = generate(model, group, 8, prefix_cache=False, **kw)
    assert cached.stats.prefill_tokens == sum(lens) + len(lens) * (G - 1)
    assert cached.stats.cached_tokens == sum(n - 1 for n in lens) * (G - 1)
    assert plain.stats.prefill_tokens == sum(lens) * G and plain.stats.cached_tokens == 0
    for i, (x, y) in enumerate(zip(cached.sequences, plain.sequences)):
        assert_bitwise(x, y, f"tokens of sample {i}")
        assert_bitwise(cached.logprobs[i], plain.logprobs[i], f"logprobs of sample {i}")
    assert len({tuple(s.tolist()) for s in cached.sequences[:G]}) > 1, "samples all equal"
    train = model.token_logprobs(cached.sequences, temperature=1.0)
    for i, (t, lp, p) in enumerate(zip(train, cached.logprobs, cached.prompt_lengths)):
        assert_bitwise(t[p - 1:], lp, f"training forward vs rollout of sample {i}")


class _Recorder:
    """The model, recording the tokens each forward feeds (the engine takes anything with
    forward, config and new_cache)."""

    def __init__(self, model):
        self.model, self.config, self.new_cache, self.fed = model, model.config, \
            model.new_cache, []

    def __call__(self, ids, *args, **kwargs):
        self.fed.append(len(ids))
        return self.model(ids, *args, **kwargs)


def _run(engine, schedule=None):
    """Step until idle; schedule {step: callable(engine)} adds or aborts at given steps.
    -> {key: [per-step token counts]}: how many steps each request got a token in."""
    steps, seen = 0, {}
    while engine.has_work or (schedule and max(schedule) >= steps):
        if schedule and steps in schedule:
            schedule[steps](engine)
        for out in engine.step():
            if out.token is not None:
                seen.setdefault(out.request.key, []).append(steps)
        steps += 1
    return seen


def test_chunked_prefill_keeps_decoding_and_changes_no_bit():
    model = tiny_model(torch.float32)
    short, long = prompts((6, 150), seed=5)
    rec = _Recorder(model)
    engine = Engine(rec, max_batch_size=4, max_step_tokens=20, max_seq_len=200)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=9)
    reqs = {k: Request(k, p.tolist(), params, noise_key=i)
            for i, (k, p) in enumerate((("short", short), ("long", long)))}
    seen = _run(engine, {0: lambda e: e.add(reqs["short"]), 2: lambda e: e.add(reqs["long"])})
    assert max(rec.fed) <= 20 and sum(rec.fed) == 6 + 150 + 11 + 11
    # the long prompt needs 8 prefill steps (150 tokens, 19 a step beside the decode): the short
    # request decoded in each of them
    first_long = seen["long"][0]
    assert first_long >= 2 + 150 // 19
    assert set(range(2, first_long)) <= set(seen["short"])
    want = generate(model, [short, long], 12, temperature=1.0, seed=9, request_ids=[0, 1])
    for i, k in enumerate(("short", "long")):
        assert_bitwise(torch.tensor(reqs[k].tokens), want.sequences[i], f"{k}: tokens")
        assert_bitwise(torch.tensor(reqs[k].logprobs), want.logprobs[i], f"{k}: logprobs")


def test_chunked_prefill_changes_bits_with_stock_torch(torch_mode):
    model = tiny_model(torch.float32)
    ps = prompts((150, 70), seed=5)
    whole = generate(model, ps, 4, prefix_cache=False)
    chunked = generate(model, ps, 4, prefix_cache=False, max_step_tokens=16)
    assert any(not torch.equal(a, b) for a, b in zip(whole.logprobs, chunked.logprobs))


def test_requests_join_and_leave_at_any_step_with_their_own_settings():
    """Requests added at steps 0, 1, 3, 7 with other temperatures, top-k/p, seeds, eos and max
    tokens; one aborted mid-way: each finished one gets the bits of a generate call alone."""
    model = tiny_model(torch.float32)
    ps = prompts((5, 16, 33, 9, 24), seed=6)
    settings = [SamplingParams(10, 0.0), SamplingParams(7, 1.0, seed=4),
                SamplingParams(12, 0.7, top_k=20, seed=5), SamplingParams(9, 1.3, top_p=0.9),
                SamplingParams(6, 1.0, seed=4)]
    reqs = [Request(i, p.tolist(), s, noise_key=10 + i, name=str(i))
            for i, (p, s) in enumerate(zip(ps, settings))]
    free = generate(model, [ps[1]], 7, temperature=1.0, seed=4, request_ids=[11])
    eos = int(free.completions[0][4])                  # request 1 ends at its 5th token
    reqs[1].params = SamplingParams(7, 1.0, seed=4, eos_token_ids=frozenset([eos]))
    engine = Engine(model, max_batch_size=3, num_pages=12)
    schedule = {0: lambda e: e.add(reqs[0]), 1: lambda e: (e.add(reqs[1]), e.add(reqs[2])),
                3: lambda e: e.add(reqs[3]), 5: lambda e: e.abort(2),
                7: lambda e: e.add(reqs[4])}
    _run(engine, schedule)
    assert reqs[2].finish == "abort" and reqs[1].finish == "eos"
    for r in reqs:
        if r.finish == "abort":
            continue
        p = r.params
        want = generate(model, [ps[r.key]], p.max_new_tokens, temperature=p.temperature,
                        top_k=p.top_k, top_p=p.top_p, seed=p.seed, request_ids=[r.noise_key],
                        eos_token_id=list(p.eos_token_ids) or None)
        assert_bitwise(torch.tensor(r.tokens), want.sequences[0], f"request {r.key}: tokens")
        assert_bitwise(torch.tensor(r.logprobs), want.logprobs[0], f"request {r.key}: logprobs")
        assert r.finish == want.finish_reasons[0]
    assert engine.cache.used_pages == 0 and not engine.requests
    assert engine.cache.free_slots == 3


def test_ranked_is_the_head_of_a_stable_descending_sort():
    """The top logprobs' ranking (engine/sampling.py `ranked`, topk's cut and a sort of the
    candidates only) is the first k of each row's stable descending sort, ids and value bits:
    ties at the cut and inside the top k (lower id first), -0 / +0, -inf entries, an all-equal
    row, a NaN row (the full sort's order), k beyond the vocabulary. The twin: torch.topk's own
    ids on ties are not the stable sort's (the candidates must be sorted again)."""
    from tonp_models.engine.sampling import ranked
    ties = torch.tensor([[1.0, 3.0, 2.0, 2.0, 2.0, 2.0, 0.5, 2.0, -1.0, 2.0] * 50])
    stable = torch.sort(ties, dim=-1, descending=True, stable=True).indices[:, :5]
    assert not torch.equal(torch.topk(ties, 5).indices, stable)
    assert torch.equal(ranked(ties, 5)[0], stable)
    g = torch.Generator().manual_seed(3)
    for V in (1, 3, 8, 50, 1000):
        x = torch.randn(7, V, generator=g).log_softmax(-1)
        x[1] = torch.round(x[1] * 2) / 2
        x[2, ::2] = float("-inf")
        x[3] = 0.0
        x[3, ::3] = -0.0
        x[4] = -1.0
        x[5, V // 2] = float("nan")
        x[6, 0] = float("-inf")
        for k in (1, 2, 5, 20, 2000):
            vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)
            got_ids, got_vals = ranked(x, k)
            assert torch.equal(got_ids, ids[:, :k]), (V, k)
            assert torch.equal(got_vals.view(torch.int32), vals[:, :k].view(torch.int32)), (V, k)


def test_top_logprobs_are_the_log_softmax_and_hold_the_chosen_token():
    model = tiny_model(torch.float32)
    p = prompts((9,), seed=7)[0]
    engine = Engine(model, max_batch_size=2)
    r = Request("x", p.tolist(), SamplingParams(5, 0.8, seed=1, top_logprobs=320))
    engine.add(r)
    _run(engine)
    seq = torch.tensor(r.tokens)
    with torch.no_grad():
        lsm = tk.log_softmax(model(seq[:-1])[len(p) - 1:], temperature=0.8)
    for j, top in enumerate(r.top_logprobs):
        ids, vals = zip(*top)
        assert_bitwise(torch.tensor(vals), lsm[j][list(ids)], f"step {j}: top logprobs")
        assert list(vals) == sorted(vals, reverse=True) and len(set(ids)) == 320
        assert dict(top)[r.tokens[len(p) + j]] == r.logprobs[j]


def test_full_cache_makes_requests_wait_and_lru_keeps_what_is_used():
    """Twelve requests through 6 pages: all finish (waiting or preempted, never failed), the
    pages in use are never evicted, and once idle every page is free or cached."""
    model = tiny_model(torch.float32)
    ps = prompts((20, 20, 30, 5, 12, 40, 20, 33, 7, 19, 25, 31), seed=8)
    ps[1] = ps[0].clone()                                      # a repeated prompt
    engine = Engine(model, max_batch_size=4, num_pages=6)
    reqs = [Request(i, p.tolist(), SamplingParams(20, 1.0, seed=2), noise_key=i)
            for i, p in enumerate(ps)]
    for r in reqs:
        engine.add(r)
    evicted = []
    forget = engine.cache.on_evict

    def on_evict(page):
        assert not engine.cache.is_held(page), f"page {page} evicted while in use"
        evicted.append(page)
        forget(page)
    engine.cache.on_evict = on_evict
    _run(engine)
    assert all(r.finish == "length" for r in reqs) and engine.stats.preemptions > 0
    assert evicted and engine.cache.used_pages == 0 and engine.cache.free_pages == 6
    assert sum(engine.cache.refs) == 0 and engine.prefix.num_pages <= 6
    want = generate(model, ps, 20, temperature=1.0, seed=2, prefix_cache=False)
    for r in reqs:
        assert_bitwise(torch.tensor(r.logprobs), want.logprobs[r.key], f"request {r.key}")


def test_a_prefix_hit_that_does_not_fit_beside_its_source_is_recomputed():
    """One page in all: the second prompt's partial-page hit would need its source page and a
    private copy at once, so it is recomputed (a miss, the source evicted), never a failure."""
    model = tiny_model(torch.float32)
    B = model.config.attention_block
    first = list(range(1, B - 6))                         # 9 tokens + 4 new: one page
    second = first[:6] + [99]                              # shares 6 positions of that page
    for batch in (1, 2):                                   # the cache: 1 page, then 2
        out = generate(model, [first, second], 4, max_batch_size=batch)
        want = generate(model, [first, second], 4, prefix_cache=False)
        assert (out.stats.cached_tokens > 0) == (batch == 2), out.stats
        for a, b in zip(out.logprobs, want.logprobs):
            assert_bitwise(a, b, f"batch {batch}")


def test_kv_cache_pages_are_reference_counted():
    model = tiny_model(torch.float32)
    cache = PageAllocator(model.new_cache(3, 64, num_pages=4))
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.commit(cache.prepare([a], [2 * B]))
    pa = cache.pages(a)
    cache.retain(pa[0])
    cache.attach(b, pa[:1])
    assert cache.refs[pa[0]] == 2 and cache.lengths[b] == B and cache.free_pages == 2
    cache.release(a)
    assert cache.refs[pa[0]] == 1 and cache.free_pages == 3     # pa[1] freed, pa[0] held by b
    cache.release(b)
    assert cache.refs[pa[0]] == 0 and cache.free_pages == 4     # pa[0] parked (LRU)
    c = cache.add_sequence()
    cache.attach(c, pa[:1])                                     # taken back from the LRU
    assert cache.free_pages == 3
    with pytest.raises(ValueError, match="not empty"):
        cache.attach(c, pa[:1])
    cache.release(c)
    cache.unretain(pa[0])
    assert cache.free_pages == 4 and sum(cache.refs) == 0


def test_engine_refuses_requests_it_can_never_run():
    model = tiny_model(torch.float32)
    engine = Engine(model, max_batch_size=2, num_pages=3)
    bad = [([], "the prompt is empty", ValueError), ([1, 320], r"token ids \[320\]", IndexError),
           ([1] * 40, "cannot run even alone", RuntimeError),
           ([1] * 1020, "exceeds the context of 1024", ValueError)]
    for tokens, match, exc in bad:
        with pytest.raises(exc, match="engine: request r.*" + match):
            engine.add(Request("r", tokens, SamplingParams(10), name="r"))
    for key in (2**63, -1):   # the sampling kernel's int64 noise keys: refused at add, not step
        with pytest.raises(ValueError, match=r"engine: request r: noise_key must be in \[0, 92"):
            engine.add(Request("r", [1, 2], SamplingParams(10), noise_key=key, name="r"))
    with pytest.raises(ValueError, match="max_step_tokens=1 must be >= max_batch_size=2"):
        Engine(model, max_batch_size=2, max_step_tokens=1)
    assert not engine.has_work


def test_request_rules_name_the_field_they_refuse():
    """The rules every entry point shares tag each error with the argument it is about (the
    service's 400 names it)."""
    for kw, exc, field, match in [
            (dict(top_p=0.0), ValueError, "top_p", r"top_p must be in \(0, 1\], got 0.0"),
            (dict(top_k=1.5), TypeError, "top_k", "top_k must be an integer"),
            (dict(seed=2**64), ValueError, "seed", "seed must be in"),
            (dict(temperature=-1.0), ValueError, "temperature", "temperature must be"),
            (dict(stop_token_ids=[320]), ValueError, "stop_token_ids", r"stop_token_ids\[0\]"),
            (dict(top_logprobs=21, max_top_logprobs=20), ValueError, "top_logprobs",
             "top_logprobs must be at most 20, got 21")]:
        with pytest.raises(exc, match="svc: " + match) as e:
            rules.sampling("svc", **{"max_new_tokens": 4, "vocab": 320, **kw})
        assert e.value.field == field
    for ids, field in (([3, 3], "request_ids"), ([0, 2**63], "request_ids")):
        with pytest.raises(ValueError, match="svc: request_ids") as e:
            rules.noise_keys("svc", ids, 2)
        assert e.value.field == field
    with pytest.raises(IndexError, match=r"svc: request a: the prompt holds token ids \[9\]") as e:
        rules.prompt("svc", "request a", [1, 9], 2, vocab=9, context=16)
    assert e.value.field == "prompt"
    p = rules.sampling("svc", max_new_tokens=4, vocab=320, temperature=1.0, top_p=1.0, seed=3,
                       eos_token_ids=7, stop_token_ids=(8, 9))
    assert p == SamplingParams(4, 1.0, None, 1.0, 3, frozenset({7}), frozenset({8, 9}))


def test_the_model_only_reads_and_writes_the_pages_the_scheduler_names():
    """The allocator prepares a step (pages for the new tokens) and commits it; the forward in
    between neither allocates nor advances a slot. A refused step takes nothing."""
    model = tiny_model(torch.float32)
    pages = PageAllocator(model.new_cache(2, 64, num_pages=3))
    a, b = pages.add_sequence(), pages.add_sequence()
    step = pages.prepare([a, b], [20, 5])                       # 2 + 1 pages of 16
    assert pages.free_pages == 0 and pages.lengths == [0, 0]
    with torch.no_grad():
        logits = model(torch.arange(25), torch.tensor([0, 20, 25]), kv=step)
        full = model(torch.arange(25), torch.tensor([0, 20, 25]))
    assert_bitwise(logits, full, "a cached prefill vs the training forward")
    assert pages.free_pages == 0 and pages.lengths == [0, 0]   # the model allocated nothing
    pages.commit(step)
    assert pages.lengths == [20, 5]
    with pytest.raises(CacheFullError, match="step needs 1 pages, 0 free"):
        pages.prepare([a, b], [1, 12])                          # b fits, a needs a page
    assert pages.lengths == [20, 5] and [len(pages.pages(s)) for s in (a, b)] == [2, 1]
    with pytest.raises(TypeError, match="groups must be a tonp_parallel.ParallelGroups"):
        type(model)(model.config, groups=object())


def test_held_admission_keeps_new_requests_waiting():
    """hold_admission(True) (a weight update draining the batch): a new request waits, without
    a forward, until the hold is lifted; then it runs as if it had never waited."""
    model = tiny_model(torch.float32)
    engine = Engine(model, max_batch_size=2)
    engine.hold_admission(True)
    engine.add(Request("a", [1, 2, 3], SamplingParams(4)))
    assert engine.step() == [] and engine.num_waiting == 1 and engine.stats.forward_steps == 0
    engine.hold_admission(False)
    out = [o for _ in range(8) if engine.has_work for o in engine.step()]
    assert [o.finish for o in out][-1] == "length" and engine.stats.forward_steps == 4
    want = generate(model, [[1, 2, 3]], 4)
    assert out[-1].request.tokens == want.sequences[0].tolist()


def test_prefix_cache_evicts_the_least_recently_used_page():
    """Four pages. A, B, C each leave one cached page (LRU: A, B, C); a request extending A by a
    token shares A's page and leaves its own partial page (LRU: B, C, A's tail, A): no page is
    free, so a one-page request evicts B, then another one C."""
    model = tiny_model(torch.float32)
    cache = PageAllocator(model.new_cache(4, 64, num_pages=4))
    prefix = PrefixCache(cache)
    a, b, c, d, e = (p.tolist() for p in prompts((B,) * 5, seed=9))

    def cached(*ps):
        return [prefix.match(p + [1], len(p)).length for p in ps]
    for p in (a, b, c):
        _feed(model, cache, prefix, p)
        cache.release(0)                       # each request ran in slot 0
    assert cache.free_pages == 4 and prefix.num_pages == 3
    _, n = _feed(model, cache, prefix, a + [7])
    assert n == B                              # A's page shared by reference
    cache.release(0)
    assert prefix.num_pages == 4 and cached(a, b, c) == [B, B, B]
    _feed(model, cache, prefix, d)
    cache.release(0)
    assert cached(a, b, c, d) == [B, 0, B, B]
    _feed(model, cache, prefix, e)
    cache.release(0)
    assert cached(a, b, c, d, e) == [B, 0, 0, B, B]
