"""tonp's row-wise ops and the torch elementwise ops the model leans on.

rms_norm, silu_mul, moe_route and moe_combine: row invariance (any batch, order, thread count),
accuracy and gradients against the reference, ties in the router, odd layouts, errors.
The elementwise torch ops of the model (RoPE's mul/add/cat, residual adds) are checked to be
row-invariant as they stand; stock F.silu is not (its vector and scalar tails round
differently: the twin). The AVX2 path against the portable scalar path, and tk.isa().
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tonp_kernels as tk
from tonp_kernels import reference
from conftest import (DTYPES, ROW_COUNTS, assert_bitwise, assert_close, check_row_invariance,
                      check_thread_invariance, env, randn, rows_differ_somewhere)

H_SIZES = (64, 40, 2048)  # a head_dim (QK-norm), an odd width with a vector tail, hidden size


# --- rms_norm ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", ROW_COUNTS)
def test_rms_norm_rows_do_not_depend_on_their_batch(M, dtype, gen):
    for H in H_SIZES:
        w = 1 + randn(H, dtype=dtype, gen=gen, scale=0.1)
        check_row_invariance(lambda x: tk.rms_norm(x, w, 1e-6),
                             lambda n: [randn(n, H, dtype=dtype, gen=gen, scale=3.0)], M)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_accuracy_gradients_and_layouts(dtype, gen):
    H = 128
    w = 1 + randn(H, dtype=dtype, gen=gen, scale=0.1)
    x = randn(21, H, dtype=dtype, gen=gen, scale=3.0)
    y = tk.rms_norm(x, w, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, reference.rms_norm(x, w, 1e-6), dtype=dtype, what="rms_norm vs reference")
    # QK-norm: per-head norm of a [T, heads, D] view of a fused projection.
    qkv = randn(9, 6, H, dtype=dtype, gen=gen)
    q = qkv[:, :4]
    assert not q.is_contiguous()
    assert_bitwise(tk.rms_norm(q, w, 1e-6), tk.rms_norm(q.contiguous(), w, 1e-6), "view input")
    assert_bitwise(tk.rms_norm(q.contiguous(), w, 1e-6).reshape(-1, H),
                   tk.rms_norm(q.reshape(-1, H), w, 1e-6), "[T, heads, D] vs rows")
    assert tk.rms_norm(x[:0], w, 1e-6).shape == (0, H)
    # A weight in the other dtype (fp32 norm weights with bf16 activations): output in x.dtype.
    w_other = w.float() if dtype == torch.bfloat16 else w.bfloat16()
    y_mixed = tk.rms_norm(x, w_other, 1e-6)
    assert y_mixed.dtype == dtype
    assert_close(y_mixed, reference.rms_norm(x, w_other, 1e-6), dtype=dtype, what="mixed dtypes")
    check_thread_invariance(lambda x: tk.rms_norm(x, w, 1e-6), x, what="rms_norm")
    grads = []
    for fn in (tk.rms_norm, reference.rms_norm):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        fn(xi, wi, 1e-6).backward(torch.ones_like(y))
        grads.append((xi.grad, wi.grad))
    for name, a, e in zip(("x", "weight"), *grads):
        assert_close(a, e, dtype=dtype, scale=float(e.abs().max()), what=f"rms_norm d{name}")


# --- silu_mul ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", ROW_COUNTS)
def test_silu_mul_rows_do_not_depend_on_their_batch(M, dtype, gen):
    for H in (37, 768):
        check_row_invariance(tk.silu_mul, lambda n: [randn(n, H, dtype=dtype, gen=gen, scale=4.0),
                                                     randn(n, H, dtype=dtype, gen=gen)], M)


def test_stock_silu_depends_on_the_batch(torch_mode, gen):
    """The twin: F.silu's vector body and scalar tail round differently, so with a width that
    is not a multiple of the vector a row alone differs from the same row in a batch."""
    assert rows_differ_somewhere(tk.silu_mul, lambda n: [randn(n, 37, gen=gen, scale=4.0),
                                                         randn(n, 37, gen=gen)], (50,))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_accuracy_gradients_and_layouts(dtype, gen):
    # gate and up as the two halves of a fused gate_up projection (non-contiguous views).
    gate_up = randn(33, 2 * 96, dtype=dtype, gen=gen, scale=4.0)
    gate, up = gate_up.chunk(2, dim=-1)
    y = tk.silu_mul(gate, up)
    assert y.dtype == dtype and y.shape == gate.shape
    assert_bitwise(y, tk.silu_mul(gate.contiguous(), up.contiguous()), "fused-projection views")
    assert_close(y, reference.silu_mul(gate, up), dtype=dtype, scale=4.0, what="silu_mul")
    assert tk.silu_mul(gate[:0], up[:0]).shape == (0, 96)
    check_thread_invariance(tk.silu_mul, gate.contiguous(), up.contiguous(), what="silu_mul")
    grads = []
    for fn in (tk.silu_mul, reference.silu_mul):
        g, u = gate.detach().clone().requires_grad_(True), up.detach().clone().requires_grad_(True)
        fn(g, u).backward(torch.ones_like(y))
        grads.append((g.grad, u.grad))
    for name, a, e in zip(("gate", "up"), *grads):
        assert_close(a, e, dtype=dtype, scale=float(e.abs().max()), what=f"silu_mul d{name}")


# --- moe_route --------------------------------------------------------------------------------
ROUTES = ((128, 8, True), (64, 4, False))  # (experts, top_k, normalize): Qwen3-30B-A3B first


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", ROW_COUNTS)
def test_moe_route_rows_do_not_depend_on_their_batch(M, dtype, gen):
    for E, k, norm in ROUTES:
        check_row_invariance(lambda x: tk.moe_route(x, k, norm),
                             lambda n: [randn(n, E, dtype=dtype, gen=gen, scale=2.0)], M)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_route_matches_the_reference(dtype, gen):
    for E, k, norm in ROUTES:
        x = randn(50, E, dtype=dtype, gen=gen, scale=2.0)
        ids, w = tk.moe_route(x, k, norm)
        assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (50, k)
        ref_ids, ref_w = reference.moe_route(x, k, norm)
        # bf16 logits tie often; torch.topk's order among ties is unspecified, ours is stable.
        probs = torch.softmax(x.float(), -1)
        stable = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
        assert_bitwise(ids, stable, f"expert ids E={E} k={k}")
        assert_close(w, ref_w, dtype=torch.float32, what=f"weights E={E} k={k}")
        if norm:
            assert_close(w.sum(-1), torch.ones(50), dtype=torch.float32, what="renormalised")
        assert bool((w[:, :-1] >= w[:, 1:]).all()), "slots are in descending weight order"


def test_moe_route_ties_go_to_the_lower_expert_id(gen):
    # Few distinct values: most rows have ties across the top-k boundary and inside it.
    x = torch.randint(0, 3, (200, 16), generator=gen).float()
    x[0] = 1.0                                            # all tied -> experts 0..k-1
    ids, w = tk.moe_route(x, 4, True)
    want = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :4]
    assert_bitwise(ids, want, "stable top-k")
    assert ids[0].tolist() == [0, 1, 2, 3]
    check_thread_invariance(lambda x: tk.moe_route(x, 4, True), x, what="moe_route")


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_route_gradients_and_layouts(dtype, gen):
    # Distinct logits (multiples of 1/8, exact in bf16): with ties the two could pick different
    # experts and the gradients would not be comparable.
    x0 = torch.stack([torch.randperm(32, generator=gen) for _ in range(12)]).to(dtype) / 8 - 2
    g = torch.randn(12, 4, generator=gen)
    grads = []
    for fn in (tk.moe_route, reference.moe_route):
        x = x0.clone().requires_grad_(True)
        fn(x, 4, True)[1].backward(g)
        grads.append(x.grad)
    assert_close(grads[0], grads[1], dtype=dtype, scale=float(grads[1].abs().max()),
                 what="moe_route d logits")
    fused = randn(12, 40, dtype=dtype, gen=gen)[:, 8:]    # a view with a row stride of 40
    assert_bitwise(tk.moe_route(fused, 4, True), tk.moe_route(fused.contiguous(), 4, True),
                   "strided router logits")
    ids, w = tk.moe_route(x0[:0], 4, True)
    assert ids.shape == (0, 4) and w.shape == (0, 4)


# --- moe_combine ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", ROW_COUNTS)
def test_moe_combine_rows_do_not_depend_on_their_batch(M, dtype, gen):
    H, K = 72, 8

    def make(n):
        return [torch.softmax(torch.randn(n, K, generator=gen), -1),
                randn(n, K, H, dtype=dtype, gen=gen)]

    check_row_invariance(tk.moe_combine, make, M)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_combine_accuracy_gradients_and_layouts(dtype, gen):
    M, K, H = 19, 8, 64
    w0 = torch.softmax(torch.randn(M, K, generator=gen), -1)
    y0 = randn(M, K, H, dtype=dtype, gen=gen)
    out = tk.moe_combine(w0, y0)
    assert out.dtype == dtype and out.shape == (M, H)
    assert_close(out, reference.moe_combine(w0, y0), dtype=dtype, what="moe_combine")
    exact = (w0.double().unsqueeze(-1) * y0.double()).sum(1)
    err = float((tk.moe_combine(w0, y0).double() - exact).abs().max())
    assert err < (1e-6 if dtype == torch.float32 else 2e-2), f"off float64 by {err:.2e}"
    y_view = y0.transpose(0, 1).contiguous().transpose(0, 1)   # slot-major memory
    assert_bitwise(tk.moe_combine(w0, y_view), out, "slot-major expert_out")
    assert_bitwise(tk.moe_combine(w0.t().contiguous().t(), y0), out, "column-major weights")
    assert tk.moe_combine(w0[:0], y0[:0]).shape == (0, H)
    check_thread_invariance(tk.moe_combine, w0, y0, what="moe_combine")
    g = randn(M, H, dtype=dtype, gen=gen)
    grads = []
    for fn in (tk.moe_combine, reference.moe_combine):
        w, y = w0.clone().requires_grad_(True), y0.clone().requires_grad_(True)
        fn(w, y).backward(g)
        grads.append((w.grad, y.grad))
    for name, a, e in zip(("weights", "expert_out"), *grads):
        assert_close(a, e, dtype=dtype, scale=float(e.abs().max()), what=f"moe_combine d{name}")


def _bf16_rne_bits(x32):
    """fp32 values rounded to bf16 bits as the kernels round every output (round to nearest
    even, every NaN 0x7fc0), in integer ops."""
    b = x32.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    return torch.where(x32.isnan(), torch.full_like(r, 0x7FC0), r)


def test_moe_combine_rounds_hostile_sums_to_bf16_alike_on_every_build(gen):
    """bf16 outputs of sums that are NaN (inf - inf), infinite, overflowing, subnormal or ties:
    every build this CPU has (its vector store of eight roundings, the portable one's scalar
    rounding) gives the bits of the documented rounding of the fp32 sum; torch's own conversion
    of that sum keeps the x86 default NaN's sign (0xffc0), so it is not the rule."""
    M, K, H = 21, 8, 2048 + 5            # a vector tail
    y = torch.randn(M, K, H, generator=gen)
    pick = torch.rand(M, K, H, generator=gen)
    y = torch.where(pick < 0.01, torch.full_like(y, float("inf")), y)
    y = torch.where((pick > 0.01) & (pick < 0.02), torch.full_like(y, float("-inf")), y)
    y = torch.where((pick > 0.02) & (pick < 0.04), y * 3e38, y)
    y = torch.where((pick > 0.04) & (pick < 0.07), y * 1e-39, y)
    y = y.bfloat16()
    w = torch.softmax(torch.randn(M, K, generator=gen), -1)
    w[:, :2] = 1.0                       # columns 0-63: exact ties, 1 + 2^-8 and 1 + 3 * 2^-8
    y[:, :, :64] = 0
    y[:, 0, :32], y[:, 0, 32:64], y[:, 1, :64] = 1.0, 1.0 + 2 ** -7, 2 ** -8
    sums = tk.moe_combine(w, y.float())  # the same chains in fp32 (bf16 loads widen exactly)
    want = _bf16_rne_bits(sums)
    assert int((sums.isnan() & (sums.view(torch.int32) < 0)).sum()) > 0, "no negative NaN sum drawn"
    builds = [("native", None)] + ([("avx2", "TONP_FORCE_AVX2")] if _cpu_has_avx2_fma() else []) + \
        [("portable", "TONP_FORCE_PORTABLE")]
    for name, var in builds:
        with env("TONP_FORCE_PORTABLE", None), env("TONP_FORCE_AVX2", None):
            if var is None:
                got = tk.moe_combine(w, y)
            else:
                with env(var, "1"):
                    got = tk.moe_combine(w, y)
        assert torch.equal(got.view(torch.int16).to(torch.int64) & 0xFFFF, want), f"{name} build"
    stock = sums.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    assert not torch.equal(stock, want), "torch's conversion now rounds NaN as the kernels do"


