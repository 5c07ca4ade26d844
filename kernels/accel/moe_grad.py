"""The experts' backward on accelerators as grouped work: every expert of a layer in one launch
per GEMM (tonp.moe_experts_grad's CUDA / NPU kernel), as the C++ op does it on the CPU.

Rows (token, slot) are grouped by expert, stably (moe._expert_tiles' tile table of BM rows of
one expert). Per expert e with output gradients G_e, inputs x_e, gate / up rows g, u (the
forward's, in x's dtype) and h = silu(g) u:

    dH_e   = G_e Wdn_e                  (row-grouped GEMM, fp32)
    dgu_e  = swiglu'(dH_e; g, u)        (elementwise, stored in x's dtype)
    dWdn_e = G_e^T h_e                  (row-reduced GEMM: one program per output tile of an
    dWgu_e = dgu_e^T x_e                 expert, its loop over that expert's rows)
    dX     = dgu_e Wgu_e, summed per token over its slots

Gradients are correct, not order-locked (CONTRACT.md "Gradients"): fp32 sums on the tensor
cores for bf16 operands, IEEE fp32 (no tf32) for fp32 ones, each weight gradient rounded once to
the weight's dtype. Experts without rows get zero gradients from the same programs (their loop
is empty), so nothing is zero-filled first. Interpreted (TRITON_INTERPRET=1), tl.dot is
fast_common.dot's fixed-order fp32 model.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import check_device
from .fast_common import INTERP, dot, launch, to_out
from .moe import _expert_tiles

f32 = torch.float32
ROWS_BM, ROWS_BN = 64, 128   # row-grouped GEMM: a wgmma-high row tile of one expert
W_BN, W_BD, W_BK = 128, 128, 32  # weight-gradient tile and the rows per step


def _dot_kind(*dtypes: torch.dtype) -> str:
    return "bf16" if all(d == torch.bfloat16 for d in dtypes) else "ieee"


@triton.jit
def _mma(a, b, acc, DOT: tl.constexpr, INTERP: tl.constexpr):
    """acc + a @ b, fp32 sums: bf16 tensor cores, or IEEE fp32 (gradients keep fp32's bits of
    precision: no tf32); interpreted, fast_common.dot's model."""
    if INTERP:
        return dot(a, b, acc, "tf32", True)
    elif DOT == "bf16":
        return tl.dot(a, b, acc)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _rows_kernel(a_ptr, b_ptr, c_ptr, tiles_ptr, N, K, b_es, b_ks, b_ns,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
                 INTERP: tl.constexpr):
    """C[rows, :] (fp32, [R, N]) = A[rows, :] (contiguous [R, K]) @ B_e ([K, N] at strides
    b_ks, b_ns from b_ptr + e * b_es), rows = tile t of the table (expert, first row, rows)."""
    t = tl.program_id(0)
    first = tl.load(tiles_ptr + 3 * t + 1)
    rows = first + tl.arange(0, BM)
    rm = rows < first + tl.load(tiles_ptr + 3 * t + 2)
    b_ptr += tl.load(tiles_ptr + 3 * t).to(tl.int64) * b_es
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cm = cols < N
    acc = tl.full([BM, BN], 0, tl.float32)
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * K
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < K
        a = tl.load(a_rows + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        b = tl.load(b_ptr + kk.to(tl.int64)[:, None] * b_ks + cols[None, :] * b_ns,
                    mask=km[:, None] & cm[None, :], other=0.0)
        acc = _mma(a, b, acc, DOT, INTERP)
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc,
             mask=rm[:, None] & cm[None, :])


