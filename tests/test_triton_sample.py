"""Seeded sampling, CONTRACT.md "sample": the Triton kernel draws the C++ kernel's tokens, the kept
sets of top-k / top-p are the integer rank definition, the draws follow softmax(logits / T)
restricted to them (chi-square), and the noise resolves probabilities far below 1e-15.

Twins: a wrong distribution fails the chi-square test, and the phase-1 uniform
((2 (h >> 41) + 1) 2^-24) cannot produce the noise the tail test asks for.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import tonp_kernels as tk
from conftest import assert_bitwise
from test_kernels_inputs import _LOGITS, _POS, _RECORDED, _REQ
from triton_interpreted import numerics, sample

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
SETTINGS = ((0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (0.7, 0, 0.6),
            (1.0, 7, 0.8), (1.0, 1, 1.0), (1.0, 70, 0.95))  # (temperature, top_k, top_p)


def cpp(x, T, k, p, seed, req, pos):
    return torch.ops.tonp.sample(x, T, k, p, seed, req, pos)


def hard_logits(M, V, gen, dtype=torch.float32):
    """Logits with a tie at the top, a tie group across the top-k cut, -inf entries, -0/+0."""
    x = torch.randn(M, V, generator=gen) * 2.5
    x[0, 3] = x[0, 9] = x[0].max() + 1
    x[1, :V // 2] = float("-inf")
    x[2, 10:20] = 7.0                       # ten equal logits: top_k=5 keeps ids 10..14
    x[3, 0], x[3, 1] = -0.0, 0.0
    x[3, 2:] = -x[3, 2:].abs() - 1
    return x.to(dtype)


@pytest.mark.parametrize("V,dtype", ((64, torch.float32), (600, torch.float32),
                                     (64, torch.bfloat16), (603, torch.float32)))
def test_triton_draws_the_cpp_tokens(V, dtype, gen):
    """Every setting, rows that cross the vocabulary block (600 > 512) and the row tile (9 > 4),
    64-bit seeds, bf16 logits; a vocabulary that is no multiple of the C++ kernels' eight lanes
    (603), with top-p cuts at several depths (the C++ cut sorts only the rank-key bucket the
    prefix ends in)."""
    x = hard_logits(9, V, gen, dtype)
    req = torch.randint(0, 2 ** 62, (9,), generator=gen)
    pos = torch.randint(0, 5000, (9,), generator=gen)
    settings = {64: SETTINGS, 600: SETTINGS[1:6:2],
                603: ((1.0, 0, 1.0), (0.7, 0, 0.3), (1.3, 0, 0.99), (1.0, 70, 0.95))}[V]
    for i, (T, k, p) in enumerate(settings):
        seed = (5, -1, -2 ** 63, 123456789, 2 ** 62, -7, 0, 99)[i]  # the int64 of 64-bit seeds
        assert_bitwise(sample.sample(x, T, k, p, seed, req, pos), cpp(x, T, k, p, seed, req, pos),
                       f"V={V} {dtype} T={T} top_k={k} top_p={p}")


def test_recorded_draws_on_both_sides():
    for seed in (0, 2 ** 64 - 1):
        plain, filtered = _RECORDED[seed]
        s = seed - 2 ** 64 if seed >= 2 ** 63 else seed
        assert sample.sample(_LOGITS, 0.9, 0, 1.0, s, _REQ, _POS).tolist() == plain
        assert sample.sample(_LOGITS, 1.0, 10, 0.9, s, _REQ, _POS).tolist() == filtered


def test_rows_without_a_draw_are_refused_alike(gen):
    x = torch.randn(3, 64, generator=gen)
    for row, value, rule in ((1, float("nan"), "row 1 holds a NaN logit"),
                             (2, float("inf"), "row 2: logits / temperature reach \\+inf"),
                             (1, float("-inf"), "row 1: every logit is -inf")):
        y = x.clone()
        y[row, 5 if value != float("-inf") else slice(None)] = value
        for fn in (sample.sample, cpp):
            for T in ((0.0, 1.0) if value != value else (1.0,)):
                with pytest.raises(ValueError, match=f"tonp.sample: {rule}"):
                    fn(y, T, 0, 1.0, 1, torch.arange(3), torch.arange(3))


@triton.jit
def _exp_kernel(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, numerics.exp(tl.load(x_ptr + i)))


def tonp_exp(x: torch.Tensor) -> torch.Tensor:
    """tonp's exp (numerics.exp = simd.h vexp, bit for bit; tests/test_triton_vocab.py)."""
    n = triton.next_power_of_2(x.numel())
    buf = torch.zeros(n)
    buf[:x.numel()] = x
    out = torch.empty(n)
    _exp_kernel[(1,)](buf, out, N=n)
    return out[:x.numel()]