# --- the elementwise torch ops of the model ---------------------------------------------------
def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_tables(positions, D, theta=1e6):
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", (64, 128))
def test_rope_and_residual_adds_are_row_invariant(D, dtype, gen):
    """HF-style RoPE (x*cos + rotate_half(x)*sin, tables cast to the activation dtype) and the
    residual adds are elementwise torch ops: rows must not depend on the batch, whether the
    cos/sin tables are computed for the batch's positions or gathered from a full table."""
    table_cos, table_sin = _rope_tables(torch.arange(4096), D)

    def rope_on_the_fly(x, pos):
        cos, sin = (t.to(x.dtype)[:, None, :] for t in _rope_tables(pos, D))
        return x * cos + _rotate_half(x) * sin

    def rope_gathered(x, pos):
        cos, sin = (t[pos].to(x.dtype)[:, None, :] for t in (table_cos, table_sin))
        return x * cos + _rotate_half(x) * sin

    def make(n):
        return [randn(n, 4, D, dtype=dtype, gen=gen), torch.randint(0, 4096, (n,), generator=gen)]

    for M in (1, 7, 130):
        check_row_invariance(rope_on_the_fly, make, M)
        check_row_invariance(rope_gathered, make, M)
        check_row_invariance(lambda x, r: x + r, lambda n: [randn(n, 40, dtype=dtype, gen=gen),
                                                             randn(n, 40, dtype=dtype, gen=gen)], M)
    check_thread_invariance(rope_on_the_fly, *make(300), what="rope")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_op_equals_the_torch_expression(dtype, gen):
    """tk.rope (the model's RoPE) gives the bits of the same expression in torch ops, for any
    batch; its gradient matches the reference's autograd; bad input fails clearly."""
    D = 128
    table_cos, table_sin = _rope_tables(torch.arange(512), D)

    def torch_rope(x, pos):
        cos, sin = (t[pos].to(x.dtype)[:, None, :] for t in (table_cos, table_sin))
        return x * cos + _rotate_half(x) * sin

    def make(n):
        return [randn(n, 5, D, dtype=dtype, gen=gen, scale=3.0),
                torch.randint(0, 512, (n,), generator=gen)]

    op = lambda x, p: tk.rope(x, table_cos, table_sin, p)  # noqa: E731
    for M in (1, 7, 130):
        x, pos = make(M)
        assert_bitwise(op(x, pos), torch_rope(x, pos), f"rope M={M}")
        check_row_invariance(op, make, M)
    x, pos = make(33)
    check_thread_invariance(op, x, pos, what="rope")
    assert_bitwise(op(x.transpose(0, 1).contiguous().transpose(0, 1), pos), op(x, pos),
                   "non-contiguous x")
    g = randn(*x.shape, dtype=dtype, gen=gen)
    grads = []
    for fn in (tk.rope, reference.rope):
        xi = x.clone().requires_grad_(True)
        fn(xi, table_cos, table_sin, pos).backward(g)
        grads.append(xi.grad)
    assert_close(grads[0], grads[1], dtype=dtype, scale=3.0, what="rope dx")
    with pytest.raises(IndexError, match="outside the table"):
        op(x, pos + 512)
    with pytest.raises(ValueError, match="tables"):
        tk.rope(x, table_cos[:, :64], table_sin[:, :64], pos)
    with pytest.raises(ValueError, match="positions"):
        op(x, pos[:3])


