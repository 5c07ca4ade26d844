"""Exact row-wise and elementwise ops: rms_norm, silu_mul, rope, moe_combine.

Each keeps the CPU kernel's operations (kernels_impl.h, ops.cpp): rms_norm's sum of squares is
eight FMA lanes over the row (the tail to lanes 0..) closed by the hsum tree, then
1 / sqrt(ss / H + eps) correctly rounded, and w * round(x * r) rounded to x's dtype; silu_mul is
g / (1 + exp(0 - g)) with tonp's exp, rounded, times u, rounded; rope rounds each product and the
sum to x's dtype as the torch expression does; moe_combine is an FMA chain over the slots from 0.
A program owns a tile of rows (or of elements); nothing reduces across programs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import numerics as nm
from ._launch import check_device, float_dtype, launch, pow2


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, M, H, eps, BM: tl.constexpr, BH: tl.constexpr,
                     BF16: tl.constexpr, W_BF16: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rm = (rows < M)[:, None]
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * H
    lane = tl.arange(0, 8)[None, :]
    acc = tl.full([BM, 8], 0, tl.float32)
    h8 = H // 8 * 8
    for i in range(0, h8, 8):
        v = nm.load_f32(x_rows + i + lane, rm, BF16)
        acc = tl.fma(v, v, acc)
    tail = lane < H - h8  # the tail goes to lanes 0.. in order
    v = nm.load_f32(x_rows + h8 + lane, rm & tail, BF16)
    acc = tl.where(tail, tl.fma(v, v, acc), acc)
    ss = nm.hsum8_2d(acc, BM)
    r = tl.div_rn(tl.full([BM], 1.0, tl.float32), tl.sqrt_rn(tl.div_rn(ss, H.to(tl.float32)) + eps))
    cols = tl.arange(0, BH)
    for h0 in range(0, H, BH):
        cm = (h0 + cols < H)[None, :]
        xv = nm.load_f32(x_rows + h0 + cols[None, :], rm & cm, BF16)
        wv = nm.load_f32(w_ptr + h0 + cols[None, :], cm, W_BF16)
        y = wv * nm.round_to(xv * r[:, None], BF16)
        out = out_ptr + rows.to(tl.int64)[:, None] * H + h0 + cols[None, :]
        nm.store_f32(out, y, rm & cm, BF16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch.ops.tonp.rms_norm's bits: x [..., H], weight [H] -> x.dtype."""
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"tonp.rms_norm: weight {tuple(weight.shape)} does not match x "
                         f"{tuple(x.shape)} (expected x [..., H] and weight [H])")
    bf16 = float_dtype(x, "rms_norm", "x")
    w_bf16 = float_dtype(weight, "rms_norm", "weight")
    check_device("rms_norm", x, weight)
    x = x.contiguous()
    out = torch.empty_like(x)
    H = x.shape[-1]
    M = x.numel() // H if H else 0
    if M:
        BM = 4
        launch(_rms_norm_kernel, (triton.cdiv(M, BM),), x, weight.contiguous(), out, M, H,
               float(eps), BM=BM, BH=min(pow2(H), 1024), BF16=bf16, W_BF16=w_bf16)
    return out


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n_rows, n, g_stride, BLOCK: tl.constexpr,
                     BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # rows on axis 0: up to 2^31 - 1 programs, not 65535
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    g = nm.load_f32(g_ptr + row * g_stride + i, mask, BF16)
    u = nm.load_f32(u_ptr + row * g_stride + i, mask, BF16)
    s = tl.div_rn(g, 1.0 + nm.exp(0.0 - g))
    nm.store_f32(out_ptr + row * n + i, nm.round_to(s, BF16) * u, mask, BF16)


