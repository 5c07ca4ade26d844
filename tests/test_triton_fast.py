"""The Triton `fast` linear and MoE experts keep the contract's promises (Triton's interpreter).

The fast kernels are not the CPU's bits; what they promise is invariance within one device
model. Under the interpreter `tl.dot` is replaced by a fixed-order model (fast_common.dot), so
these tests prove the structure: tiles from the weight's shape only, chunks of one fixed
accumulation, the pairwise chunk tree (in the program or across split programs, TP ranks and
column shards), the expert tile table. What they cannot prove (the tensor core's order inside one
MMA, whether every row of an MMA tile is treated alike) is left to benchmarks/gpu_check.py.
Each invariance has a twin that breaks it (a tile config that followed M; stock torch).
"""
from __future__ import annotations

import inspect

import pytest
import torch

import tonp_kernels as tk
from conftest import assert_bitwise, randn, rows_differ_somewhere
from triton_interpreted import _launch, rowwise  # first: sets TRITON_INTERPRET
from tonp_kernels.accel import fast_linear as fl, fast_moe  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16
# (K, N, chunks): kc = 12 (one masked 16-wide step), 32 (BK 32), 80 (a 64 step and a masked one);
# N = 130 crosses the 128-column tile.
SHAPES = ((96, 40, 8), (256, 130, 8), (160, 24, 2))


def _weights(K, N, dtype, gen, bias=False):
    w = randn(N, K, dtype=dtype, gen=gen, scale=K ** -0.5)
    return w, (randn(N, gen=gen) if bias else None)


