"""Fast linear: tensor-core matmuls (tl.dot, bf16 in, fp32 accumulate) with the chunk tree.

The arithmetic of an output y[m, n] (docs/accelerators.md): K is cut into C chunks of
kc = K / C; chunk c's partial is a fresh fp32 accumulator through the BK-wide tl.dot steps of
[c * kc, (c + 1) * kc) in order (the last step masked when BK does not divide kc); the C partials
are combined by the contract's pairwise tree; + bias in fp32; one rounding. The tile config
(BM, BN, BK, warps, stages, tree depth) is `linear_config(N, K, chunks, dtypes)`: it follows kc and
the dtypes only, so a TP rank (K / t, C / t: the same kc) and a column shard (N / t) run the same
instructions as TP 1, and M never changes it.

What M changes is layout only: `split`, the number of programs that share one output tile's
chunks. A program computes the subtree of `C / split` consecutive chunks (a binary counter keeps
the pending left siblings in registers, up to 2^LEVELS chunks); with split > 1 the fp32 subtree
partials go to a scratch buffer and `_finish_kernel` runs the remaining levels of the same tree.
Every chunk runs the same compiled code in every case and fp32 `+` is exact IEEE, so no output's
operations depend on the split; decode (few rows) uses a wide split to fill the GPU, a 4096-row
pass none. `split` is a runtime argument: one row and 4096 rows launch one compiled kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import _op_checks as opcheck
from ._launch import check_device
from .fast_common import INTERP, TARGET_PROGRAMS, dot, dot_dtype, launch, pow2, to_out

MAX_LEVELS = 3  # a program holds at most 2^3 = 8 chunks' subtree (3 pending tiles + 1 live)
FINISH_BLOCK = 1024  # outputs per program of the split tree


@dataclass(frozen=True)
class LinearConfig:
    """The compiled shape of a fast linear: tiles, software pipeline, dot operands, tree depth."""
    BM: int
    BN: int
    BK: int
    num_warps: int
    num_stages: int
    levels: int  # a program's subtree holds at most 2^levels chunks (fixed: MAX_LEVELS)
    dot: str     # "bf16" | "tf32"


def linear_config(N: int, K: int, chunks: int, x_dtype: torch.dtype,
                  w_dtype: torch.dtype) -> LinearConfig:
    """The tile config of a [*, K] x [N, K] fast linear with `chunks` chunks. It takes no row
    count: M never changes it. It follows kc = K / chunks and the dtypes only (N is taken for
    the signature's sake and ignored), so TP shards of either kind compile to the same kernel.

    64-row tiles are the smallest wgmma (one warpgroup height): a one-row decode wastes the
    least tensor-core work; 8 warps over [64, 128] keep the accumulator and the three pending
    subtree tiles at 32 registers each."""
    del N
    kc = K // chunks
    dot = dot_dtype(x_dtype, w_dtype)
    bk = 64 if dot == "bf16" else 32
    bk = max(16, min(bk, pow2(kc)))
    return LinearConfig(BM=64, BN=128, BK=bk, num_warps=8, num_stages=3 if dot == "bf16" else 2,
                        levels=MAX_LEVELS, dot=dot)


@triton.jit
def _climb(t, p, ci, level: tl.constexpr, up):
    """One level of the binary counter over a program's chunks. `up`: t is climbing (all lower
    bits of ci were 1). If bit `level` of ci is 1, t's left sibling p is pending: t = p + t;
    else t becomes the pending left sibling at this level and stops climbing."""
    bit = (ci >> level) & 1
    t = tl.where(up & (bit == 1), p + t, t)
    p = tl.where(up & (bit == 0), t, p)
    return t, p, up & (bit == 1)


@triton.jit
def _finish_store(p, b_ptr, out_ptr, offs, cols, mask, HAS_BIAS: tl.constexpr):
    """+ bias (fp32), one rounding to the output dtype: the same in both kernels."""
    if HAS_BIAS:
        p = p + tl.load(b_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + offs, to_out(p, out_ptr), mask=mask)


@triton.jit
def _row_tile(tiles_ptr, t, M, BM: tl.constexpr, GROUPED: tl.constexpr):
    """Rows, their mask and the expert of row tile t: a block of BM rows of M, or (GROUPED) row
    t of the tile table (expert, first row, rows <= BM) of the MoE launch."""
    if GROUPED:
        first = tl.load(tiles_ptr + 3 * t + 1)
        rows = first + tl.arange(0, BM)
        return rows, rows < first + tl.load(tiles_ptr + 3 * t + 2), \
            tl.load(tiles_ptr + 3 * t).to(tl.int64)
    else:
        rows = t * BM + tl.arange(0, BM)
        return rows, rows < M, 0


@triton.jit(do_not_specialize=["M", "split"])
def _fast_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, tiles_ptr, M, N, K, kc, split,
                        w_estride, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        STEPS: tl.constexpr, LEVELS: tl.constexpr, DOT: tl.constexpr,
                        INTERP: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr):
    rows, rm, expert = _row_tile(tiles_ptr, tl.program_id(0), M, BM, GROUPED)
    w_ptr += expert * w_estride
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cm = cols < N
    pid_s = tl.program_id(2)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * K
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * K
    cpp = (K // kc) // split  # chunks of this program: [pid_s * cpp, (pid_s + 1) * cpp)
    k_first = pid_s * cpp * kc
    acc = tl.full([BM, BN], 0, tl.float32)
    t = acc
    p0 = acc
    p1 = acc
    p2 = acc
    for i in range(cpp * STEPS):
        ci = i // STEPS
        koff = (i % STEPS) * BK + tl.arange(0, BK)  # offsets inside the chunk
        km = koff < kc
        kk = k_first + ci * kc + koff
        a = tl.load(x_rows + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        b = tl.load(w_cols + kk[:, None], mask=km[:, None] & cm[None, :], other=0.0)
        acc = dot(a, b, acc, DOT, INTERP)
        if i % STEPS == STEPS - 1:  # chunk ci is complete: climb the pairwise tree
            t = acc
            up = ci >= 0
            if LEVELS >= 1:
                t, p0, up = _climb(t, p0, ci, 0, up)
            if LEVELS >= 2:
                t, p1, up = _climb(t, p1, ci, 1, up)
            if LEVELS >= 3:
                t, p2, up = _climb(t, p2, ci, 2, up)
            acc = tl.full([BM, BN], 0, tl.float32)
    # t: the subtree of this program's chunks (cpp is a power of two <= 2^LEVELS)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    mask = rm[:, None] & cm[None, :]
    if split == 1:
        _finish_store(t, b_ptr, out_ptr, offs, cols[None, :], mask, HAS_BIAS)
    else:
        tl.store(part_ptr + pid_s * M.to(tl.int64) * N + offs, t, mask=mask)


@triton.jit
def _split_tree(part_ptr, offs, mask, MN, s0: tl.constexpr, n: tl.constexpr):
    """Partials s0 .. s0 + n - 1 by the pairwise tree (left + right), unrolled."""
    if n == 1:
        return tl.load(part_ptr + s0 * MN + offs, mask=mask, other=0.0)
    else:
        left = _split_tree(part_ptr, offs, mask, MN, s0, n // 2)
        return left + _split_tree(part_ptr, offs, mask, MN, s0 + n // 2, n // 2)


@triton.jit(do_not_specialize=["MN"])
def _finish_kernel(part_ptr, b_ptr, out_ptr, MN, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                   HAS_BIAS: tl.constexpr):
    """The tree over SPLIT fp32 partials [SPLIT, M, N] of the linear kernel, bias, rounding."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    p = _split_tree(part_ptr, offs, mask, MN, 0, SPLIT)
    _finish_store(p, b_ptr, out_ptr, offs, offs % N, mask, HAS_BIAS)


