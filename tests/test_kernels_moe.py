"""moe_experts: every (token, slot) row through its SwiGLU expert, all experts in one call.

Bitwise: a row's output does not depend on its batch, its slot, how many rows its expert got,
or the thread count; the fused call equals one `linear` / `silu_mul` / `linear` call per expert
(the path inspection tools hook), with or without an expert offset (an EP rank's share). The
twin: stock torch's per-expert F.linear depends on how many rows the expert got. Accuracy and
gradients against the reference; AVX2 against the portable build; clear errors.
"""
from __future__ import annotations

import pytest
import torch

import tonp_kernels as tk
from tonp_kernels import reference
from conftest import (DTYPES, ROW_COUNTS, assert_bitwise, assert_close, check_row_invariance,
                      check_thread_invariance, env, randn, rows_differ_somewhere)

E, K, H, I = 8, 3, 64, 48


def experts(dtype, gen, e=E, h=H, i=I):
    return (randn(e, 2 * i, h, dtype=dtype, gen=gen, scale=h ** -0.5),
            randn(e, h, i, dtype=dtype, gen=gen, scale=i ** -0.5))


def route(n, gen, e=E, k=K, first=0):
    """k distinct expert ids per row, skewed so some experts get many rows and some none."""
    logits = torch.randn(n, e, generator=gen) + torch.linspace(2, -2, e)
    return logits.topk(k, -1).indices + first


def one_call_per_expert(x, ids, gate_up, down, first=0):
    """The unfused path: per expert, its rows through tk.linear, tk.silu_mul, tk.linear."""
    y = torch.zeros(*ids.shape, x.shape[1], dtype=x.dtype)
    i = down.shape[2]
    for e in range(gate_up.shape[0]):
        m, k = (ids == e + first).nonzero(as_tuple=True)
        if m.numel():
            gu = tk.linear(x[m], gate_up[e])
            y[m, k] = tk.linear(tk.silu_mul(gu[:, :i].contiguous(), gu[:, i:].contiguous()), down[e])
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", ROW_COUNTS)
def test_moe_experts_rows_do_not_depend_on_their_batch(M, dtype, gen):
    gate_up, down = experts(dtype, gen)
    check_row_invariance(lambda x, ids: tk.moe_experts(x, ids, gate_up, down),
                         lambda n: [randn(n, H, dtype=dtype, gen=gen), route(n, gen)], M)


