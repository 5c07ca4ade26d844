"""tonp vocabulary reductions: log_softmax, logsumexp, token_logprobs, argmax, the vocab-shard
pieces (lse_partial + lse_finish, max_with_index) and seeded sampling.

A row's result depends only on that row (any batch, order, thread count) and, through the vocab
chunk tree, not on how the vocabulary is sharded. Stock torch's shard combination differs from
its one-call logsumexp (the twin). Ties: argmax takes the lowest index. Sampling is a function
of (seed, request, position) and the row, respects top-k/top-p and matches softmax frequencies.
"""
from __future__ import annotations

import pytest
import torch

import tonp_kernels as tk
from tonp_kernels import reference
from conftest import (DTYPES, ROW_COUNTS, assert_bitwise, assert_close, check_row_invariance,
                      check_thread_invariance, randn)

V = 1000  # divisible by the 8 chunks, not a power of two
SCALE = 4.0  # logits of a trained LM are spread over several units


def _logits(n, dtype, gen, vocab=V):
    return randn(n, vocab, dtype=dtype, gen=gen, scale=SCALE)


def _targets(n, gen, vocab=V):
    return torch.randint(0, vocab, (n,), generator=gen)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", ROW_COUNTS)
def test_rows_do_not_depend_on_their_batch(M, dtype, gen):
    for T in (1.0, 0.7):
        check_row_invariance(lambda x: tk.logsumexp(x, temperature=T),
                             lambda n: [_logits(n, dtype, gen)], M)
        check_row_invariance(lambda x: tk.log_softmax(x, temperature=T),
                             lambda n: [_logits(n, dtype, gen)], M)
        check_row_invariance(lambda x, t: tk.token_logprobs(x, t, temperature=T),
                             lambda n: [_logits(n, dtype, gen), _targets(n, gen)], M)
    check_row_invariance(tk.argmax, lambda n: [_logits(n, dtype, gen)], M)
    check_row_invariance(lambda x: tk.lse_partial(x, chunks=4),
                         lambda n: [_logits(n, dtype, gen)], M)


@pytest.mark.parametrize("dtype", DTYPES)
def test_thread_count_does_not_change_bits(dtype, gen):
    x, t = _logits(129, dtype, gen, vocab=4096), _targets(129, gen, vocab=4096)
    check_thread_invariance(lambda x: tk.log_softmax(x), x, what="log_softmax")
    check_thread_invariance(lambda x, t: tk.token_logprobs(x, t, temperature=0.9), x, t,
                            what="token_logprobs")
    check_thread_invariance(tk.argmax, x, what="argmax")
    check_thread_invariance(lambda x: tk.log_softmax(x), x[:1], what="log_softmax one row")
    req, pos = torch.arange(129), torch.arange(129) * 7
    check_thread_invariance(lambda x: tk.sample(x, temperature=1.0, seed=3, request_ids=req,
                                                positions=pos, top_p=0.9), x, what="sample")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", (1.0, 0.6))