def kept_reference(y: torch.Tensor, top_k: int, top_p: float) -> set:
    """The definition: rank by (y desc, id asc); top-k; of those the shortest prefix whose masses
    trunc(exp(y - max) 2^32) reach ceil(ceil(top_p 2^24) Q / 2^24)."""
    order = sorted(range(len(y)), key=lambda i: (-float(y[i] + 0.0), i))
    order = order[:top_k] if 0 < top_k < len(y) else order
    if top_p >= 1.0:
        return set(order)
    mass = (tonp_exp(y[order] - y.max()).double() * 2.0 ** 32).floor().long().tolist()
    need = -(-math.ceil(top_p * 2 ** 24) * sum(mass) // 2 ** 24)
    total = 0
    for n, (i, q) in enumerate(zip(order, mass)):
        total += q
        if total >= need:
            return set(order[:n + 1])
    raise AssertionError("unreachable: the masses sum to Q >= need")


def test_kept_sets_are_the_rank_definition():
    """Ties across the top-k cut go to the lower ids; a top-p cut inside a tie group too; the
    C++ draws (4000 positions) land exactly on the reference's kept set, and the Triton kernel
    draws the C++ tokens on a share of them."""
    y = torch.tensor([1.0, 3.0, 2.0, 2.0, 2.0, 2.0, 0.5, -1.0, 2.0, -4.0])
    n = 4000
    x, req, pos = y.expand(n, -1).contiguous(), torch.full((n,), 9), torch.arange(n)
    for k, p in ((3, 1.0), (0, 0.5), (0, 0.7), (4, 0.8), (0, 1e-9), (6, 0.999)):
        want = kept_reference(y, k, p)
        got = set(cpp(x, 1.0, k, p, 3, req, pos).tolist())
        assert got == want, f"top_k={k} top_p={p}: drew {sorted(got)}, kept {sorted(want)}"
        rows = slice(0, 12)
        assert_bitwise(sample.sample(x[rows], 1.0, k, p, 3, req[rows], pos[rows]),
                       cpp(x[rows], 1.0, k, p, 3, req[rows], pos[rows]), f"k={k} p={p}")


# Upper 1e-4 quantiles of chi-square with df degrees of freedom.
_CHI2_CRIT = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74}


def _chi2(draws: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(draws, minlength=len(probs)).double()
    expected = probs * len(draws)
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a draw outside the kept set"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_frequencies_pass_a_chi_square_test_including_top_k_and_top_p():
    """20000 draws (one row, different positions) of a 6-token vocabulary: the counts match
    softmax(logits / T) renormalised over the kept set at the 1e-4 level; the same counts
    against softmax at another temperature fail (the twin: the test has power)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.2])
    n = 20000
    x, req, pos = logits.expand(n, -1).contiguous(), torch.full((n,), 4), torch.arange(n)
    for T, k, p in ((1.3, 0, 1.0), (1.0, 3, 1.0), (0.8, 0, 0.75), (1.0, 4, 0.9)):
        probs = torch.softmax(logits.double() / T, -1)
        kept = torch.zeros(6, dtype=torch.bool)
        kept[list(kept_reference(logits / T, k, p))] = True
        probs = torch.where(kept, probs, 0.0)
        probs = probs / probs.sum()
        draws = cpp(x, T, k, p, 11, req, pos)
        stat, df = _chi2(draws, probs), int(kept.sum()) - 1
        assert stat < _CHI2_CRIT[df], f"T={T} top_k={k} top_p={p}: chi2 {stat:.1f} (df {df})"
        if k == 0 and p == 1.0:
            wrong = torch.softmax(logits.double() / (T * 1.1), -1)
            assert _chi2(draws, wrong) > _CHI2_CRIT[df], "the chi-square test cannot fail"


@triton.jit
def _noise_kernel(h_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    h = tl.load(h_ptr + i)
    tl.store(out_ptr + i, 0.0 - sample._log_exponential(h))


def gumbel_noise(h: list) -> np.ndarray:
    """g = -log(E) of 64-bit hashes h, by the kernel's construction."""
    n = triton.next_power_of_2(len(h))
    t = torch.tensor([v - 2 ** 64 if v >= 2 ** 63 else v for v in h] + [0] * (n - len(h)))
    out = torch.empty(n)
    _noise_kernel[(1,)](t, out, N=n)
    return out[:len(h)].numpy()


def test_the_noise_resolves_probabilities_to_1e_minus_20():
    """g spans [-3.78, 43.67]: a token whose probability is e^-47.4 ~ 2.5e-21 of the top
    token's can still win. Across the range g is within 1e-6 (absolute) of -log(-log(1 - U))
    in float64, the two halves meet at U = 1/2, and the phase-1 uniform (2 (h >> 41) + 1) 2^-24
    could not get past g = 16.6 (the twin)."""
    lo, hi = gumbel_noise([0, 2 ** 63])                      # w = 2^-63: U tiny / U near 1
    assert 43.6 < lo < 43.7 and -3.78 < hi < -3.77
    assert math.exp(-(lo - hi)) < 3e-21
    half = gumbel_noise([0x7FFFFFFF00000000, 0xFFFFFFFF00000000])  # w = 1/2 from both sides
    assert half[0] == half[1]
    rng = np.random.default_rng(0)
    hs = [int(v) for v in rng.integers(0, 2 ** 63, 2000, dtype=np.uint64)] + \
        [int(v) | 2 ** 63 for v in rng.integers(0, 2 ** 63, 2000, dtype=np.uint64)] + \
        [int(v) >> s for s, v in zip(range(1, 63), rng.integers(0, 2 ** 63, 62, dtype=np.uint64))]
    g = gumbel_noise(hs)
    w = np.array([(np.float32((h >> 32) & 0x7FFFFFFF) * np.float32(2.0 ** -31)
                   + np.float32((((h >> 1) & 0x7FFFFFFF) | 1)) * np.float32(2.0 ** -62))
                  * np.float32(0.5) for h in hs], np.float64)
    U = np.where(np.array([h >> 63 for h in hs]) == 0, w, 1 - w)
    exact = -np.log(-np.log1p(-U))
    assert np.abs(g - exact).max() < 1e-5 * np.maximum(1, np.abs(exact)).max()
    assert g.max() > 30, "the sweep reaches the far tail"
    phase1 = -np.log(-np.log((2 * (np.array(hs, dtype=object) >> 41).astype(np.float64) + 1)
                             * 2.0 ** -24))
    assert phase1.max() < 16.7 < g.max()
