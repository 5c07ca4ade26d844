"""The experts' backward as grouped Triton GEMMs (accel/moe_grad.py: tonp.moe_experts_grad's
kernel on GPUs and NPUs), run by Triton's interpreter on CPU tensors: it agrees with the C++ op
(same dtypes, shapes and empty outputs; values at fp32 / one-bf16-rounding tolerances) and with
float64 autograd of the reference math, for experts without rows, an expert whose rows span
several row tiles and several weight-gradient steps, an EP share and every output mask. The
twin: a tile table that hands one tile to the wrong expert is caught by the same comparison.
The kernels' sm_90 compile (tensor cores for bf16, no spills) is in test_triton_fast_ptx.py."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_bitwise, randn
from test_device_grads import MASKS3, _autograd64, _ep_share, _experts, _near64, agree
from triton_interpreted import _launch  # noqa: F401  (the kernels imported interpreted)
from tonp_kernels import _register, device_grads as dg, reference
from tonp_kernels.accel import moe, moe_grad

DTYPES = (torch.float32, torch.bfloat16)


def _crowded(dtype, gen):
    """Expert 1 takes every token's first slot: 80 rows, two row tiles (BM 64) and three
    weight-gradient steps (32 rows); experts 3 and 6 take none."""
    x, ids, gu, dn, g = _experts(dtype, gen, M=80)
    ids[:, 0] = 1
    ids[:, 1] = torch.where(ids[:, 1] == 1, 2, ids[:, 1])
    return x, ids, gu, dn, g


def _cases(dtype, gen):
    full = _experts(dtype, gen)
    return {"scattered": (full, 0), "crowded": (_crowded(dtype, gen), 0),
            "EP share": (_ep_share(*full, 4), 4)}


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_experts_grad_agrees_with_the_cpp_op(dtype, gen):
    assert moe_grad.ROWS_BM == 64 and moe_grad.W_BK == 32  # what _crowded's 80 rows cross
    for what, ((x, ids, gu, dn, g), first) in _cases(dtype, gen).items():
        gub = torch.ops.tonp.moe_experts_train(x, ids, gu, dn, first, 8)[1]
        for mask in MASKS3:
            got = moe_grad.moe_experts_grad(g, x, ids, gu, dn, gub, first, 8, list(mask))
            want = torch.ops.tonp.moe_experts_grad(g, x, ids, gu, dn, gub, first, 8, list(mask))
            agree(got, want, f"{what} {dtype} {mask}")
            if what == "scattered" and all(mask):  # experts without rows: zeros from their programs
                assert not got[1][3].any() and not got[2][6].any() and got[1][0].any()
    x, ids, gu, dn, g = _experts(dtype, gen)
    agree(moe_grad.moe_experts_backward(g, x, ids, gu, dn, 0, [True] * 3),
          torch.ops.tonp.moe_experts_backward(g, x, ids, gu, dn, 0, [True] * 3), "backward")


def test_no_rows(gen):
    x, ids, gu, dn, g = _experts(torch.bfloat16, gen)
    x, ids, g = x[:0], ids[:0], g[:0]
    got = moe_grad.moe_experts_grad(g, x, ids, gu, dn, None, 0, 8, [True] * 3)
    assert_bitwise(got, torch.ops.tonp.moe_experts_grad(g, x, ids, gu, dn, None, 0, 8, [True] * 3),
                   "no tokens")


def test_against_float64_autograd(gen):
    x, ids, gu, dn, g = _crowded(torch.float32, gen)
    _near64(moe_grad.moe_experts_grad(g, x, ids, gu, dn, None, 0, 8, [True] * 3),
            _autograd64(lambda a, b, c: reference.moe_experts(a, ids, b, c, 0), [x, gu, dn], g),
            "grouped moe_experts_grad")


def test_the_device_kernel_is_the_grouped_one(gen, monkeypatch):
    """_register's CUDA / NPU kernel of the op runs moe_grad where Triton runs (here: the
    interpreter on CPU tensors), device_grads' loop where it does not (an NPU without
    triton-ascend, simulated)."""
    x, ids, gu, dn, g = _experts(torch.float32, gen)
    args = (g, x, ids, gu, dn, None, 0, 8, [True] * 3)
    kernel = _register.DEVICE_KERNELS["moe_experts_grad"]
    assert_bitwise(kernel(*args), moe_grad.moe_experts_grad(*args), "registered kernel")
    assert kernel.__name__ == "moe_experts_grad_triton"
    monkeypatch.setattr(_register, "_triton_runs_on", lambda device_type: False)
    assert_bitwise(kernel(*args), dg.moe_experts_grad(*args), "fallback")


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_experts_train_hands_back_the_forwards_own_rows(dtype, gen):
    """The device moe_experts_train is the moe_experts kernel returning its grouped gate_up
    rows: exact numerics give the C++ op's (y, rows) bit for bit; fast numerics give the fast
    moe_experts' y bit for bit and rows within a bf16 rounding of the C++ ones."""
    import tonp_kernels as tk
    from tonp_kernels.accel import fast_moe
    for what, ((x, ids, gu, dn, _), first) in _cases(dtype, gen).items():
        train = _register.DEVICE_KERNELS["moe_experts_train"]
        assert_bitwise(train(x, ids, gu, dn, first, 8),
                       torch.ops.tonp.moe_experts_train(x, ids, gu, dn, first, 8), f"exact {what}")
        with tk.use("invariant", numerics="fast"):
            y, rows = train(x, ids, gu, dn, first, 8)
        assert_bitwise(y, fast_moe.moe_experts(x, ids, gu, dn, first, 8), f"fast {what}")
        agree((rows,), (torch.ops.tonp.moe_experts_train(x, ids, gu, dn, first, 8)[1],),
              f"fast rows {what}")
    x, ids, gu, dn, _ = _experts(dtype, gen)
    y, rows = train(x[:0], ids[:0], gu, dn, 0, 8)
    assert y.shape == (0, 2, x.shape[1]) and rows.shape == (0, gu.shape[1])


def test_twin_a_misassigned_tile_is_caught(gen, monkeypatch):
    """The comparison can fail: the crowded expert's second row tile computed with expert 2's
    weights gives dx rows far from the C++ op's."""
    x, ids, gu, dn, g = _crowded(torch.float32, gen)
    real = moe._expert_tiles

    def wrong(e, E, BM):
        t = real(e, E, BM).clone()
        t[(t[:, 0] == 1).nonzero()[1], 0] = 2
        return t
    monkeypatch.setattr(moe_grad, "_expert_tiles", wrong)
    got = moe_grad.moe_experts_grad(g, x, ids, gu, dn, None, 0, 8, [True, False, False])
    want = dg.moe_experts_grad(g, x, ids, gu, dn, None, 0, 8, [True, False, False])
    with pytest.raises(AssertionError):
        agree(got, want, "misassigned tile")
