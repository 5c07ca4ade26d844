"""Exact linear: y[m, n] = tree over chunks c of hsum(lanes of chunk c) (+ bias), one rounding.

The CPU kernel's arithmetic (kernels_impl.h): K is cut into C chunks of kc; in a chunk, lane l
(0..7) is an FMA chain from 0 over k = l, l + 8, ... in order, the last kc % 8 products going to
lanes 0.. in order; the eight lanes are closed by ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)); the C
chunk partials by the pairwise tree; the bias is added in fp32; the output rounded once.

Here a program owns a [BM, BN] tile of outputs and keeps its 8 * BM * BN lane chains in
registers: each step loads x [BM, 8] and w [BN, 8] and runs one FMA per chain (an outer product
per lane on CUDA cores). The tile depends on the weight shape only, never on M, and no output's
chains or trees depend on the tile. A grouped launch (the MoE experts) gives each row tile its
expert's weight through a tile table.

bf16 activations x bf16 weights take the "pair chains" instead (CONTRACT.md, the arithmetic of
the AVX512-BF16 instruction vdpbf16ps): the chunk is read in blocks of 16 (zero padded); lane l
takes the pair (16j + 2l, 16j + 2l + 1), the odd element's step first; each step is an FMA with
subnormal bf16 inputs read as zero and a result tiny after rounding flushed to a zero of its
sign; trees, bias and rounding as above; a NaN output is the canonical NaN.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import numerics as nm
from ._launch import INTERPRETED, check_device, float_dtype, launch, pow2
from .._library import MAX_CHUNKS  # the chunk tree keeps six pending levels (kernels.h)
# bf16 x bf16 linears run the pair chains (CONTRACT.md; csrc/bf16dot.h), as every C++ build
# does; pairs=False (the fp32 FMA lanes) exists for the tests' twins.
PAIR_CHAINS = True


@triton.jit
def _chunk_partial(x_rows, w_rows, xm, wm, k0, kc, BM: tl.constexpr, BN: tl.constexpr,
                   X_BF16: tl.constexpr, W_BF16: tl.constexpr):
    """The [BM, BN] partials of the chunk [k0, k0 + kc): lane chains, tail, hsum tree."""
    lane = tl.arange(0, 8)
    acc = tl.full([BM, BN, 8], 0, tl.float32)
    k8 = kc // 8 * 8
    for k in range(0, k8, 8):
        kk = (k0 + k + lane)[None, :]
        xv = nm.load_f32(x_rows + kk, xm, X_BF16)  # [BM, 8]
        wv = nm.load_f32(w_rows + kk, wm, W_BF16)  # [BN, 8]
        acc = tl.fma(xv[:, None, :], wv[None, :, :], acc)
    # The kc % 8 tail products go to lanes 0.. in order; the other lanes keep their value.
    tail = (lane < kc - k8)[None, :]
    kk = (k0 + k8 + lane)[None, :]
    xv = nm.load_f32(x_rows + kk, xm & tail, X_BF16)
    wv = nm.load_f32(w_rows + kk, wm & tail, W_BF16)
    acc = tl.where(tail[:, None, :], tl.fma(xv[:, None, :], wv[None, :, :], acc), acc)
    return nm.hsum8_3d(acc, BM, BN)


@triton.jit
def _daz_bf16(h):
    """bf16 bits (int16) -> fp32, a subnormal (exponent field 0) read as a zero of its sign."""
    b = h.to(tl.int32) & 0xFFFF
    b = tl.where((b & 0x7F80) == 0, b & 0x8000, b)
    return (b << 16).to(tl.float32, bitcast=True)


@triton.jit
def pair_step(a, b, c):
    """One step of vdpbf16ps on IEEE fma (bf16dot.h step1): r = fma(a, b, c); a result tiny
    after rounding to 24 bits (unbounded exponent) becomes a zero of its sign. |r| < FLT_MIN is
    tiny; |r| = FLT_MIN is tiny iff the doubled sum fma(2a, b, 2c) is finite and below 2 FLT_MIN."""
    r = tl.fma(a, b, c)
    rb = r.to(tl.int32, bitcast=True)
    mag = rb & 0x7FFFFFFF
    m2 = tl.fma(a * 2.0, b, c * 2.0).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    flush = (mag < 0x00800000) | ((mag == 0x00800000) & (m2 < 0x01000000))
    return tl.where(flush, (rb & -2147483648).to(tl.float32, bitcast=True), r)  # r's sign


@triton.jit
def _pair_partial(x_rows, w_rows, xm, wm, k0, kc, BM: tl.constexpr, BN: tl.constexpr):
    """The [BM, BN] partials of the bf16 x bf16 chunk [k0, k0 + kc) by the pair chains."""
    acc = tl.full([BM, BN, 8], 0, tl.float32)
    e16 = tl.arange(0, 16)[None, :]
    for k in range(0, kc, 16):
        inside = k + e16 < kc  # the last block's padding is zeros, and they take their steps
        xv = _daz_bf16(tl.load(x_rows + k0 + k + e16, mask=xm & inside, other=0))  # [BM, 16]
        wv = _daz_bf16(tl.load(w_rows + k0 + k + e16, mask=wm & inside, other=0))  # [BN, 16]
        xe, xo = tl.split(tl.reshape(xv, [BM, 8, 2]))
        we, wo = tl.split(tl.reshape(wv, [BN, 8, 2]))
        acc = pair_step(xo[:, None, :], wo[None, :, :], acc)
        acc = pair_step(xe[:, None, :], we[None, :, :], acc)
    return nm.hsum8_3d(acc, BM, BN)


@triton.jit
def _chunk_tree(x_rows, w_rows, xm, wm, c0: tl.constexpr, n: tl.constexpr, kc, BM: tl.constexpr,
                BN: tl.constexpr, X_BF16: tl.constexpr, W_BF16: tl.constexpr,
                PAIRS: tl.constexpr):
    """Chunks c0 .. c0 + n - 1 (n a power of two) by the pairwise chunk tree (kernels_impl.h
    chunk_tree): ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)), unrolled at compile time, left + right."""
    if n == 1:
        if PAIRS:
            return _pair_partial(x_rows, w_rows, xm, wm, c0 * kc, kc, BM, BN)
        else:
            return _chunk_partial(x_rows, w_rows, xm, wm, c0 * kc, kc, BM, BN, X_BF16, W_BF16)
    else:
        left = _chunk_tree(x_rows, w_rows, xm, wm, c0, n // 2, kc, BM, BN, X_BF16, W_BF16, PAIRS)
        return left + _chunk_tree(x_rows, w_rows, xm, wm, c0 + n // 2, n // 2, kc, BM, BN, X_BF16,
                                  W_BF16, PAIRS)


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, tiles_ptr, M, N, K, kc, w_estride,
                   CHUNKS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   X_BF16: tl.constexpr, W_BF16: tl.constexpr, OUT_BF16: tl.constexpr,
                   HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, PAIRS: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:  # tile table rows: (expert, first row, rows)
        e = tl.load(tiles_ptr + 3 * pid_m).to(tl.int64)
        r0 = tl.load(tiles_ptr + 3 * pid_m + 1)
        r_end = r0 + tl.load(tiles_ptr + 3 * pid_m + 2)
        w_ptr += e * w_estride
    else:
        r0 = pid_m * BM
        r_end = M
    rows = r0 + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rm = rows < r_end
    cm = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * K
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    p = _chunk_tree(x_rows, w_rows, rm[:, None], cm[:, None], 0, CHUNKS, kc, BM, BN, X_BF16, W_BF16,
                    PAIRS)
    if HAS_BIAS:
        p = p + tl.load(b_ptr + cols, mask=cm, other=0.0)[None, :]
    if PAIRS:  # the pair chains' NaN output is the canonical one
        p = tl.where(p != p, nm.CANONICAL_NAN, p)
    out = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    nm.store_f32(out, p, rm[:, None] & cm[None, :], OUT_BF16)


def tiles_for(N: int) -> tuple:
    """(BM, BN) of a program: from the weight's N only (wider for wide weights). Interpreted,
    up to 128 columns: the interpreter's cost is per program and operation, not per element."""
    if INTERPRETED:
        return 16, min(pow2(N), 128)
    return 16, (64 if N >= 4096 else 32)