def test_vocab_shards_finish_to_the_same_bits(temperature, dtype, gen):
    """P vocab shards, each the subtree over C/P chunks, finished by lse_finish in shard order,
    equal the one-call logsumexp for P = 1, 2, 4, 8; so do token_logprobs built on them."""
    C = 8
    x, t = _logits(37, dtype, gen), _targets(37, gen)
    whole = tk.logsumexp(x, temperature=temperature, chunks=C)
    assert whole.dtype == torch.float32
    for P in (1, 2, 4, 8):
        parts = [tk.lse_partial(s, temperature=temperature, chunks=C // P)
                 for s in x.chunk(P, dim=-1)]
        m, s = (torch.stack(z) for z in zip(*parts))
        lse = tk.lse_finish(m, s)
        assert_bitwise(lse, whole, f"lse over {P} vocab shards ({dtype}, T={temperature})")
        tlp = tk.target_logit(x, t, temperature=temperature) - lse
        assert_bitwise(tlp, tk.token_logprobs(x, t, temperature=temperature),
                       f"token_logprobs over {P} shards")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", (1.0, 0.7))
def test_fused_rollout_logprobs_equal_the_differentiable_path(temperature, dtype, gen):
    """Without a gradient to track (the rollout's pick), token_logprobs is one fused op; with one
    (training), lse + gather + subtraction under autograd. Same bits, any leading shape."""
    x, t = _logits(2 * 19, dtype, gen).reshape(2, 19, -1), _targets(2 * 19, gen).reshape(2, 19)
    fused = tk.token_logprobs(x, t, temperature=temperature)
    tracked = tk.token_logprobs(x.clone().requires_grad_(), t, temperature=temperature)
    assert tracked.requires_grad and fused.shape == t.shape
    assert_bitwise(fused, tracked.detach(), f"fused vs autograd token_logprobs ({dtype})")


def test_division_by_the_temperature_is_ieee_on_every_device(gen):
    """The differentiable path divides by T through stock.true_div: IEEE x / T, as the kernels
    do. Its twin is what torch's CUDA kernel computes for x / <Python number>, x * (1 / T): other
    bits for some x (the first GPU check saw training logprobs one ulp off the rollout's at
    T = 0.9). On a device, true_div divides by a 0-dim tensor there (a true division); the meta
    device runs that branch here."""
    from tonp_kernels.stock import true_div
    x = torch.randn(4096, generator=gen)
    for T in (0.9, 0.7, 1.3):
        assert torch.equal(true_div(x, T), x / T)
        assert not torch.equal(x * (1.0 / T), x / T), T   # the reciprocal loses a bit
    assert true_div(x, 1.0) is x
    meta = true_div(torch.empty(3, 5, device="meta"), 0.9)
    assert meta.device.type == "meta" and meta.shape == (3, 5) and meta.dtype == torch.float32


def test_stock_shard_combination_differs_from_one_call(torch_mode, gen):
    """The twin: stock torch's logsumexp of shard logsumexps is not its one-call logsumexp."""
    x = _logits(200, torch.float32, gen)
    whole = tk.logsumexp(x)
    # (chunks=1: a shard of 125 entries is one chunk; stock torch ignores chunks anyway)
    sharded = torch.logsumexp(torch.stack([tk.logsumexp(s, chunks=1) for s in x.chunk(8, -1)]), 0)
    assert not torch.equal(sharded, whole)


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_ties_go_to_the_lowest_index_and_shards_combine(dtype, gen):
    # Few distinct values: nearly every row has a tied maximum.
    x = torch.randint(0, 4, (300, 64), generator=gen).to(dtype)
    x[5] = 2.0                                    # a row of all-equal values -> 0
    got = tk.argmax(x)
    first_max = (x == x.max(-1, keepdim=True).values).float().argmax(-1)
    assert_bitwise(got, first_max, "argmax ties")
    assert got[5] == 0 and got.dtype == torch.int64
    value, index = tk.max_with_index(x)
    assert_bitwise(index, got, "max_with_index index")
    assert_bitwise(value, x.max(-1).values.float(), "max_with_index value")
    for P in (2, 4, 8):
        w = x.shape[-1] // P
        vals, idxs = zip(*[tk.max_with_index(s) for s in x.split(w, -1)])
        vals, idxs = torch.stack(vals), torch.stack(idxs) + w * torch.arange(P)[:, None]
        best = vals.max(0).values
        combined = torch.where(vals == best, idxs, torch.iinfo(torch.int64).max).min(0).values
        assert_bitwise(combined, got, f"argmax over {P} shards (max value, lowest index)")


def _scalar_max(row: list) -> tuple:
    """A strict > scan from -inf (NaN skipped): the maximum (as the scan met it) and the first
    index whose value equals it (0 when none does)."""
    mx = float("-inf")
    for v in row:
        mx = v if v > mx else mx
    return mx, next((i for i, v in enumerate(row) if v == mx), 0)


@pytest.mark.parametrize("V", (1, 7, 8, 9, 67, 1000))
def test_row_maxima_follow_a_scalar_scan_zeros_nan_and_tails(V, gen):
    """argmax, max_with_index and lse_partial take a row's maximum eight lanes at a time: the
    index a strict > scan keeps (zeros of either sign, the first one), the value the row holds
    there (NaN skipped; an all-NaN row: index 0), lse_partial's max with a zero as +0; rows of -0
    / +0 in both orders, NaN among finite values, all -inf, the maximum in the tail beyond the
    last eight, all equal."""
    x = torch.randn(9, V, generator=gen)
    x[0] = -x[0].abs() - 1
    x[0, V // 2] = -0.0
    x[0, -1] = 0.0                                   # -0 first
    x[1] = -x[1].abs() - 1
    x[1, 0], x[1, -1] = 0.0, -0.0                    # +0 first
    x[2] = -0.0
    x[2, ::3] = 0.0                                  # zeros of both signs, +0 first
    x[3] = float("-inf")
    x[4, ::2] = float("nan")                         # NaN among finite values
    x[5, -1] = x[5].max() + 1                        # the maximum in the tail
    x[6] = float("nan")
    x[7, :] = 3.0                                    # all equal: index 0
    for r in range(9):
        mx, i = _scalar_max(x[r].tolist())
        value, index = tk.max_with_index(x[r:r + 1])
        assert int(index) == i, f"row {r}: index {int(index)}, want {i}"
        assert torch.equal(value.view(torch.int32), x[r, i:i + 1].view(torch.int32)), \
            f"row {r}: max_with_index's value is not the bits of row[{i}]"   # (NaN included)
        m, _ = tk.lse_partial(x[r:r + 1], chunks=1)
        assert_bitwise(m.reshape(1), torch.tensor([mx + 0.0]), f"row {r} lse_partial max")
        if r not in (4, 6):                          # argmax refuses NaN rows
            assert int(tk.argmax(x[r:r + 1])) == i, f"row {r} argmax"
    with pytest.raises(ValueError, match="holds a NaN"):
        tk.argmax(x[4:5])


@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy_against_the_reference(dtype, gen):
    x, t = _logits(23, dtype, gen), _targets(23, gen)
    for T in (1.0, 0.5):
        assert_close(tk.logsumexp(x, temperature=T), reference.logsumexp(x, T),
                     dtype=torch.float32, scale=SCALE, what=f"logsumexp T={T} {dtype}")
        assert_close(tk.log_softmax(x, temperature=T), reference.log_softmax(x, T),
                     dtype=torch.float32, scale=SCALE, what=f"log_softmax T={T} {dtype}")
        assert_close(tk.token_logprobs(x, t, temperature=T), reference.token_logprobs(x, t, T),
                     dtype=torch.float32, scale=SCALE, what=f"token_logprobs T={T} {dtype}")
        lse64 = reference.logsumexp(x.double(), T)
        err = float((tk.logsumexp(x, temperature=T).double() - lse64).abs().max())
        assert err < 1e-5 * SCALE, f"logsumexp off the float64 oracle by {err:.2e}"
    assert_bitwise(tk.argmax(x), reference.argmax(x), "argmax vs reference")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_reference_autograd(dtype, gen):
    x0, t = _logits(6, dtype, gen, vocab=64), _targets(6, gen, vocab=64)
    g = torch.randn(6, generator=gen)
    for name, op, ref in (
            ("logsumexp", lambda x: tk.logsumexp(x, temperature=0.8),
             lambda x: reference.logsumexp(x, 0.8)),
            ("token_logprobs", lambda x: tk.token_logprobs(x, t, temperature=0.8),
             lambda x: reference.token_logprobs(x, t, 0.8)),
            ("log_softmax", lambda x: tk.log_softmax(x, temperature=0.8)[:, 3],
             lambda x: reference.log_softmax(x, 0.8)[:, 3])):
        grads = []
        for fn in (op, ref):
            x = x0.clone().requires_grad_(True)
            fn(x).backward(g)
            grads.append(x.grad)
        assert grads[0].dtype == dtype
        assert_close(grads[0], grads[1], dtype=dtype, what=f"d {name}")


def _sample(x, req, pos, seed=7, **kw):
    return tk.sample(x, temperature=kw.pop("temperature", 1.0), seed=seed, request_ids=req,
                     positions=pos, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampling_is_reproducible_and_row_invariant(dtype, gen):
    def make(n):
        return [_logits(n, dtype, gen), torch.randint(0, 50, (n,), generator=gen),
                torch.randint(0, 4000, (n,), generator=gen)]

    for kw in ({}, {"top_k": 20}, {"top_p": 0.8}, {"temperature": 0.7, "top_k": 50,
                                                   "top_p": 0.95}):
        for M in (1, 17, 130):
            check_row_invariance(lambda x, r, p: _sample(x, r, p, **dict(kw)), make, M, seed=M)
    x, req, pos = make(64)
    first = _sample(x, req, pos)
    assert first.dtype == torch.int64 and first.shape == (64,)
    assert_bitwise(_sample(x, req, pos), first, "same (seed, request, position) again")
    assert not torch.equal(_sample(x, req, pos, seed=8), first), "the seed changes the draws"
    assert not torch.equal(_sample(x, req, pos + 1), first), "the position changes the draws"
    # The noise belongs to (request, position), not to the batch slot: one row repeated in
    # every slot with the same ids draws the same token everywhere.
    same = _sample(x[:1].repeat(16, 1), req[:1].repeat(16), pos[:1].repeat(16))
    assert bool((same == same[0]).all())


def test_temperature_zero_is_argmax(gen):
    x = torch.randint(0, 5, (40, 96), generator=gen).float()
    got = tk.sample(x, temperature=0.0, seed=1, request_ids=torch.arange(40),
                    positions=torch.zeros(40, dtype=torch.long), top_k=3)
    assert_bitwise(got, tk.argmax(x), "temperature 0")


def _kept_top_p(probs, top_p):
    """The nucleus: tokens in descending probability while the mass before them is < top_p."""
    p, order = probs.sort(-1, descending=True)
    before = p.cumsum(-1) - p
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep.scatter_(-1, order, before < top_p)
    return keep


@pytest.mark.parametrize("temperature", (1.0, 0.5))
def test_sampling_never_leaves_the_top_k_top_p_set(temperature, gen):
    M, vocab = 400, 64
    x = torch.randn(M, vocab, generator=gen) * 3
    req, pos = torch.arange(M), torch.arange(M) + 11
    probs = torch.softmax(x.double() / temperature, -1)
    topk = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, x.topk(5, -1).indices, True)
    for top_p in (0.3, 0.9):
        nucleus = _kept_top_p(probs, top_p)
        got = _sample(x, req, pos, temperature=temperature, top_p=top_p)
        assert bool(nucleus.gather(-1, got[:, None]).all()), f"a draw outside top_p={top_p}"
        got = _sample(x, req, pos, temperature=temperature, top_k=5, top_p=top_p)
        # With both, the draw lies in the top-5 and in the (un-renormalised) nucleus, whichever
        # order the two filters apply in.
        assert bool((topk & nucleus).gather(-1, got[:, None]).all())
    got = _sample(x, req, pos, temperature=temperature, top_k=5)
    assert bool(topk.gather(-1, got[:, None]).all()), "a draw outside the top 5"
    assert bool((_sample(x, req, pos, top_k=1) == tk.argmax(x)).all()), "top_k=1 is greedy"


def test_sampling_frequencies_follow_the_softmax():
    """A loose statistical check: 8000 draws (different positions) from one 8-token row."""
    n, T = 8000, 1.3
    x = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])
    expected = torch.softmax(x[0].double() / T, -1)
    draws = _sample(x.expand(n, -1).contiguous(), torch.full((n,), 3), torch.arange(n), seed=11,
                    temperature=T)
    freq = torch.bincount(draws, minlength=8).double() / n
    sigma = (expected * (1 - expected) / n).sqrt()
    assert bool(((freq - expected).abs() <= 5 * sigma + 1e-3).all()), \
        f"frequencies {freq.tolist()} vs softmax {expected.tolist()}"