def choose_split(row_tiles: int, col_tiles: int, chunks: int, cfg: LinearConfig) -> int:
    """Programs per output tile: the least that fits a program's subtree (2^levels chunks),
    doubled while the grid is short of TARGET_PROGRAMS. Layout only: never changes a bit."""
    split = max(1, chunks >> cfg.levels)
    while split < chunks and row_tiles * col_tiles * split < TARGET_PROGRAMS:
        split *= 2
    return split


def launch_fast_linear(x, w, bias, out, chunks: int, tiles=None, w_estride: int = 0,
                       split: Optional[int] = None, cfg: Optional[LinearConfig] = None) -> None:
    """out [rows, N] <- x [rows, K] @ w[e] [N, K] (+ bias fp32): contiguous, K > 0.
    tiles: None (row tiles of BM) or an int32 table [T, 3] of (expert, first row, rows <= BM)."""
    M, K = x.shape
    N = out.shape[1]
    cfg = cfg or linear_config(N, K, chunks, x.dtype, w.dtype)
    row_tiles = triton.cdiv(M, cfg.BM) if tiles is None else tiles.shape[0]
    col_tiles = triton.cdiv(N, cfg.BN)
    split = split or choose_split(row_tiles, col_tiles, chunks, cfg)
    least = max(1, chunks >> cfg.levels)
    if split & (split - 1) or not least <= split <= chunks:
        raise ValueError(f"tonp.linear (fast): split={split} must be a power of two in "
                         f"[{least}, {chunks}]")
    kc = K // chunks
    part = torch.empty((split * M * N) if split > 1 else 1, dtype=torch.float32, device=x.device)
    launch(_fast_linear_kernel, (row_tiles, col_tiles, split), x, w,
           bias if bias is not None else part, out, part,
           tiles if tiles is not None else part, M, N, K, kc, split, w_estride,
           BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, STEPS=triton.cdiv(kc, cfg.BK), LEVELS=cfg.levels,
           DOT=cfg.dot, INTERP=INTERP, HAS_BIAS=bias is not None, GROUPED=tiles is not None,
           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        launch(_finish_kernel, (triton.cdiv(M * N, FINISH_BLOCK),), part,
               bias if bias is not None else part, out, M * N, N, SPLIT=split,
               BLOCK=FINISH_BLOCK, HAS_BIAS=bias is not None, num_warps=4, num_stages=1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           chunks: int = 8, out_dtype: Optional[torch.dtype] = None, weight_groups=None, *,
           split: Optional[int] = None) -> torch.Tensor:
    """Fast numerics of tonp_kernels.linear: x [..., K], weight [N, K], bias [N] -> [..., N]
    (out_dtype or x.dtype). split: programs per output tile (None: chosen; never changes a bit).
    weight_groups: the CPU kernels' column groups of the weight, not read here."""
    opcheck.linear(x, weight, bias, chunks, out_dtype)
    check_device("linear", x, weight, *([bias] if bias is not None else []))
    K, N = x.shape[-1], weight.shape[0]
    odt = out_dtype or x.dtype
    x2 = x.reshape(-1, K)
    out = torch.empty(x2.shape[0], N, dtype=odt, device=x.device)
    if bias is not None:
        bias = bias.float().contiguous()
    if x2.shape[0] and N:
        if K == 0:  # as the C++ op: zeros, plus the bias in the output dtype
            out.zero_()
            if bias is not None:
                out.add_(bias.to(odt))
        else:
            launch_fast_linear(x2.contiguous(), weight.contiguous(), bias, out, chunks,
                               split=split)
    return out.view(*x.shape[:-1], N)
