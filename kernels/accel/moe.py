"""Exact MoE routing and the fused SwiGLU experts (moe_ops.cpp).

moe_route, per row: the max and the sum of exp(x - max) as scans over the experts in id order,
p = exp(x - max) / sum, the top-k by k repeated scans (strictly greater wins, so ties go to the
lower id; a NaN wins only as the first untaken), the weights renormalised by their sum in slot
order. A program owns a tile of rows and all their experts; a scan's value here is the one the
CPU's scan finds: the max of the non-NaN probabilities and its lowest id (no order can change a
maximum or a minimum index).

moe_experts: rows grouped by expert (stable), then the linear kernel over a tile table (each row
tile one expert's), gate_up rounded to x's dtype, silu_mul in x's dtype, down rounded: each row
gets the bits of its expert's linears on that row alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import numerics as nm, registry
from ._launch import check_device, float_dtype, launch, pow2
from .linear import check_chunks, launch_linear, tiles_for
from .rowwise import silu_mul_rows


@triton.jit
def _moe_route_kernel(x_ptr, ids_ptr, w_ptr, M, E, TOPK, BM: tl.constexpr, EP: tl.constexpr,
                      KP: tl.constexpr, BF16: tl.constexpr, NORMALIZE: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rm = rows < M
    r64 = rows.to(tl.int64)
    x_rows = x_ptr + r64 * E
    mx = nm.load_f32(x_rows, rm, BF16)
    for i in range(1, E):
        xi = nm.load_f32(x_rows + i, rm, BF16)
        mx = tl.where(xi > mx, xi, mx)
    z = tl.full([BM], 0, tl.float32)
    for i in range(E):
        z = z + nm.exp(nm.load_f32(x_rows + i, rm, BF16) - mx)
    e = tl.arange(0, EP)[None, :]
    x = nm.load_f32(x_rows[:, None] + e, rm[:, None] & (e < E), BF16)
    p = tl.div_rn(nm.exp(x - mx[:, None]), z[:, None])  # [BM, EP]: the same exp, the same division
    taken = tl.broadcast_to(e >= E, [BM, EP])  # padding ids count as taken
    slot = tl.arange(0, KP)[None, :]
    w = tl.full([BM, KP], 0, tl.float32)
    ids = tl.full([BM, KP], 0, tl.int64)
    s = tl.full([BM], 0, tl.float32)
    # The reductions below are order-free (ids; one value among zeros; probabilities >= +0
    # and -inf, NaN excluded: no -0), so the compiler's tree serves: it compiles fast at 128
    # experts.
    for k in range(TOPK):
        first = nm.row_min_free(tl.where(taken, EP, e))  # the scan's starting candidate
        p_first = nm.take_int(p, e == first[:, None])
        cand = (~taken) & (p == p)
        top = nm.row_max_free(tl.where(cand, p, float("-inf")))
        best = nm.row_min_free(tl.where(cand & (p == top[:, None]), e, EP))
        best = tl.where(p_first != p_first, first, best)
        hit = e == best[:, None]
        wk = nm.take_int(p, hit)
        taken = taken | hit
        s = s + wk
        w = tl.where(slot == k, wk[:, None], w)
        ids = tl.where(slot == k, best.to(tl.int64)[:, None], ids)
    if NORMALIZE:
        w = tl.div_rn(w, s[:, None])
    out = r64[:, None] * TOPK + slot
    mask = rm[:, None] & (slot < TOPK)
    tl.store(ids_ptr + out, ids, mask=mask)
    tl.store(w_ptr + out, w, mask=mask)


def moe_route(router_logits: torch.Tensor, top_k: int, normalize: bool):
    """torch.ops.tonp.moe_route's bits: router_logits [M, E] -> (ids int64, w fp32 [M, k])."""
    x = router_logits
    if x.dim() != 2:
        raise ValueError(f"tonp.moe_route: router logits must be [M, E], got {tuple(x.shape)}")
    bf16 = float_dtype(x, "moe_route", "router_logits")
    check_device("moe_route", x)
    M, E = x.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"tonp.moe_route: top_k={top_k} outside [1, {E}]")
    ids = torch.empty(M, top_k, dtype=torch.int64, device=x.device)
    w = torch.empty(M, top_k, dtype=torch.float32, device=x.device)
    if M:
        BM = 16
        launch(_moe_route_kernel, (triton.cdiv(M, BM),), x.contiguous(), ids, w, M, E, top_k,
               BM=BM, EP=pow2(E), KP=pow2(top_k), BF16=bf16, NORMALIZE=bool(normalize))
    return ids, w