def silu_mul_rows(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [R, n] <- silu(gate) * up for rows of gate/up with a common row stride (views of one
    [R, 2n] tensor are fine) and a contiguous out."""
    R, n = out.shape
    if R and n:
        BLOCK = min(pow2(n), 1024)
        launch(_silu_mul_kernel, (R, triton.cdiv(n, BLOCK)), gate, up, out, R, n, gate.stride(0),
               BLOCK=BLOCK, BF16=out.dtype == torch.bfloat16)
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """torch.ops.tonp.silu_mul's bits: silu(gate) * up, elementwise, in gate's dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"tonp.silu_mul: gate {tuple(gate.shape)}/{gate.dtype} and up "
                         f"{tuple(up.shape)}/{up.dtype} must match")
    float_dtype(gate, "silu_mul", "gate")
    check_device("silu_mul", gate, up)
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    n = gate.shape[-1] if gate.dim() else 1  # rows of the last dim: elementwise, any split will do
    if out.numel():
        silu_mul_rows(gate.contiguous().view(-1, n), up.contiguous().view(-1, n), out.view(-1, n))
    return out


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, R, Hh, D, BR: tl.constexpr,
                 DP: tl.constexpr, BF16: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)  # rows of [T * heads, D]
    d = tl.arange(0, DP)
    half = D // 2
    mask = (rows < R)[:, None] & (d < D)[None, :]
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * D
    pos = tl.load(pos_ptr + rows // Hh, mask=rows < R, other=0).to(tl.int64)
    xv = nm.load_f32(x_rows + d[None, :], mask, BF16)
    lo = (d < half)[None, :]
    partner = nm.load_f32(x_rows + tl.where(lo, d[None, :] + half, d[None, :] - half), mask, BF16)
    rv = tl.where(lo, -partner, partner)
    c = tl.load(cos_ptr + pos[:, None] * D + d[None, :], mask=mask, other=0.0)
    s = tl.load(sin_ptr + pos[:, None] * D + d[None, :], mask=mask, other=0.0)
    y = nm.round_to(xv * nm.round_to(c, BF16), BF16) + nm.round_to(rv * nm.round_to(s, BF16), BF16)
    nm.store_f32(out_ptr + rows.to(tl.int64)[:, None] * D + d[None, :], y, mask, BF16)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         positions: torch.Tensor) -> torch.Tensor:
    """torch.ops.tonp.rope's bits: x [T, heads, D], cos/sin fp32 [P, D], positions [T]."""
    if x.dim() != 3 or x.shape[2] % 2:
        raise ValueError(f"tonp.rope: x must be [T, heads, head_dim] with an even head_dim, got "
                         f"{tuple(x.shape)}")
    bf16 = float_dtype(x, "rope", "x")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError("tonp.rope: cos/sin tables must be float32")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != x.shape[2]:
        raise ValueError(f"tonp.rope: cos/sin tables must be [positions, {x.shape[2]}], got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if positions.dim() != 1 or positions.shape[0] != x.shape[0]:
        raise ValueError(f"tonp.rope: positions must be [{x.shape[0]}], got "
                         f"{tuple(positions.shape)}")
    check_device("rope", x, cos, sin, positions)
    pos = positions.to(torch.int64).contiguous()
    bad = (pos < 0) | (pos >= cos.shape[0])
    if bool(bad.any()):
        raise IndexError(f"tonp.rope: position {int(pos[bad][0])} outside the table's "
                         f"[0, {cos.shape[0]})")
    x = x.contiguous()
    out = torch.empty_like(x)
    T, Hh, D = x.shape
    if T * Hh and D:
        BR = 16
        launch(_rope_kernel, (triton.cdiv(T * Hh, BR),), x, cos.contiguous(), sin.contiguous(),
               pos, out, T * Hh, Hh, D, BR=BR, DP=pow2(D), BF16=bf16)
    return out


@triton.jit
def _moe_combine_kernel(w_ptr, y_ptr, out_ptr, M, K, H, BM: tl.constexpr, BH: tl.constexpr,
                        BF16: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    rm = rows < M
    mask = rm[:, None] & (cols < H)[None, :]
    r64 = rows.to(tl.int64)
    acc = tl.full([BM, BH], 0, tl.float32)
    for k in range(K):
        wk = tl.load(w_ptr + r64 * K + k, mask=rm, other=0.0)
        yk = nm.load_f32(y_ptr + (r64 * K + k)[:, None] * H + cols[None, :], mask, BF16)
        acc = tl.fma(wk[:, None], yk, acc)
    nm.store_f32(out_ptr + r64[:, None] * H + cols[None, :], acc, mask, BF16)


def moe_combine(weights: torch.Tensor, expert_out: torch.Tensor) -> torch.Tensor:
    """torch.ops.tonp.moe_combine's bits: weights fp32 [M, K], expert_out [M, K, H] -> [M, H]."""
    if expert_out.dim() != 3 or weights.dim() != 2 or weights.shape != expert_out.shape[:2]:
        raise ValueError(f"tonp.moe_combine: expected weights [M, K] and expert_out [M, K, H], got "
                         f"{tuple(weights.shape)} and {tuple(expert_out.shape)}")
    if weights.dtype != torch.float32:
        raise TypeError("tonp.moe_combine: weights must be float32")
    bf16 = float_dtype(expert_out, "moe_combine", "expert_out")
    check_device("moe_combine", weights, expert_out)
    M, K, H = expert_out.shape
    out = torch.empty(M, H, dtype=expert_out.dtype, device=expert_out.device)
    if M and H:
        BM, BH = 4, min(pow2(H), 256)
        launch(_moe_combine_kernel, (triton.cdiv(M, BM), triton.cdiv(H, BH)), weights.contiguous(),
               expert_out.contiguous(), out, M, K, H, BM=BM, BH=BH, BF16=bf16)
    return out
