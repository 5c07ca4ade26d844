"""Megatron-style autograd pairs: every collective of a parallel layer, visible and differentiable.

    copy_to_region(x, g)              fwd: identity             bwd: sum of grads over g
    reduce_from_region(p, g)          fwd: fixed-tree all-reduce bwd: identity
    gather_from_region(x, g, dim)     fwd: concat ranks on dim   bwd: this rank's slice
    scatter_to_region(x, g, dim)      fwd: this rank's slice     bwd: concat ranks on dim
    reduce_scatter_to_region(p, g, d) fwd: fixed-tree sum, keep this rank's slice of dim d
                                      bwd: concat ranks on dim d
    all_gather_to_region(x, g, d)     fwd: concat ranks on dim d
                                      bwd: sum of grads over g, this rank's slice of dim d
    gather_partials(x, g)             fwd: [W, ...] stacked in rank order   bwd: grad[rank]
    all_to_all(x, out_splits, in_splits, g)  fwd: exchange rows   bwd: the reverse exchange

A column-parallel layer starts with copy_to_region (its input is replicated over TP); a
row-parallel layer computes `tonp_kernels.linear_partial(x, w_local, chunks=C // tp)` (fp32)
and ends with reduce_from_region, whose bits equal `tonp_kernels.linear(x, w, chunks=C)` at TP 1.

In "torch" kernel mode (`tonp_kernels.use("torch")`) the two reductions use the backend's own
`dist.all_reduce` / `dist.reduce_scatter_tensor`, whose order depends on message size and
world, so tests and demos can show what the fixed order buys. Backward passes use the backend's
collectives in every mode: gradients must be correct, not bitwise invariant.
`group=None` (or any group of one) makes every function the identity: no copy, no collective.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
import tonp_kernels

from .collectives import (all_gather_along, all_gather_stacked, all_to_all_rows, group_rank,
                          group_size, reduce_scatter_flat, scatter_along, tree_all_reduce,
                          tree_reduce_scatter)

Group = Optional[dist.ProcessGroup]


def _stock_mode() -> bool:
    return tonp_kernels.get_mode() == "torch"


def _sum_over(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The backend's own all-reduce (for gradients and "torch" mode)."""
    if group_size(group) == 1:
        return x
    y = x.contiguous().clone()
    dist.all_reduce(y, group=group)
    return y


def _backend_reduce_scatter(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's 1/W slice along `dim` of the sum over `group`, in the backend's order."""
    W, d = group_size(group), dim % x.dim()
    src = x.movedim(d, 0).contiguous()
    if src.shape[0] % W:
        raise ValueError(f"tonp_parallel.reduce_scatter_to_region: dim {dim} of size "
                         f"{src.shape[0]} is not divisible by the group size {W}")
    out = src.new_empty((src.shape[0] // W, *src.shape[1:]))
    reduce_scatter_flat(out, src, group=group)
    return out.movedim(0, d).contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _sum_over(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if _stock_mode():
            return _sum_over(x.detach(), group)
        return tree_all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_along(x.detach(), group, dim)

    @staticmethod
    def backward(ctx, grad):
        return scatter_along(grad, ctx.group, ctx.dim), None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return scatter_along(x.detach(), group, dim).clone()

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        if group_size(group) > 1 and _stock_mode():
            return _backend_reduce_scatter(x.detach(), group, dim)
        return tree_reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.group, ctx.dim), None, None


class _AllGatherToRegion(_GatherFromRegion):
    @staticmethod
    def backward(ctx, grad):
        return _backend_reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _GatherPartials(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_stacked(x.detach(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad[group_rank(ctx.group)], None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group):
        ctx.group, ctx.outs, ctx.ins = group, output_split_sizes, input_split_sizes
        return all_to_all_rows(x.detach(), output_split_sizes, input_split_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        # The rows came from where they are sent back to: swap the split sizes.
        back = all_to_all_rows(grad.contiguous(), ctx.ins, ctx.outs, ctx.group)
        return back, None, None, None


def copy_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a tensor-parallel region: forward identity, backward sums the grads over `group`."""
    if group_size(group) == 1:
        return x
    return _CopyToRegion.apply(x, group)


def reduce_from_region(partial: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a row-parallel region: fp32 partial [...] -> fp32 sum over `group` [...].

    Invariant mode: `tree_all_reduce` (the contract's fixed tree, same bits on every rank and
    for every message size). "torch" mode: the backend's `dist.all_reduce`. Backward: identity.
    """
    if group_size(group) == 1:
        return partial
    return _ReduceFromRegion.apply(partial, group)


def gather_from_region(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's x [..., n, ...] along `dim` in rank order -> [..., W*n, ...].
    Backward: this rank's slice of the grad (the consumer is replicated over `group`)."""
    if group_size(group) == 1:
        return x
    return _GatherFromRegion.apply(x, group, dim)


def scatter_to_region(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """This rank's 1/W slice of x along `dim` (x replicated over `group`). Backward: gather."""
    if group_size(group) == 1:
        return x
    return _ScatterToRegion.apply(x, group, dim)


def reduce_scatter_to_region(partial: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Sequence-parallel exit of a row-parallel region: fp32 partial [..., S, ...] -> this rank's
    slice [..., S/W, ...] of the sum over `group` (fixed tree; "torch" mode: the backend's
    reduce_scatter). Backward: all-gather of the grad along `dim`."""
    if group_size(group) == 1:
        return partial
    return _ReduceScatterToRegion.apply(partial, group, dim)


def all_gather_to_region(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Sequence-parallel entry of a column-parallel region (megatron's gather from the
    sequence-parallel region): every rank's x [..., n, ...] concatenated along `dim` in rank
    order -> [..., W*n, ...]. Backward: the grads summed over `group` (each rank's consumer
    computed other columns), this rank's slice (the backend's reduce_scatter)."""
    if group_size(group) == 1:
        return x
    return _AllGatherToRegion.apply(x, group, dim)


def gather_partials(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's x [...] stacked in rank order -> [W, ...], e.g. per-shard (max, sum) pairs
    for `tonp_kernels.lse_finish`. Backward: grad[rank] (the consumer is replicated)."""
    if group_size(group) == 1:
        return x.unsqueeze(0)
    return _GatherPartials.apply(x, group)


def all_to_all(x: torch.Tensor, output_split_sizes: Optional[Sequence[int]] = None,
               input_split_sizes: Optional[Sequence[int]] = None,
               group: Group = None) -> torch.Tensor:
    """Exchange rows for expert dispatch, differentiably.

    x [N, ...]: rows input_split_sizes[j] go to rank j (in order); the result holds
    output_split_sizes[j] rows from rank j, in rank order -> [sum(output_split_sizes), ...].
    None splits mean equal parts. Exchange the counts first with
    `all_to_all(counts_int64_[W], group=group)` (equal splits of one element each).
    Backward: the grads travel the reverse way.
    """
    return _AllToAll.apply(x, output_split_sizes, input_split_sizes, group)