def test_masked_vocabulary_entries(gen):
    """-inf logits (a masked vocabulary) contribute nothing, give -inf logprobs, are never
    sampled; a row with a single finite entry has logsumexp equal to it."""
    x = _logits(40, torch.float32, gen, vocab=64)
    x[:, 10:40] = float("-inf")
    x[1] = float("-inf")
    x[1, 5] = 0.0
    t = _targets(40, gen, vocab=64)
    assert_bitwise(tk.logsumexp(x)[1], torch.tensor(0.0), "one finite entry")
    assert_close(tk.logsumexp(x), reference.logsumexp(x), dtype=torch.float32, scale=SCALE,
                 what="masked logsumexp")
    lp = tk.token_logprobs(x, t)
    masked = (t >= 10) & (t < 40)
    assert bool(lp[masked].eq(float("-inf")).all()) and bool(lp[~masked].isfinite().all())
    ids = torch.arange(40)
    for seed in range(5):
        for kw in ({}, {"top_k": 50}, {"top_p": 0.99}):
            got = _sample(x, ids, ids, seed=seed, **kw)
            assert not bool(((got >= 10) & (got < 40)).any()), f"sampled a masked token {kw}"
            assert int(got[1]) == 5
    assert not bool(((tk.argmax(x) >= 10) & (tk.argmax(x) < 40)).any())


