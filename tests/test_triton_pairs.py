"""The bf16 x bf16 linear's pair chains (CONTRACT.md, the arithmetic of vdpbf16ps) in the Triton
exact kernel equal a numpy reference of the spec, bit for bit (Triton's interpreter).

The reference is independent of the kernel's step: it takes the exact sum a*b + c (a TwoSum in
float64), rounds it to 24 bits with an unbounded exponent and flushes what is then below FLT_MIN
(tininess after rounding); lanes over pairs (the odd element first) in zero-padded blocks of 16,
tree8, the pairwise chunk tree, + bias, the canonical NaN, one rounding. Inputs are hostile:
subnormal bf16, products near FLT_MIN, infinities, NaN, exact cancellation; chunks of 3, 5, 13,
16 and 40 elements; rows across the tile; bias and both output dtypes; the fused MoE experts.
The C++ builds run the same pair chains (the kernel's default); tests/test_triton_exact.py
compares the two directly.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import assert_bitwise
from triton_interpreted import linear, moe, rowwise

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
FLT_MIN = np.float32(np.finfo(np.float32).tiny)
CANONICAL = 0x7FC00000


def daz(v: np.ndarray) -> np.ndarray:
    """bf16 values (as float32) with subnormals read as zeros of their sign."""
    b = v.view(np.uint32)
    return np.where((b & 0x7F800000) == 0, b & 0x80000000, b).astype(np.uint32).view(np.float32)


def step(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """One step by its definition: the exact a*b + c rounded to 24 bits (unbounded exponent),
    a zero of its sign when that is below FLT_MIN; IEEE otherwise (inf, NaN)."""
    p, c64 = a.astype(np.float64) * b.astype(np.float64), c.astype(np.float64)   # p exact
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)                     # s + err = p + c exactly (TwoSum)
    m, e = np.frexp(s)
    scaled = m * 2.0 ** 24
    r = np.rint(scaled)
    mid = (scaled - np.floor(scaled) == 0.5) & (err != 0)  # s on a 24-bit midpoint: err decides
    r = np.where(mid, np.where(err > 0, np.ceil(scaled), np.floor(scaled)), r)
    r24 = np.ldexp(r, e - 24)
    ieee = s.astype(np.float32)
    out = np.where(np.abs(r24) < FLT_MIN, np.copysign(np.float32(0), s).astype(np.float32),
                   r24.astype(np.float32))
    out = np.where((s == 0) & (err == 0), ieee, out)      # an exact zero keeps IEEE's sign
    return np.where(np.isfinite(p) & np.isfinite(c64), out, (p + c64).astype(np.float32))


def tree(parts):
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def pair_linear_reference(x, w, bias, chunks, out_dtype):
    """The documented arithmetic, step by step (numpy, float32)."""
    xf, wf = daz(x.float().numpy()), daz(w.float().numpy())
    M, K = xf.shape
    N, kc = wf.shape[0], K // chunks
    nb = -(-kc // 16)
    parts = []
    for c in range(chunks):
        xc = np.zeros((M, nb * 16), np.float32)
        wc = np.zeros((N, nb * 16), np.float32)
        xc[:, :kc], wc[:, :kc] = xf[:, c * kc:(c + 1) * kc], wf[:, c * kc:(c + 1) * kc]
        acc = np.zeros((M, N, 8), np.float32)
        for j in range(nb):
            xb, wb = xc[:, 16 * j:16 * j + 16].reshape(M, 1, 8, 2), wc[:, 16 * j:16 * j + 16]
            wb = wb.reshape(1, N, 8, 2)
            acc = step(*np.broadcast_arrays(xb[..., 1], wb[..., 1], acc))
            acc = step(*np.broadcast_arrays(xb[..., 0], wb[..., 0], acc))
        lanes = [acc[..., i] for i in range(8)]
        parts.append(tree(lanes))
    y = tree(parts)
    if bias is not None:
        y = y + bias.float().numpy()
    b = np.where(np.isnan(y), np.uint32(CANONICAL), np.ascontiguousarray(y).view(np.uint32))
    if out_dtype == torch.float32:
        return torch.from_numpy(b.astype(np.uint32).view(np.float32))
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint32)   # nearest even; NaN 0x7fc0
    r = np.where(np.isnan(y), np.uint32(0x7FC0), r).astype(np.uint16)
    return torch.from_numpy(r.view(np.int16)).view(torch.bfloat16)


def bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def hostile(M, K, gen, *, scale):
    """bf16 values with subnormals, tiny products, large ones, inf, NaN and cancelling pairs."""
    v = torch.randn(M, K, generator=gen) * scale
    u = torch.rand(M, K, generator=gen)
    v = torch.where(u < 0.05, torch.randn(M, K, generator=gen) * 2.0 ** -128, v)  # subnormal bf16
    v = torch.where((u >= 0.05) & (u < 0.12), torch.randn(M, K, generator=gen) * 2.0 ** -62, v)
    v = torch.where((u >= 0.12) & (u < 0.15), torch.randn(M, K, generator=gen) * 2.0 ** 60, v)
    return v.to(torch.bfloat16)


def test_steps_near_flt_min_follow_tininess_after_rounding():
    """One lane's two steps, c = x1 * w1 = FLT_MIN then + x0 * w0: an exact value below FLT_MIN
    that rounds (24 bits) to it is kept; one that IEEE's subnormal grid rounds up to FLT_MIN but
    24 bits do not is flushed; a subnormal bf16 input reads as 0. Reference and kernel agree."""
    tiny, z = 2.0 ** -126, 0.0
    cases = (  # (x0 * w0, expected): the pair (x0, w0) after c = FLT_MIN
        ((2.0 ** -75, -(2.0 ** -76)), tiny),           # FLT_MIN - 2^-151: a tie, to even: kept
        ((1.5 * 2.0 ** -75, -(2.0 ** -76)), z),        # FLT_MIN - 3 * 2^-152: IEEE says FLT_MIN
        ((2.0 ** -130, 2.0 ** 100), tiny),             # a subnormal bf16 is 0: FLT_MIN + 0
    )
    for (a, b), want in cases:
        x = torch.zeros(1, 16)
        w = torch.zeros(1, 16)
        x[0, :2], w[0, :2] = torch.tensor([a, 2.0 ** -63]), torch.tensor([b, 2.0 ** -63])
        x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
        ref = pair_linear_reference(x, w, None, 1, torch.float32)
        got = linear.linear(x, w, None, 1, torch.float32, pairs=True)
        assert float(ref) == want and bits(got).item() == bits(ref).item(), (a, b, float(got))
    ieee = np.float32(tiny + 1.5 * 2.0 ** -75 * -(2.0 ** -76))  # the twin: gradual underflow
    assert ieee == np.float32(tiny)


@pytest.mark.parametrize("K,N,chunks", ((24, 37, 8), (40, 33, 8), (104, 20, 8), (64, 16, 4),
                                        (80, 40, 2), (40, 16, 1)))
def test_pair_chains_equal_the_spec(K, N, chunks, gen):
    """kc = 3, 5, 13, 16, 40, 40: partial and whole blocks of 16; 1-21 rows; bias; both outputs."""
    x = hostile(21, K, gen, scale=3.0)
    w = hostile(N, K, gen, scale=K ** -0.5)
    x[0, 1], w[1, 2] = float("inf"), float("nan")
    x[2, :2], w[3, :2] = torch.tensor([1.5, 1.5]), torch.tensor([2.0, -2.0])  # cancelling pair
    b = torch.randn(N, generator=gen).to(torch.bfloat16) if N % 2 else None
    for out_dtype in (torch.bfloat16, torch.float32):
        got = linear.linear(x, w, b, chunks, out_dtype, pairs=True)
        want = pair_linear_reference(x, w, b, chunks, out_dtype)
        assert_bitwise(bits(got), bits(want), f"pairs K={K} N={N} C={chunks} -> {out_dtype}")
        for m in (1, 2, 3, 17):  # rows alone, a partial row tile
            assert_bitwise(bits(linear.linear(x[:m], w, b, chunks, out_dtype, pairs=True)),
                           bits(got[:m]), f"{m} rows")
    # The twin: the fp32 FMA lanes (pairs off) give other bits on ordinary inputs.
    # (Chunks of at most 5 elements cannot differ: bf16 products and their first sums are exact.)
    x, w = (torch.randn(8, 256, generator=gen).to(torch.bfloat16) for _ in range(2))
    assert not torch.equal(linear.linear(x, w, None, 2, torch.float32, pairs=False),
                           linear.linear(x, w, None, 2, torch.float32, pairs=True))


def test_tp_partials_of_pair_chains_finish_to_the_full_linear(gen):
    """A row-parallel rank's fp32 partial (C / t chunks of its K / t) finished by the tree."""
    import tonp_kernels as tk
    K, N, C = 128, 24, 8
    x, w = hostile(5, K, gen, scale=2.0), hostile(N, K, gen, scale=K ** -0.5)
    full = linear.linear(x, w, None, C, torch.float32, pairs=True)
    for t in (2, 4):
        kt = K // t
        parts = [linear.linear(x[:, r * kt:(r + 1) * kt].contiguous(),
                               w[:, r * kt:(r + 1) * kt].contiguous(), None, C // t,
                               torch.float32, pairs=True) for r in range(t)]
        assert_bitwise(bits(tk.tree_sum(parts)), bits(full), f"TP={t}")


def test_moe_experts_run_the_pair_chains_of_three_calls(gen):
    """Each (token, slot) row: the pair-chain linear of gate_up, silu_mul in bf16, the pair-chain
    linear of down: the bits of those three calls on that row alone."""
    E, Kk, H, I = 3, 2, 32, 16
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5).to(torch.bfloat16)
    down = (torch.randn(E, H, I, generator=gen) * I ** -0.5).to(torch.bfloat16)
    x = hostile(9, H, gen, scale=2.0)
    ids = torch.randint(0, E, (9, Kk), generator=gen)
    y = moe.moe_experts(x, ids, gate_up, down, 0, 2, pairs=True)
    for m in (0, 4, 8):
        for k in range(Kk):
            e = int(ids[m, k])
            gu = linear.linear(x[m:m + 1], gate_up[e], None, 2, pairs=True)
            h = rowwise.silu_mul(gu[:, :I].contiguous(), gu[:, I:].contiguous())
            want = linear.linear(h, down[e], None, 2, pairs=True)
            assert_bitwise(bits(y[m, k][None]), bits(want), f"row {m} slot {k}")