def test_bad_inputs_raise_clear_errors(gen):
    x = randn(3, 16, gen=gen)
    with pytest.raises(ValueError, match="does not match"):
        tk.rms_norm(x, torch.ones(15), 1e-6)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        tk.rms_norm(x.half(), torch.ones(16).half(), 1e-6)
    with pytest.raises(RuntimeError, match="CPU"):
        tk.rms_norm(x.to("meta"), torch.ones(16, device="meta"), 1e-6)
    with pytest.raises(ValueError, match="must match"):
        tk.silu_mul(x, x[:, :8])
    with pytest.raises(ValueError, match="must match"):
        tk.silu_mul(x, x.bfloat16())
    with pytest.raises(RuntimeError, match="CPU"):
        tk.silu_mul(x.to("meta"), x.to("meta"))
    with pytest.raises(ValueError, match="top_k"):
        tk.moe_route(x, 17, True)
    with pytest.raises(ValueError, match="top_k"):
        tk.moe_route(x, 0, True)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        tk.moe_route(torch.ones(3, 16, dtype=torch.int64), 2, True)
    with pytest.raises(RuntimeError, match="CPU"):
        tk.moe_route(x.to("meta"), 2, True)
    with pytest.raises(ValueError, match="weights"):
        tk.moe_combine(torch.ones(3, 4), torch.ones(3, 2, 16))
    with pytest.raises(RuntimeError, match="CPU"):
        tk.moe_combine(torch.ones(3, 2), torch.ones(3, 2, 16, device="meta"))


