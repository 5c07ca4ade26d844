"""Fast fused MoE experts: every (token, slot) row through its SwiGLU expert in one grouped
tensor-core launch per projection.

Rows are grouped by expert (a stable sort) and cut into tiles of BM rows of one expert (the
tile table of the exact kernels, moe._expert_tiles); each tile runs the fast linear kernel on
its expert's weight with `linear_config` of that weight's shape, the config a plain fast linear
of the same weight uses. So a row's gate_up is bit for bit `fast_linear.linear(row, gate_up[e])`,
whichever rows share its expert, its tile or the call: the result never depends on how many
tokens an expert received, nor on which EP rank holds the expert. Between the two projections,
gate_up is rounded to x's dtype and `silu_mul` is the exact kernel (elementwise).
"""
from __future__ import annotations

import torch

from .. import _op_checks as opcheck
from ._launch import check_device
from .fast_linear import launch_fast_linear, linear_config
from .moe import _expert_tiles
from .rowwise import silu_mul_rows


def moe_experts(x: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, first_expert: int = 0, chunks: int = 8,
                gate_up_groups=None, down_groups=None, *, gate_up_rows: bool = False):
    """Fast numerics of tonp_kernels.moe_experts: x [M, H], expert_ids int64 [M, K], gate_up
    [E, 2I, H], down [E, H, I] -> y [M, K, H] in x.dtype (row (m, k) through expert
    ids[m, k] - first_expert). gate_up_rows: (y, the gate_up rows [M K, 2I] in expert-group
    order), as the exact kernel's. The CPU kernels' column groups are not read here."""
    opcheck.moe_experts(x, expert_ids, gate_up, down, first_expert, chunks)
    check_device("moe_experts", x, expert_ids, gate_up, down)
    M, H = x.shape
    Kk = expert_ids.shape[1]
    E, I = down.shape[0], down.shape[2]
    y = torch.empty(M, Kk, H, dtype=x.dtype, device=x.device)
    R = M * Kk
    if R == 0 or H == 0:
        return (y, x.new_zeros(R, 2 * I)) if gate_up_rows else y
    e = expert_ids.reshape(-1) - first_expert
    order = torch.sort(e, stable=True).indices
    bm = linear_config(2 * I, H, chunks, x.dtype, gate_up.dtype).BM
    assert linear_config(H, I, chunks, x.dtype, down.dtype).BM == bm
    tiles = _expert_tiles(e, E, bm)
    xg = x.contiguous()[order // Kk]  # [R, H] grouped by expert
    gu = torch.empty(R, 2 * I, dtype=x.dtype, device=x.device)
    launch_fast_linear(xg, gate_up.contiguous(), None, gu, chunks, tiles, 2 * I * H)
    h = silu_mul_rows(gu[:, :I], gu[:, I:], torch.empty(R, I, dtype=x.dtype, device=x.device))
    ys = torch.empty(R, H, dtype=x.dtype, device=x.device)
    launch_fast_linear(h, down.contiguous(), None, ys, chunks, tiles, H * I)
    y.view(R, H)[order] = ys
    return (y, gu) if gate_up_rows else y
