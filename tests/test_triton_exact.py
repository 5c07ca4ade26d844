"""The Triton `exact` kernels equal the C++ kernels bit for bit (run by Triton's interpreter).

linear (fp32 / bf16 x and weights, bias, out_dtype, chunks 1..8 with chunks shorter than one
lane step, K not a multiple of 8 per chunk, N not a multiple of the tile), its TP partials,
the fused MoE experts, rms_norm, silu_mul, rope, moe_combine and moe_route, each compared with
torch.ops.tonp.* by torch.equal at row counts that cross the C++ layout thresholds (3, 8, 20
rows; 96-row blocks) and the Triton tile (16 rows). Each has a twin: the stock torch result (or
a plausible near miss) differs from the exact one, so the comparison can fail.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tonp_kernels as tk
from conftest import assert_bitwise, randn
from triton_interpreted import bits, linear, moe, rowwise

F32, BF16 = torch.float32, torch.bfloat16
PAIRS = ((F32, F32), (F32, BF16), (BF16, F32), (BF16, BF16))  # (activation, weight) dtypes
# (K, N, chunks): chunks of 3 and 5 (under one lane step), 25, 48 and 64; N tails of the tile.
SHAPES = ((24, 37, 8), (40, 33, 8), (100, 37, 4), (96, 70, 2), (64, 16, 1))
ROWS = (1, 2, 3, 8, 17, 20, 21)  # the C++ switches layouts at 3, 8 and 20 rows


def cpp_linear(x, w, b, chunks, out_dtype=None):
    return torch.ops.tonp.linear(x, w, b, chunks, out_dtype)


@pytest.mark.parametrize("xd,wd", PAIRS)
def test_linear_equals_cpp_at_every_layout_threshold(xd, wd, gen):
    """One Triton call of 21 rows (two row tiles) against the C++ op on every prefix size: the
    C++ dot tiles (1, 2 rows), its lane passes (3 rows with short chunks, 8 with fp32 weights,
    20 with bf16) and the Triton row-tile edge all give each row the same bits."""
    for i, (K, N, C) in enumerate(SHAPES):
        out_dtype = (None, F32 if xd == BF16 else BF16)[i % 2]
        w = randn(N, K, dtype=wd, gen=gen, scale=K ** -0.5)
        b = randn(N, dtype=xd, gen=gen) if N % 2 else None
        x = randn(max(ROWS), K, dtype=xd, gen=gen)
        y = linear.linear(x, w, b, C, out_dtype)
        for m in ROWS:
            assert_bitwise(y[:m], cpp_linear(x[:m], w, b, C, out_dtype),
                           f"linear K={K} N={N} C={C} {xd}/{wd}->{out_dtype} M={m}")


def test_linear_small_and_large_batches_and_any_tile(gen):
    """1-3 rows alone (a partly filled row tile), 100 rows (two C++ row blocks of 50), and
    other tile shapes (BM, BN): the tile never changes a bit."""
    K, N, C = 40, 37, 8
    w = randn(N, K, gen=gen, scale=K ** -0.5)
    b = randn(N, gen=gen)
    x = randn(100, K, gen=gen)
    for m in (1, 2, 3, 100):
        assert_bitwise(linear.linear(x[:m], w, b, C), cpp_linear(x[:m], w, b, C), f"M={m}")
    ref = cpp_linear(x[:40], w, b, C)
    for block in ((8, 16), (32, 64), (64, 8)):
        assert_bitwise(linear.linear(x[:40], w, b, C, block=block), ref, f"tile {block}")


def test_stock_linear_differs_from_the_exact_bits(gen):
    """The twin: F.linear (MKL's order) on the same fp32 inputs gives other bits."""
    K, N = 100, 37
    w, x = randn(N, K, gen=gen, scale=K ** -0.5), randn(21, K, gen=gen)
    exact = linear.linear(x, w, None, 4)
    assert torch.equal(exact, cpp_linear(x, w, None, 4))
    assert not torch.equal(F.linear(x, w), exact)


@pytest.mark.parametrize("dtype", (F32, BF16))
def test_tp_partials_finish_to_the_full_linear(dtype, gen):
    """A row-parallel rank's partial (chunks = C / t over its K / t columns, fp32 out: C = 1
    and 2 here) equals the C++ partial, and the tree over the t partials gives the full linear."""
    K, N, C = 64, 24, 4
    w = randn(N, K, dtype=dtype, gen=gen, scale=K ** -0.5)
    x = randn(5, K, dtype=dtype, gen=gen)
    full = linear.linear(x, w, None, C, F32)
    for t in (2, 4):
        kt = K // t
        shards = [(x[:, r * kt:(r + 1) * kt].contiguous(), w[:, r * kt:(r + 1) * kt].contiguous())
                  for r in range(t)]
        parts = [linear.linear(xs, ws, None, C // t, F32) for xs, ws in shards]
        for r, (p, (xs, ws)) in enumerate(zip(parts, shards)):
            assert_bitwise(p, cpp_linear(xs, ws, None, C // t, F32), f"TP={t} rank {r} partial")
        assert_bitwise(tk.tree_sum(parts), full, f"TP={t} tree of partials")


@pytest.mark.parametrize("xd,wd", PAIRS)
def test_moe_experts_equal_cpp(xd, wd, gen):
    """Rows grouped by expert into row tiles (some experts get none, one gets 17+ rows), an
    expert offset (an EP rank's share), chunks 1 to 8 (chunks of 2 and 4 elements too)."""
    E, Kk, H, I = 4, 2, 32, 16
    gate_up = randn(E, 2 * I, H, dtype=wd, gen=gen, scale=H ** -0.5)
    down = randn(E, H, I, dtype=wd, gen=gen, scale=I ** -0.5)
    for M, chunks in ((1, 8), (3, 1), (17, 4), (9, 2)):
        x = randn(M, H, dtype=xd, gen=gen)
        logits = torch.randn(M, E, generator=gen) + torch.tensor([3.0, 1.0, 0.0, -9.0])
        ids = logits.topk(Kk, -1).indices + 5
        y = moe.moe_experts(x, ids, gate_up, down, 5, chunks)
        assert_bitwise(y, torch.ops.tonp.moe_experts(x, ids, gate_up, down, 5, chunks),
                       f"moe_experts M={M} chunks={chunks} {xd}/{wd}")


@pytest.mark.parametrize("xd,wd", PAIRS)
def test_rms_norm_equals_cpp(xd, wd, gen):
    for H in (37, 64):  # a lane tail; none
        w = randn(H, dtype=wd, gen=gen)
        for shape in ((1, H), (17, H), (2, 3, H)):
            x = randn(*shape, dtype=xd, gen=gen, scale=3.0)
            assert_bitwise(rowwise.rms_norm(x, w, 1e-6), torch.ops.tonp.rms_norm(x, w, 1e-6),
                           f"rms_norm {shape} {xd}/{wd}")


def test_stock_rms_norm_and_silu_differ_from_the_exact_bits(gen):
    """The twins: torch's rsqrt / mean and its own exp in F.silu give other bits."""
    x, w = randn(17, 64, gen=gen, scale=3.0), randn(64, gen=gen)
    exact = rowwise.rms_norm(x, w, 1e-6)
    xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert not torch.equal(w * xf, exact)
    g, u = randn(7, 301, gen=gen, scale=4.0), randn(7, 301, gen=gen)
    assert not torch.equal(F.silu(g) * u, rowwise.silu_mul(g, u))


@pytest.mark.parametrize("dtype", (F32, BF16))
def test_silu_mul_equals_cpp(dtype, gen):
    for shape in ((7, 301), (1, 5), (3, 2, 64)):  # vector tails and whole vectors
        g, u = randn(*shape, dtype=dtype, gen=gen, scale=6.0), randn(*shape, dtype=dtype, gen=gen)
        g.view(-1)[:3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's clamps
        assert_bitwise(rowwise.silu_mul(g, u), torch.ops.tonp.silu_mul(g, u), f"silu_mul {shape}")


@pytest.mark.parametrize("dtype", (F32, BF16))
def test_rope_equals_cpp(dtype, gen):
    cos, sin = randn(50, 20, gen=gen), randn(50, 20, gen=gen)
    x = randn(6, 3, 20, dtype=dtype, gen=gen, scale=3.0)
    pos = torch.tensor([0, 49, 7, 7, 3, 21])
    exact = rowwise.rope(x, cos, sin, pos)
    assert_bitwise(exact, torch.ops.tonp.rope(x, cos, sin, pos), f"rope {dtype}")
    if dtype == BF16:  # the twin: one rounding at the end instead of the expression's four
        c, s = cos[pos][:, None], sin[pos][:, None]
        xf = x.float()
        fused = (xf * c + torch.cat((-xf[..., 10:], xf[..., :10]), -1) * s).to(dtype)
        assert not torch.equal(fused, exact)


@pytest.mark.parametrize("dtype", (F32, BF16))
def test_moe_combine_equals_cpp(dtype, gen):
    for M, K, H in ((1, 1, 8), (5, 3, 70), (17, 8, 16)):
        w, y = torch.rand(M, K, generator=gen), randn(M, K, H, dtype=dtype, gen=gen)
        exact = rowwise.moe_combine(w, y)
        assert_bitwise(exact, torch.ops.tonp.moe_combine(w, y), f"moe_combine {M}x{K}x{H}")
    if dtype == F32:  # the twin: products rounded, then torch's sum
        assert not torch.equal((w[..., None] * y).sum(1), exact)


def _router_logits(M, E, dtype, gen):
    x = randn(M, E, dtype=dtype, gen=gen, scale=2.0)
    x[0, 1:4] = x[0, 5 % E]  # ties: the lower id wins
    if M > 2:
        x[1, : E // 2] = float("-inf")
        x[2, 2] = float("nan")  # a NaN that never wins
    if M > 3:
        x[3, 0] = float("nan")  # the scan's first value NaN: the max stays NaN
    return x


@pytest.mark.parametrize("dtype", (F32, BF16))
def test_moe_route_equals_cpp(dtype, gen):
    for M, E, k in ((1, 8, 2), (17, 12, 3), (5, 6, 6), (4, 40, 8), (5, 128, 8)):  # 30B: 128, 8
        x = _router_logits(M, E, dtype, gen)
        for normalize in (True, False):
            ids, w = moe.moe_route(x, k, normalize)
            ref_ids, ref_w = torch.ops.tonp.moe_route(x, k, normalize)
            assert torch.equal(ids, ref_ids), f"moe_route ids M={M} E={E} k={k}"
            assert_bitwise(bits(w), bits(ref_w), f"moe_route weights M={M} E={E} k={k}")


def test_stock_router_weights_differ_from_the_exact_bits(gen):
    """The twin: torch.softmax (its own exp and sum order) + topk give other weight bits."""
    x = randn(16, 24, gen=gen, scale=2.0)
    _, w = moe.moe_route(x, 8, False)
    assert not torch.equal(torch.softmax(x, -1).topk(8, -1).values, w)


def test_bad_inputs_raise_clear_errors(gen):
    x, w = randn(3, 16, gen=gen), randn(8, 16, gen=gen)
    with pytest.raises(ValueError, match="do not match"):
        linear.linear(x, w[:, :8])
    with pytest.raises(ValueError, match="power of two"):
        linear.linear(x, w, None, 3)
    with pytest.raises(ValueError, match="not divisible"):
        linear.linear(x, w, None, 32)
    with pytest.raises(TypeError, match="out_dtype"):
        linear.linear(x, w, None, 8, torch.float16)
    with pytest.raises(ValueError, match="bias"):
        linear.linear(x, w, randn(3, gen=gen))
    with pytest.raises(TypeError, match="weight"):
        rowwise.rms_norm(x, w[0].half(), 1e-6)
    with pytest.raises(IndexError, match="position 9"):
        rowwise.rope(x.view(3, 1, 16), randn(4, 16, gen=gen), randn(4, 16, gen=gen),
                     torch.tensor([0, 9, 1]))
    with pytest.raises(ValueError, match="top_k=17"):
        moe.moe_route(w, 17, True)
    with pytest.raises(IndexError, match="expert id 7"):
        moe.moe_experts(x, torch.tensor([[0], [7], [1]]), randn(4, 8, 16, gen=gen),
                        randn(4, 16, 4, gen=gen), 0, 1)
    with pytest.raises(TypeError, match="float32"):
        rowwise.moe_combine(torch.ones(3, 2, dtype=torch.float64), randn(3, 2, 4, gen=gen))
    # Empty batches and K = 0 give the C++ op's results.
    assert linear.linear(x[:0], w).shape == (0, 8)
    b = randn(8, gen=gen)
    assert_bitwise(linear.linear(x[:, :0], w[:, :0], b), cpp_linear(x[:, :0], w[:, :0], b, 8))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's overflow / invalid: intended
def test_bf16_pair_chains_on_hostile_inputs_equal_cpp(gen):
    """bf16 x bf16 (pair chains): subnormal inputs read as zero, products near FLT_MIN flushed
    after rounding, overflow, inf, NaN and exact cancellation give the C++ bits; the twin: plain
    fma lanes (the fp32-weight arithmetic) give other bits on the same inputs."""
    from test_kernels_bf16dot import _hostile
    x, w = _hostile(30, 64, gen), _hostile(37, 64, gen)
    w[:, 1::2] = w[:, 0::2]
    for C in (1, 4):
        got = linear.linear(x, w, None, C, F32)
        assert torch.equal(bits(got), bits(cpp_linear(x, w, None, C, F32))), f"chunks={C}"
    tiny = torch.full((1, 16), 2.0 ** -70).bfloat16()  # products 2^-140: subnormal under IEEE
    lanes = linear.linear(tiny, tiny.float(), None, 1, F32)
    assert float(linear.linear(tiny, tiny, None, 1, F32)) == 0.0 and float(lanes) > 0.0