# --- the AVX2 path against the portable scalar path ----------------------------------------------
def _cpu_flags() -> set:
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:  # not Linux: ask torch (its AVX2 level requires FMA too)
        cap = torch.backends.cpu.get_cpu_capability()
        return {"avx2", "fma"} if cap in ("AVX2", "AVX512") else set()


def _cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma"} <= _cpu_flags()


def _native_isa() -> str:
    """The table a plain run picks: avx512bf16 where the CPU has AVX512-F/BW/VL/BF16 (its
    instruction self-checked at load), avx2 with AVX2 + FMA, else portable."""
    if {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= _cpu_flags():
        return "avx512bf16"
    return "avx2" if _cpu_has_avx2_fma() else "portable"


def test_isa_reports_the_kernel_table_in_use():
    """tk.isa() names the table the ops run: the CPU's best build (above), AVX2 under
    TONP_FORCE_AVX2=1, the portable build under TONP_FORCE_PORTABLE=1 (read at each call)."""
    with env("TONP_FORCE_PORTABLE", None), env("TONP_FORCE_AVX2", None):
        assert tk.isa() == _native_isa()
        assert torch.ops.tonp.isa() == tk.isa()
        if _cpu_has_avx2_fma():
            with env("TONP_FORCE_AVX2", "1"):
                assert tk.isa() == "avx2"
    with env("TONP_FORCE_PORTABLE", "1"):
        assert tk.isa() == "portable"
    assert torch.ops.tonp.isa() == tk.isa()


def _every_op(dtype, gen):
    """Each kernel on inputs with vector tails (odd widths, odd lengths); returns the outputs."""
    x = randn(37, 256, dtype=dtype, gen=gen)
    w = randn(45, 256, dtype=dtype, gen=gen, scale=1 / 16)
    q, k, v = (randn(53, h, 64, dtype=dtype, gen=gen) for h in (8, 2, 2))
    cu = torch.tensor([0, 20, 53])
    kc, vc = k[:48].reshape(3, 16, 2, 64), v[:48].reshape(3, 16, 2, 64)
    pt = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    ids = torch.arange(37)
    table = torch.randn(64, 64, generator=gen)
    experts = torch.randint(0, 4, (37, 2), generator=gen)
    gate_up, down = randn(4, 48, 64, dtype=dtype, gen=gen), randn(4, 64, 24, dtype=dtype, gen=gen)
    return [tk.linear(x, w), tk.linear(x[:1], w),
            tk.linear_partial(x[:, :128], w[:, :128], chunks=4),
            tk.rms_norm(x[:, :40], x[0, :40], 1e-6), tk.silu_mul(x[:, :37], x[:, 37:74]),
            tk.attention_varlen(q, k, v, cu, scale=0.125, block=16),
            tk.attention_paged(q[:48], kc, vc, pt, torch.zeros(48, dtype=torch.int32),
                               torch.arange(48), scale=0.125),
            tk.rope(q, table, table.flip(0), ids.repeat(2)[:53]),
            *tk.lse_partial(x, chunks=8), *tk.max_with_index(x), tk.argmax(x),
            tk.token_logprobs(x, ids, temperature=0.7), tk.log_softmax(x, temperature=1.3),
            tk.sample(x, temperature=0.8, seed=5, request_ids=ids, positions=ids, top_p=0.9),
            *_vocab_tails(x, ids),
            *tk.moe_route(x[:, :64], 8, True),
            tk.moe_combine(torch.softmax(x[:, :8].float(), -1), x[:, :8 * 24].reshape(37, 8, 24)),
            tk.moe_experts(x[:, :64], experts, gate_up, down)]


def _vocab_tails(x, ids):
    """The vocabulary row passes on a width that is no multiple of eight, with masked entries,
    a tie at the top and a row whose maximum is a zero: sampling unfiltered, at T != 1, with
    top-k and a deep top-p cut; argmax; lse_partial's maxima."""
    y = x[:, :251].float().contiguous()
    y[:, 7::5] = float("-inf")
    y[1, 3] = y[1, 9] = y[1].max() + 1
    y[2] = -y[2].abs() - 1
    y[2, 40], y[2, 200] = -0.0, 0.0
    draw = lambda **kw: tk.sample(y, seed=2 ** 63 + 7, request_ids=ids, positions=ids + 3, **kw)  # noqa: E731
    return [draw(temperature=1.0), draw(temperature=0.3), draw(temperature=1.0, top_k=4),
            draw(temperature=1.7, top_p=0.4), tk.argmax(y), *tk.max_with_index(y),
            *tk.lse_partial(y, chunks=1)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_avx2_and_portable_paths_give_the_same_bits(dtype):
    """Every build this CPU has (its native one, AVX2, portable) gives every op the same bits."""
    if not _cpu_has_avx2_fma():
        pytest.skip("this CPU has no AVX2 + FMA: the portable kernels are the only ones here")
    with env("TONP_FORCE_PORTABLE", None), env("TONP_FORCE_AVX2", None):
        assert tk.isa() == _native_isa()
        native = _every_op(dtype, torch.Generator().manual_seed(5))
        with env("TONP_FORCE_AVX2", "1"):
            assert tk.isa() == "avx2"
            fast = _every_op(dtype, torch.Generator().manual_seed(5))
    with env("TONP_FORCE_PORTABLE", "1"):
        assert tk.isa() == "portable"
        portable = _every_op(dtype, torch.Generator().manual_seed(5))
    for i, (a, b) in enumerate(zip(native, fast, strict=True)):
        assert_bitwise(b, a, f"op #{i} ({dtype}) AVX2 vs {_native_isa()}")
    for i, (a, b) in enumerate(zip(fast, portable, strict=True)):
        assert_bitwise(b, a, f"op #{i} ({dtype}) portable vs AVX2")


def test_the_memory_pool_serves_a_smaller_request_from_a_freed_block(gen):
    """A rollout's prefill changes its row count every call: a freed pool block serves any later
    request of at least half its size (no fresh pages to fault in), and what is computed there
    is the same bits as anywhere else."""
    torch.ops.tonp.release_memory_pool()
    x = randn(1536, 2048, gen=gen)  # rms_norm's output: 12 MB, a pool block
    w = 1 + randn(2048, gen=gen, scale=0.1)
    a = tk.rms_norm(x, w, 1e-6)
    ref, block = a.clone(), a.data_ptr()
    del a
    b = tk.rms_norm(x[:1024], w, 1e-6)  # 8 MB: the 12 MB block
    assert b.data_ptr() == block
    assert torch.equal(b, ref[:1024])
    del b
    c = tk.rms_norm(x[:512], w, 1e-6)  # 4 MB: under half of it, a block of its own
    assert c.data_ptr() != block
    assert torch.equal(c, ref[:512])
    torch.ops.tonp.release_memory_pool()


def test_no_kernel_reads_memory_it_did_not_write(tmp_path):
    """Scratch and pool blocks are reused between calls, so a kernel that read what it had not
    written would see the last call's data. Under TONP_POISON=1 both are handed out as NaN bits:
    every output (linears on every layout, rms_norm, the experts, a model's generate and training
    forward) must keep its bits."""
    probe = Path(__file__).with_name("poison_probe.py")
    outs = []
    for poison in ("0", "1"):
        path = tmp_path / f"out{poison}.pt"
        env_ = dict(os.environ, TONP_POISON=poison)
        subprocess.run([sys.executable, str(probe), str(path)], env=env_, check=True, timeout=300)
        outs.append(torch.load(path))
    assert outs[0].keys() == outs[1].keys() and len(outs[0]) == 30
    for k in outs[0]:
        assert torch.equal(outs[0][k], outs[1][k]), k