def check_chunks(op: str, K: int, chunks: int) -> None:
    if chunks < 1 or chunks & (chunks - 1):
        raise ValueError(f"tonp.{op}: chunks must be a power of two, got {chunks}")
    if K % chunks:
        raise ValueError(f"tonp.{op}: the reduction size K={K} is not divisible by chunks={chunks} "
                         "(the chunk tree needs C | K)")
    if chunks > MAX_CHUNKS:
        raise ValueError(f"tonp.{op}: at most {MAX_CHUNKS} reduction chunks, got {chunks}")


def uses_pairs(x_dtype: torch.dtype, w_dtype: torch.dtype, pairs: Optional[bool] = None) -> bool:
    """Whether a linear of these dtypes runs the pair chains: bf16 x bf16, when the C++ build
    this process loaded runs them (pairs=None) or when asked (tests of the arithmetic)."""
    both = x_dtype == torch.bfloat16 and w_dtype == torch.bfloat16
    return both and (PAIR_CHAINS if pairs is None else pairs)


def launch_linear(x, w, bias, out, chunks: int, tiles=None, w_estride: int = 0,
                  block=None, pairs: Optional[bool] = None) -> None:
    """out [rows, N] <- x [rows, K] @ w[e] [N, K] (+ bias): contiguous tensors, K > 0.
    tiles: None (row blocks of BM) or an int32 table [T, 3] of (expert, first row, rows <= BM).
    pairs: see uses_pairs."""
    M, K = x.shape
    N = out.shape[1]
    BM, BN = block or tiles_for(N)
    grid = (triton.cdiv(M, BM) if tiles is None else tiles.shape[0], triton.cdiv(N, BN))
    launch(_linear_kernel, grid, x, w, bias if bias is not None else out,
           out, tiles if tiles is not None else out, M, N, K, K // chunks, w_estride,
           CHUNKS=chunks, BM=BM, BN=BN, X_BF16=x.dtype == torch.bfloat16,
           W_BF16=w.dtype == torch.bfloat16, OUT_BF16=out.dtype == torch.bfloat16,
           HAS_BIAS=bias is not None, GROUPED=tiles is not None,
           PAIRS=uses_pairs(x.dtype, w.dtype, pairs))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           chunks: int = 8, out_dtype: Optional[torch.dtype] = None, weight_groups=None, *,
           block: Optional[tuple] = None, pairs: Optional[bool] = None) -> torch.Tensor:
    """torch.ops.tonp.linear's bits: x [M, K], weight [N, K], bias [N] -> [M, N] (out_dtype or
    x.dtype). block: (BM, BN) to override the tile (it never changes a bit); pairs: force the
    bf16 x bf16 pair chains on or off (None: as the loaded C++ build, see uses_pairs).
    weight_groups: the CPU kernels' column groups of the weight, not read here."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"tonp.linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not "
                         "match: expected x [M, K] and weight [N, K]")
    float_dtype(x, "linear", "x")
    float_dtype(weight, "linear", "weight")
    odt = out_dtype or x.dtype
    float_dtype(odt, "linear", "out_dtype")
    M, K = x.shape
    N = weight.shape[0]
    check_chunks("linear", K, chunks)
    check_device("linear", x, weight, *([bias] if bias is not None else []))
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != N:
            raise ValueError(f"tonp.linear: bias must be [{N}], got {tuple(bias.shape)}")
        float_dtype(bias, "linear", "bias")
        bias = bias.float().contiguous()
    out = torch.empty(M, N, dtype=odt, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:  # as the C++ op: zeros, plus the bias in the output dtype
        out.zero_()
        return out.add_(bias.to(odt)) if bias is not None else out
    launch_linear(x.contiguous(), weight.contiguous(), bias, out, chunks, block=block, pairs=pairs)
    return out
