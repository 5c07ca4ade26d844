"""Region mappings the model's TP x EP layout needs beyond regions.py: uneven row shares and
replica gradient sums. All are autograd-aware and move bytes only (no arithmetic on the forward
values), so they never change a bit of the result.

    share = scatter_rows_to_region(x, tp_group)      # rows [start, start + n) of this TP rank
    x     = gather_rows_from_region(share, tp_group, total_rows)   # back to every row
    w     = sum_over_replicas(w_local, tp_group, copies)           # grads summed over copies

Why uneven rows: an MoE layer under TP x EP lets each TP rank dispatch only its share of the
(replicated) tokens, so an expert sees every token exactly once; the token count need not divide
the TP degree. With P parts, rank r holds part r % P, rows `row_share(n, P, r % P)` (the first
n % P parts get one more row); P < W when only P ranks of the TP group share an EP group.

Why replicas: when TP exceeds the KV heads, `copies` consecutive TP ranks hold the same KV head;
each computes only its query heads' part of that head's weight gradient, so the forward is an
identity and the backward sums the copies' gradients (in rank order), giving every copy the
whole gradient (the update stays identical on every copy).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .collectives import all_gather_stacked, group_rank, group_size, tree_order_sum

Group = Optional[dist.ProcessGroup]


def row_share(n: int, size: int, rank: int) -> Tuple[int, int]:
    """(start, count) of rank `rank`'s contiguous share of n rows split over `size` ranks."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


def _part(group: Group, parts: int) -> Tuple[int, int]:
    W = group_size(group)
    if parts < 1 or W % parts:
        raise ValueError(f"tonp_parallel: {parts} row parts do not tile a group of {W} ranks")
    return group_rank(group) % parts, parts


def _gather_rows(x: torch.Tensor, group: Group, total: int, parts: int) -> torch.Tensor:
    width = -(-total // parts)  # pad every share to the largest one: all_gather needs equal shapes
    pad = x.new_zeros((width - x.shape[0], *x.shape[1:]))
    stacked = all_gather_stacked(torch.cat([x.detach(), pad]), group)            # (W, width, ...)
    # Ranks p, p + parts, ... hold the same part (equal bits): take ranks 0..parts-1.
    return torch.cat([stacked[p, :row_share(total, parts, p)[1]] for p in range(parts)])


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, parts):
        ctx.group, ctx.total, ctx.parts = group, x.shape[0], parts
        start, n = row_share(x.shape[0], parts, _part(group, parts)[0])
        return x[start:start + n].clone()

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad.contiguous(), ctx.group, ctx.total, ctx.parts), None, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, total, parts):
        ctx.group, ctx.total, ctx.parts = group, total, parts
        return _gather_rows(x, group, total, parts)

    @staticmethod
    def backward(ctx, grad):
        start, n = row_share(ctx.total, ctx.parts, _part(ctx.group, ctx.parts)[0])
        return grad[start:start + n].contiguous(), None, None, None


class _SumOverReplicas(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, copies):
        ctx.group, ctx.copies = group, copies
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grads = all_gather_stacked(grad.contiguous(), ctx.group)                 # (W, ...)
        first = group_rank(ctx.group) // ctx.copies * ctx.copies
        return tree_order_sum(grads[first:first + ctx.copies].unbind(0)), None, None


def scatter_rows_to_region(x: torch.Tensor, group: Group, parts: Optional[int] = None
                           ) -> torch.Tensor:
    """This rank's contiguous share of the rows of x [N, ...] (replicated over `group`) ->
    [n, ...]. The rows are split in `parts` (default: the group size; rank r takes part
    r % parts, see `row_share`). Backward: the parts' grads gathered back to [N, ...]."""
    parts = parts or group_size(group)
    if group_size(group) == 1 or parts == 1:
        return x
    _part(group, parts)
    return _ScatterRows.apply(x, group, parts)


def gather_rows_from_region(x: torch.Tensor, group: Group, total: int,
                            parts: Optional[int] = None) -> torch.Tensor:
    """The inverse of `scatter_rows_to_region`: every part [n_p, ...] in part order ->
    [total, ...] on every rank. Backward: this rank's part of the grad (replicated consumer)."""
    parts = parts or group_size(group)
    if group_size(group) == 1 or parts == 1:
        return x
    n = row_share(total, parts, _part(group, parts)[0])[1]
    if x.shape[0] != n:
        raise ValueError(f"tonp_parallel.gather_rows_from_region: this rank holds {x.shape[0]} "
                         f"rows, its share of {total} is {n}")
    return _GatherRows.apply(x, group, total, parts)


def sum_over_replicas(x: torch.Tensor, group: Group, copies: int) -> torch.Tensor:
    """Forward identity; backward: the sum (rank order) of the grads of the `copies`
    consecutive ranks of `group` that hold the same tensor as this rank."""
    W = group_size(group)
    if copies == 1 or W == 1:
        return x
    if W % copies:
        raise ValueError(f"tonp_parallel.sum_over_replicas: {copies} copies do not tile a group "
                         f"of {W}")
    return _SumOverReplicas.apply(x, group, copies)


__all__ = ["row_share", "scatter_rows_to_region", "gather_rows_from_region", "sum_over_replicas"]