def test_empty_batches_and_bad_inputs(gen):
    empty = torch.empty(0, 64)
    assert tk.log_softmax(empty).shape == (0, 64)
    assert tk.logsumexp(empty).shape == (0,)
    assert tk.token_logprobs(empty, torch.empty(0, dtype=torch.long)).shape == (0,)
    assert tk.argmax(empty).shape == (0,)
    none = torch.empty(0, dtype=torch.long)
    assert tk.sample(empty, temperature=1.0, seed=0, request_ids=none, positions=none).shape \
        == (0,)
    x = _logits(3, torch.float32, gen, vocab=100)
    with pytest.raises(ValueError, match="divisible"):
        tk.logsumexp(x)                                           # V=100, C=8
    with pytest.raises(ValueError, match="divisible"):
        tk.lse_partial(x, chunks=8)
    x = _logits(3, torch.float32, gen, vocab=64)
    with pytest.raises(ValueError, match="targets"):
        tk.token_logprobs(x, torch.zeros(4, dtype=torch.long))
    with pytest.raises(IndexError, match="out of range"):
        tk.token_logprobs(x, torch.tensor([0, 64, 1]))
    with pytest.raises(IndexError, match="out of range"):
        tk.token_logprobs(x, torch.tensor([0, -1, 1]))
    with pytest.raises(TypeError, match="integer tensor"):
        tk.token_logprobs(x, torch.zeros(3))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        tk.log_softmax(x.half())
    with pytest.raises(RuntimeError, match="CPU"):
        tk.logsumexp(x.to("meta"))
    with pytest.raises(RuntimeError, match="CPU"):
        tk.argmax(x.to("meta"))
    ids = torch.arange(3)
    for bad, rule in (({"temperature": -1.0}, "temperature must be"), ({"top_p": 0.0}, "top_p"),
                      ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k")):
        with pytest.raises(ValueError, match=rule):
            _sample(x, ids, ids, **bad)
    with pytest.raises(ValueError, match=r"\[M, V\]"):
        _sample(x[0], ids, ids)
    with pytest.raises((ValueError, RuntimeError), match="(?i)request|position|shape|size"):
        _sample(x, ids[:2], ids)


def test_non_contiguous_logits_give_the_bits_of_contiguous_copies(gen):
    x = _logits(31, torch.float32, gen, vocab=256)
    t = _targets(31, gen, vocab=256)
    x_t = x.t().contiguous().t()
    x_s = torch.cat([x, x], -1)[:, :256]
    x_e = x[:1].expand(31, -1)  # stride 0: one row repeated
    ids = torch.arange(31)
    assert_bitwise(_sample(x_e, ids, ids), _sample(x_e.contiguous(), ids, ids), "sample expand")
    assert_bitwise(tk.logsumexp(x_e), tk.logsumexp(x_e.contiguous()), "logsumexp expand")
    for name, view in (("transposed", x_t), ("row-strided", x_s)):
        assert_bitwise(tk.log_softmax(view), tk.log_softmax(x), f"log_softmax {name}")
        assert_bitwise(tk.token_logprobs(view, t), tk.token_logprobs(x, t), f"tlp {name}")
        assert_bitwise(tk.argmax(view), tk.argmax(x), f"argmax {name}")
        assert_bitwise(_sample(view, ids, ids), _sample(x, ids, ids), f"sample {name}")
