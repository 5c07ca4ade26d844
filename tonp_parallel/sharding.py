"""Which slice of the full tensor each rank holds, and the region mappings uneven shares need.

    shard = Shard(dim=0, start=64, length=64, full=128, group="tp")    # a parameter's slice
    shards = parameter_shards(model)             # {name: Shard}: the one sharding truth
    share = scatter_rows_to_region(x, tp_group)  # rows [start, start + n) of this TP rank
    x     = gather_rows_from_region(share, tp_group, total_rows)   # back to every row
    w     = sum_over_replicas(w_local, tp_group, copies)           # grads summed over copies

Every layer that holds a slice of a parameter says so in its `shards` dict when it is built;
`parameter_shards` collects them, and the model's init, the checkpoint loader and saver, the
gradient sync and the megatron modules read that, never a list of their own.
Uneven rows: under TP x EP each TP rank dispatches only its share of the (replicated) tokens,
so an expert sees every token once (rank r holds part r % P, the first n % P parts one row
more). Replicas: when TP exceeds the KV heads, `copies` consecutive TP ranks hold one KV head
and each computes part of its gradient; the backward sums the copies' parts in rank order.
The mappings are autograd-aware and move bytes only, so they never change a bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .collectives import all_gather_stacked, group_rank, group_size, tree_order_sum

Group = Optional[dist.ProcessGroup]


@dataclass(frozen=True)
class Shard:
    """A local parameter is full.narrow(dim, start, length) of the full tensor, whose size on
    `dim` is `full`; `group` names the ParallelGroups group that splits it ("tp" or "ep")."""
    dim: int
    start: int
    length: int
    full: int
    group: str = "tp"

    def full_shape(self, local_shape) -> Tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = self.full
        return tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This shard's slice of the full tensor (a view)."""
        return full.narrow(self.dim, self.start, self.length)


def shards_of(module: nn.Module) -> Dict[str, Shard]:
    """The module's own {local parameter name: Shard} (empty when nothing is sharded)."""
    return getattr(module, "shards", None) or {}


def parameter_shards(module: nn.Module) -> Dict[str, Shard]:
    """{qualified parameter name: Shard} for every parameter of `module` (and its children)
    that this rank holds only a slice of; a parameter absent from it is whole on every rank."""
    out = {}
    for prefix, sub in module.named_modules():
        for name, shard in shards_of(sub).items():
            out[f"{prefix}.{name}" if prefix else name] = shard
    return out


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


__all__ = ["Shard", "shards_of", "parameter_shards", "row_share", "scatter_rows_to_region",
           "gather_rows_from_region", "sum_over_replicas"]