def test_stock_experts_depend_on_the_rows_per_expert(torch_mode, gen):
    """The twin: transformers-style per-expert F.linear changes a row's bits with the number of
    rows its expert received."""
    h, i = 512, 256
    gate_up, down = experts(torch.float32, gen, h=h, i=i)
    assert rows_differ_somewhere(lambda x, ids: tk.moe_experts(x, ids, gate_up, down),
                                 lambda n: [randn(n, h, gen=gen), route(n, gen)], (16, 40))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_equals_one_call_per_expert_and_an_ep_share(dtype, gen):
    gate_up, down = experts(dtype, gen)
    x, ids = randn(150, H, dtype=dtype, gen=gen), route(150, gen)   # > 96 rows for expert 0
    y = tk.moe_experts(x, ids, gate_up, down)
    assert y.shape == (150, K, H) and y.dtype == dtype
    assert_bitwise(y, one_call_per_expert(x, ids, gate_up, down), "fused vs per-expert calls")
    # An EP rank holding experts 4..7 sees only the rows routed to them, as [R, 1] ids.
    m, k = (ids >= 4).nonzero(as_tuple=True)
    share = tk.moe_experts(x[m], ids[m, k].unsqueeze(1), gate_up[4:], down[4:], first_expert=4)
    assert_bitwise(share[:, 0], y[m, k], "experts 4..7 on their own (EP share)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_experts_accuracy_gradients_and_layouts(dtype, gen):
    gate_up, down = experts(dtype, gen)
    x, ids = randn(37, H, dtype=dtype, gen=gen), route(37, gen)
    y = tk.moe_experts(x, ids, gate_up, down)
    assert_close(y, reference.moe_experts(x, ids, gate_up, down), dtype=dtype,
                 scale=float(y.float().abs().max()), what="moe_experts")
    x_view = x.t().contiguous().t()
    assert_bitwise(tk.moe_experts(x_view, ids.t().contiguous().t(), gate_up, down), y,
                   "column-major x and ids")
    assert tk.moe_experts(x[:0], ids[:0], gate_up, down).shape == (0, K, H)
    check_thread_invariance(lambda a: tk.moe_experts(a, ids, gate_up, down), x,
                            what="moe_experts")
    g = randn(37, K, H, dtype=dtype, gen=gen)
    grads = []
    for fn in (tk.moe_experts, reference.moe_experts):
        ins = [t.clone().requires_grad_(True) for t in (x, gate_up, down)]
        fn(ins[0], ids, ins[1], ins[2]).backward(g)
        grads.append([t.grad for t in ins])
    for name, a, e in zip(("x", "gate_up", "down"), *grads):
        assert a.dtype == dtype
        assert_close(a, e, dtype=dtype, scale=float(e.float().abs().max()),
                     what=f"moe_experts d{name}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_experts_avx2_and_portable_give_the_same_bits(dtype, gen):
    gate_up, down = experts(dtype, gen, h=40, i=24)   # vector tails: 40 and 24 are not x16
    x, ids = randn(29, 40, dtype=dtype, gen=gen), route(29, gen)
    with env("TONP_FORCE_PORTABLE", None):
        fast = tk.moe_experts(x, ids, gate_up, down)
    with env("TONP_FORCE_PORTABLE", "1"):
        portable = tk.moe_experts(x, ids, gate_up, down)
    assert_bitwise(portable, fast, "portable vs AVX2")


def test_moe_experts_bad_inputs_raise_clear_errors(gen):
    gate_up, down = experts(torch.float32, gen)
    x, ids = randn(5, H, gen=gen), route(5, gen)
    with pytest.raises(IndexError, match="not one of this call's experts"):
        tk.moe_experts(x, ids, gate_up[:4], down[:4])
    with pytest.raises(IndexError, match="not one of this call's experts"):
        tk.moe_experts(x, ids, gate_up, down, first_expert=1)
    with pytest.raises(ValueError, match="gate_up"):
        tk.moe_experts(x, ids, gate_up, down[:, :, :16])
    with pytest.raises(ValueError, match="expert ids"):
        tk.moe_experts(x, ids[:4], gate_up, down)
    with pytest.raises(TypeError, match="int64"):
        tk.moe_experts(x, ids.int(), gate_up, down)
    with pytest.raises(ValueError, match="divisible"):
        tk.moe_experts(x, ids, gate_up, down, chunks=32)      # I = 48
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        tk.moe_experts(x.half(), ids, gate_up, down)
    with pytest.raises(RuntimeError, match="CPU"):
        tk.moe_experts(x.to("meta"), ids, gate_up, down)


def test_torch_compile_through_moe_experts_and_rope(gen):
    """The fused expert op and rope trace under torch.compile (fake impls + C++ autograd): the
    same forward bits as eager, and gradients that match eager."""
    gate_up, down = experts(torch.float32, gen)
    x, ids = randn(9, H, gen=gen), route(9, gen)
    table = torch.randn(32, H, generator=gen)
    pos = torch.arange(9)

    def f(x, gate_up, down):
        y = tk.moe_experts(x, ids, gate_up, down)                          # (9, K, H)
        return tk.rope(y, table, table.flip(0), pos).square().sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    ins = [t.clone().requires_grad_(True) for t in (x, gate_up, down)]
    ref = [t.clone().requires_grad_(True) for t in (x, gate_up, down)]
    out, expected = compiled(*ins), f(*ref)
    assert_bitwise(out, expected, "compiled vs eager")
    out.backward()
    expected.backward()
    for a, e in zip(ins, ref):
        assert_close(a.grad, e.grad, dtype=torch.float32, scale=float(e.grad.abs().max()),
                     what="compiled gradient")