@triton.jit
def _weight_kernel(a_ptr, b_ptr, c_ptr, starts_ptr, N, D, BN: tl.constexpr, BD: tl.constexpr,
                   BK: tl.constexpr, DOT: tl.constexpr, INTERP: tl.constexpr):
    """C_e [N, D] = A[s_e:s_{e+1}, :]^T @ B[s_e:s_{e+1}, :] (A [R, N], B [R, D] contiguous),
    rounded once to C's dtype; program (e, tile). An expert without rows stores zeros."""
    e = tl.program_id(0)
    nd = (D + BD - 1) // BD
    cols_n = (tl.program_id(1) // nd) * BN + tl.arange(0, BN)
    cols_d = (tl.program_id(1) % nd) * BD + tl.arange(0, BD)
    n_ok = cols_n < N
    dm = cols_d < D
    s = tl.load(starts_ptr + e)
    end = tl.load(starts_ptr + e + 1)
    acc = tl.full([BN, BD], 0, tl.float32)
    for r0 in range(s, end, BK):
        r = r0 + tl.arange(0, BK)
        rm = r < end
        a = tl.load(a_ptr + r.to(tl.int64)[:, None] * N + cols_n[None, :],
                    mask=rm[:, None] & n_ok[None, :], other=0.0)
        b = tl.load(b_ptr + r.to(tl.int64)[:, None] * D + cols_d[None, :],
                    mask=rm[:, None] & dm[None, :], other=0.0)
        acc = _mma(tl.trans(a), b, acc, DOT, INTERP)
    out = c_ptr + e.to(tl.int64) * N * D + cols_n.to(tl.int64)[:, None] * D + cols_d[None, :]
    tl.store(out, to_out(acc, c_ptr), mask=n_ok[:, None] & dm[None, :])


def grouped_rows(a: torch.Tensor, b: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """fp32 [R, N]: each tile's rows of a [R, K] times its expert's b[e] ([K, N], contiguous)."""
    R, K = a.shape
    N = b.shape[2]
    c = torch.empty(R, N, dtype=f32, device=a.device)
    if R and N and tiles.shape[0]:
        bk = 64 if _dot_kind(a.dtype, b.dtype) == "bf16" else 32
        launch(_rows_kernel, (tiles.shape[0], triton.cdiv(N, ROWS_BN)), a, b, c, tiles, N, K,
               b.stride(0), N, 1, BM=ROWS_BM, BN=ROWS_BN, BK=bk, DOT=_dot_kind(a.dtype, b.dtype),
               INTERP=INTERP, num_warps=8, num_stages=3)
    return c


def grouped_weight_grad(a: torch.Tensor, b: torch.Tensor, starts: torch.Tensor, E: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """[E, N, D] in dtype: expert e's rows of a [R, N] transposed times its rows of b [R, D]."""
    N, D = a.shape[1], b.shape[1]
    c = torch.empty(E, N, D, dtype=dtype, device=a.device)
    if c.numel():
        launch(_weight_kernel, (E, triton.cdiv(N, W_BN) * triton.cdiv(D, W_BD)), a, b, c, starts,
               N, D, BN=W_BN, BD=W_BD, BK=W_BK, DOT=_dot_kind(a.dtype, b.dtype), INTERP=INTERP,
               num_warps=8, num_stages=3)
    return c


def moe_experts_grad(grad, x, expert_ids, gate_up, down, gate_up_out, first_expert, chunks,
                     output_mask):
    """tonp.moe_experts_grad on an accelerator: (dx [M, H] in x's dtype, dgate_up, ddown in the
    weights' dtypes; an empty tensor where output_mask says not wanted)."""
    from ..device_grads import _groups, _none, _swiglu_grad, experts_grad_rows

    check_device("moe_experts_grad", grad, x, expert_ids, gate_up, down)
    gate_up_out, M, H, K, E, I = experts_grad_rows(grad, x, expert_ids, gate_up, down, gate_up_out,
                                                   first_expert, chunks)
    R = M * K
    want_x, want_gu, want_dn = output_mask
    if R == 0:
        return (x.new_zeros(M, H) if want_x else _none(x),
                torch.zeros_like(gate_up) if want_gu else _none(gate_up),
                torch.zeros_like(down) if want_dn else _none(down))
    order, starts = _groups(expert_ids, first_expert, E)
    tiles = _expert_tiles(expert_ids.reshape(-1) - first_expert, E, ROWS_BM)
    starts = torch.tensor(starts, dtype=torch.int32, device=x.device)
    gate_up, down = gate_up.contiguous(), down.contiguous()
    G = grad.reshape(R, H)[order].contiguous()                     # rows in group order
    gate, up = gate_up_out[:, :I], gate_up_out[:, I:]
    dH = grouped_rows(G, down, tiles)                               # [R, I] fp32
    gdn = _none(down)
    if want_dn:
        h = (torch.nn.functional.silu(gate.float()) * up.float()).to(x.dtype)
        gdn = grouped_weight_grad(G, h, starts, E, down.dtype)
    dg, du = _swiglu_grad(dH, gate, up)
    dgu = torch.cat((dg, du), 1).to(x.dtype)
    ggu = grouped_weight_grad(dgu, x[order // K].contiguous(), starts, E, gate_up.dtype) \
        if want_gu else _none(gate_up)
    if not want_x:
        return _none(x), ggu, gdn
    dxs = grouped_rows(dgu, gate_up, tiles)                         # [R, H] fp32, group order
    dx = torch.empty_like(dxs)
    dx[order] = dxs
    return dx.view(M, K, H).sum(1).to(x.dtype), ggu, gdn


def moe_experts_backward(grad, x, expert_ids, gate_up, down, first_expert, output_mask):
    """The op autograd called before gate_up_out was kept: recomputes it (chunks 8, as in C++)."""
    return moe_experts_grad(grad, x, expert_ids, gate_up, down, None, first_expert, 8, output_mask)