def _expert_tiles(e: torch.Tensor, E: int, BM: int) -> torch.Tensor:
    """int32 [T, 3] (expert, first row, rows): each expert's rows (grouped, stable) in tiles of
    at most BM rows. Which rows share a tile never changes a row's bits."""
    counts = torch.bincount(e, minlength=E).tolist()
    tiles, start = [], 0
    for ex, n in enumerate(counts):
        tiles += [(ex, r0, min(BM, start + n - r0)) for r0 in range(start, start + n, BM)]
        start += n
    return torch.tensor(tiles, dtype=torch.int32, device=e.device).reshape(-1, 3)


def moe_experts(x: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, first_expert: int = 0, chunks: int = 8,
                gate_up_groups=None, down_groups=None, *, pairs=None, gate_up_rows: bool = False):
    """torch.ops.tonp.moe_experts's bits: x [M, H], expert_ids int64 [M, K], gate_up [E, 2I, H],
    down [E, H, I] -> y [M, K, H] in x.dtype (row (m, k) through expert ids[m, k] - first).
    pairs: as linear's (the bf16 x bf16 pair chains forced on or off; None: as the C++ build).
    gate_up_rows: (y, the gate_up rows [M K, 2I] in expert-group order), moe_experts_train's
    outputs (the rows the experts' backward reads). gate_up_groups / down_groups: the CPU
    kernels' column groups of the weights (tonp_kernels.pack_weight_groups), not read here."""
    op = "moe_experts"
    if x.dim() != 2:
        raise ValueError(f"tonp.{op}: x must be [M, H], got {tuple(x.shape)}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"tonp.{op}: expert ids must be [M, K] with M = {x.shape[0]}, got "
                         f"{tuple(expert_ids.shape)}")
    if expert_ids.dtype != torch.int64:
        raise TypeError(f"tonp.{op}: expert ids must be int64, got {expert_ids.dtype}")
    if not (gate_up.dim() == 3 and down.dim() == 3 and gate_up.shape[0] == down.shape[0]
            and gate_up.shape[2] == x.shape[1] and gate_up.shape[1] % 2 == 0
            and down.shape[1] == x.shape[1] and 2 * down.shape[2] == gate_up.shape[1]):
        raise ValueError(f"tonp.{op}: expected gate_up [E, 2I, H] and down [E, H, I] with "
                         f"H = {x.shape[1]}, got {tuple(gate_up.shape)} and {tuple(down.shape)}")
    float_dtype(x, op, "x")
    float_dtype(gate_up, op, "gate_up")
    if down.dtype != gate_up.dtype:
        raise TypeError(f"tonp.{op}: gate_up and down dtypes differ")
    check_device(op, x, expert_ids, gate_up, down)
    M, H = x.shape
    Kk = expert_ids.shape[1]
    E, I = down.shape[0], down.shape[2]
    check_chunks(op, H, chunks)
    check_chunks(op, I, chunks)
    y = torch.empty(M, Kk, H, dtype=x.dtype, device=x.device)
    R = M * Kk
    if R == 0 or H == 0:
        return (y, x.new_zeros(R, 2 * I)) if gate_up_rows else y
    e = expert_ids.reshape(-1) - first_expert
    bad = (e < 0) | (e >= E)
    if bool(bad.any()):
        raise IndexError(f"tonp.{op}: expert id {int(expert_ids.reshape(-1)[bad][0])} is not "
                         f"one of this call's experts [{first_expert}, {first_expert + E})")
    order = torch.sort(e, stable=True).indices
    BM = tiles_for(2 * I)[0]  # the linear's row tile (the table's tiles hold at most BM rows)
    tiles = _expert_tiles(e, E, BM)
    xg = x.contiguous()[order // Kk]  # [R, H] grouped by expert
    gu = torch.empty(R, 2 * I, dtype=x.dtype, device=x.device)
    launch_linear(xg, gate_up.contiguous(), None, gu, chunks, tiles, 2 * I * H, None, pairs)
    h = silu_mul_rows(gu[:, :I], gu[:, I:], torch.empty(R, I, dtype=x.dtype, device=x.device))
    ys = torch.empty(R, H, dtype=x.dtype, device=x.device)
    launch_linear(h, down.contiguous(), None, ys, chunks, tiles, H * I, None, pairs)
    y.view(R, H)[order] = ys
    return (y, gu) if gate_up_rows else y


def moe_experts_train(x, expert_ids, gate_up, down, first_expert, chunks):
    """(y, gate_up rows): the context's moe_experts kernel (exact or fast) handing back the
    grouped gate_up rows it computed: y has the forward's bits, the rows cost nothing more."""
    return registry.kernel("moe_experts")(x, expert_ids, gate_up, down, first_expert, chunks,
                                          gate_up_rows=True)