def test_the_tile_config_never_depends_on_the_rows():
    """linear_config takes no row count, and the launches of a 1-row, a 17-row and a 4096-row
    call carry the same config and the same arguments but M and split (recorded, not run)."""
    assert list(inspect.signature(fl.linear_config).parameters) == \
        ["N", "K", "chunks", "x_dtype", "w_dtype"]
    for dt, want in ((BF16, "bf16"), (F32, "tf32")):
        cfg = fl.linear_config(2048, 2048, 8, dt, dt)
        assert cfg.dot == want and cfg.BM >= 64  # one wgmma height
        # TP shards: K / t with C / t chunks, N / t columns: the same config
        assert all(fl.linear_config(2048 // t, 2048 // t, 8 // t, dt, dt) == cfg
                   for t in (1, 2, 4, 8))
    w = torch.zeros(256, 512, dtype=BF16)
    metas = []
    for M in (1, 17, 4096):
        _launch.recorder = calls = []
        try:
            fl.linear(torch.zeros(M, 512, dtype=BF16), w, None, 8)
        finally:
            _launch.recorder = None
        kernel, args, meta = calls[0]
        assert kernel is fl._fast_linear_kernel
        names = kernel.arg_names
        metas.append((meta, [a for n, a in zip(names, args)
                             if not isinstance(a, torch.Tensor) and n not in ("M", "split")]))
    assert metas[0] == metas[1] == metas[2]


@pytest.mark.parametrize("xd,wd", ((BF16, BF16), (F32, F32), (BF16, F32)))
def test_a_row_alone_equals_the_row_in_a_batch(xd, wd, gen):
    """Batches of 2, 3, 17, 64 and 65 rows (two row tiles) against the rows alone and in
    prefixes: one set of bits per row, with and without bias, bf16 and fp32 outputs."""
    for i, (K, N, C) in enumerate(SHAPES):
        w, b = _weights(K, N, wd, gen, bias=i % 2 == 0)
        out_dtype = (None, F32)[i % 2]
        x = randn(65, K, dtype=xd, gen=gen)
        full = fl.linear(x, w, b, C, out_dtype)
        for m in (2, 3, 17, 64):
            assert_bitwise(fl.linear(x[:m], w, b, C, out_dtype), full[:m], f"K={K} N={N} M={m}")
        for r in (0, 1, 16, 63, 64):
            assert_bitwise(fl.linear(x[r:r + 1], w, b, C, out_dtype), full[r:r + 1],
                           f"K={K} N={N} row {r} alone")


def test_every_split_gives_the_same_bits(gen):
    """split (programs sharing one tile's chunks) is layout: 1, 2, 4, 8 give one result, and
    the chosen split of a one-row call (8) and of a many-row call agree too."""
    K, N, C = 256, 40, 8
    w, b = _weights(K, N, BF16, gen, bias=True)
    x = randn(5, K, dtype=BF16, gen=gen)
    ref = fl.linear(x, w, b, C, split=1)
    for split in (2, 4, 8):
        assert_bitwise(fl.linear(x, w, b, C, split=split), ref, f"split={split}")
    assert fl.choose_split(1, 1, C, fl.linear_config(N, K, C, BF16, BF16)) == 8
    with pytest.raises(ValueError, match="split=3"):
        fl.linear(x, w, b, C, split=3)


def test_a_config_that_followed_the_rows_would_break_it(gen):
    """The twin: the same kernel with the BK another M might pick (16 instead of 32 over
    chunks of 64) gives other bits, so the row tests above can fail; and stock torch (MKL)
    breaks the batch invariance."""
    K, N, C = 512, 40, 8
    w, _ = _weights(K, N, F32, gen)
    x = randn(3, K, gen=gen)
    cfg = fl.linear_config(N, K, C, F32, F32)
    outs = []
    for bk in (cfg.BK, cfg.BK // 2):
        y = torch.empty(3, N)
        fl.launch_fast_linear(x, w, None, y, C, cfg=fl.LinearConfig(**{**cfg.__dict__, "BK": bk}))
        outs.append(y)
    assert not torch.equal(outs[0], outs[1])
    with tk.use("torch"):
        w2, _ = _weights(2048, 256, F32, gen)
        assert rows_differ_somewhere(lambda x: tk.linear(x, w2),
                                     lambda n: [randn(n, 2048, gen=gen)], (16, 64))


@pytest.mark.parametrize("dtype", (BF16, F32))
def test_tp_chunk_subtrees_finished_by_the_tree_equal_tp1(dtype, gen):
    """Row-parallel: rank r of TP t holds K / t columns = C / t chunks; its fp32 subtree,
    finished by tk.tree_sum in rank order (+ bias, one rounding), equals TP 1 for t = 2, 4, 8.
    Column-parallel: N / t output columns per rank, concatenated, equal TP 1."""
    K, N, C = 256, 40, 8
    w, b = _weights(K, N, dtype, gen, bias=True)
    x = randn(3, K, dtype=dtype, gen=gen)
    full32 = fl.linear(x, w, None, C, F32)
    full = fl.linear(x, w, b, C)
    for t in (2, 4, 8):
        kt = K // t
        parts = [fl.linear(x[:, r * kt:(r + 1) * kt], w[:, r * kt:(r + 1) * kt], None, C // t, F32)
                 for r in range(t)]
        assert_bitwise(tk.tree_sum(parts), full32, f"row-parallel t={t}")
        assert_bitwise((tk.tree_sum(parts) + b).to(dtype), full, f"row-parallel t={t} + bias")
        nt = N // t if N % t == 0 else None
        if nt:
            cols = [fl.linear(x, w[r * nt:(r + 1) * nt], b[r * nt:(r + 1) * nt], C)
                    for r in range(t)]
            assert_bitwise(torch.cat(cols, 1), full, f"column-parallel t={t}")
    # the twin: the rank partials summed left to right (a library's order) differ
    parts = [fl.linear(x[:, r * 32:(r + 1) * 32], w[:, r * 32:(r + 1) * 32], None, 1, F32)
             for r in range(8)]
    assert not torch.equal(torch.stack(parts).cumsum(0)[-1], full32)


def _expert_rows_alone(x, gate_up, down, e, C):
    """One row through expert e as three separate fast calls: linear, silu_mul, linear."""
    I = down.shape[2]
    gu = fl.linear(x, gate_up[e], None, C)
    h = rowwise.silu_mul_rows(gu[:, :I], gu[:, I:], torch.empty(x.shape[0], I, dtype=x.dtype))
    return fl.linear(h, down[e], None, C)


@pytest.mark.parametrize("dtype", (BF16, F32))
def test_moe_rows_equal_their_expert_alone_and_ep_splits_equal_one_call(dtype, gen):
    """70 tokens x 2 slots over 4 experts (one expert takes > 64 rows: two tiles, one takes
    none): each (token, slot) equals its expert's fast linear -> silu_mul -> fast linear on that
    row alone; EP 2 (experts 0-1 and 2-3 in two calls with first_expert) equals one call."""
    M, H, I, E, C = 70, 64, 32, 4, 2
    gate_up = randn(E, 2 * I, H, dtype=dtype, gen=gen, scale=H ** -0.5)
    down = randn(E, H, I, dtype=dtype, gen=gen, scale=I ** -0.5)
    x = randn(M, H, dtype=dtype, gen=gen)
    ids = torch.stack([torch.where(torch.rand(M, generator=gen) < 0.95, 0, 1),
                       torch.randint(1, 3, (M,), generator=gen)], 1)
    y = fast_moe.moe_experts(x, ids, gate_up, down, 0, C)
    for m, k in ((0, 0), (0, 1), (35, 0), (69, 1)):
        e = int(ids[m, k])
        assert_bitwise(y[m, k], _expert_rows_alone(x[m:m + 1], gate_up, down, e, C)[0],
                       f"row ({m}, {k}) expert {e}")
    for lo in (0, 2):  # EP rank holding experts lo, lo + 1
        m_idx, k_idx = ((ids >= lo) & (ids < lo + 2)).nonzero(as_tuple=True)
        if m_idx.numel():
            got = fast_moe.moe_experts(x[m_idx], ids[m_idx, k_idx][:, None], gate_up[lo:lo + 2],
                                       down[lo:lo + 2], lo, C)
            assert_bitwise(got[:, 0], y[m_idx, k_idx], f"EP rank of experts {lo}-{lo + 1}")


def test_bad_inputs_raise_clear_errors(gen):
    x, w = randn(3, 64, gen=gen), randn(8, 64, gen=gen)
    with pytest.raises(ValueError, match="chunks"):
        fl.linear(x, w, None, 3)
    with pytest.raises(ValueError, match="do not match|\\[N, K\\]"):
        fl.linear(x, w[:, :32], None, 8)
    with pytest.raises(TypeError, match="float32 or bfloat16|dtype"):
        fl.linear(x.half(), w, None, 8)
    with pytest.raises((IndexError, ValueError), match="expert id"):
        fast_moe.moe_experts(x, torch.tensor([[0], [7], [1]]), randn(4, 8, 64, gen=gen),
                             randn(4, 64, 4, gen=gen), 0, 1)
    assert fl.linear(x[:0], w, None, 8).shape == (0, 8)
    assert fl.linear(x.view(3, 1, 64), w, None, 8).shape == (3, 1, 8)
