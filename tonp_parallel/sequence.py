"""Megatron's sequence parallelism (SP) over the tensor-parallel group, for ragged token counts.

    sp = SequenceSplit(tp_group, rows=T)       # rank r holds rows [r*n, (r+1)*n) of T padded
    h = sp.scatter(x_TH)                       # replicated [T, H] -> this rank's [n, H]
    x = enter_tp_region(h, tp_group, sp)       # column-parallel entry: all-gather -> [T, H]
    h = sp.reduce_scatter(partial_TH)          # row-parallel exit: fixed tree, keep [n, H]
    x = sp.gather(h, sum_grads=False)          # replicated consumer (MoE, LM head): [T, H]

In the norm and residual regions each TP rank holds n = ceil(T / W) consecutive token rows
instead of all T: the T rows are padded with zero rows to n * W, and the padding lives only
in those regions. Every op there is row-wise (RMSNorm, the residual add: a pad row is 0 and
stays 0), the gather drops the pads before any attention, linear or routing sees the rows,
and the reduce-scatter adds zero pads after the row-parallel partials: a pad row never enters
a reduction with a real row. The reduce-scatter is `tree_reduce_scatter` (the fixed tree of
the all-reduce it replaces, so every real row keeps its bits; "torch" mode uses the backend's
own reduce_scatter). Gathers move bytes only.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .collectives import group_rank, group_size
from .regions import (all_gather_to_region, copy_to_region, gather_from_region,
                      reduce_scatter_to_region, scatter_to_region)

Group = Optional[dist.ProcessGroup]


class SequenceSplit:
    """The SP layout of `rows` token rows over `group`: n = ceil(rows / W) rows a rank.

    Args: group (the TP group; None or a group of one = no split), rows (T, the rows the
    tensor-parallel region sees: every row of this rank's micro-batch or CP slice).
    """

    def __init__(self, group: Group, rows: int):
        self.group, self.rows = group, int(rows)
        self.size, self.rank = group_size(group), group_rank(group)
        self.local = -(-self.rows // self.size)            # n (0 when rows == 0)
        self.pad = self.local * self.size - self.rows

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        if not self.pad:
            return x
        return torch.cat([x, x.new_zeros((self.pad, *x.shape[1:]))])

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Replicated [T, ...] -> this rank's rows [n, ...]. Backward: all-gather."""
        if self.size == 1:
            return x
        return scatter_to_region(self._padded(x), self.group, 0)

    def gather(self, x: torch.Tensor, *, sum_grads: bool = True) -> torch.Tensor:
        """This rank's rows [n, ...] -> every row [T, ...] (pads dropped). Backward: the grads
        summed over the group and scattered (sum_grads, a column-parallel consumer that computes
        other columns on each rank), or this rank's rows alone (a replicated consumer)."""
        if self.size == 1:
            return x
        self._check(x)
        full = all_gather_to_region(x, self.group, 0) if sum_grads else \
            gather_from_region(x, self.group, 0)
        return full[:self.rows]

    def reduce_scatter(self, partial: torch.Tensor) -> torch.Tensor:
        """Row-parallel exit: fp32 partials [T, ...] -> this rank's rows [n, ...] of their sum
        over the group (fixed tree). Backward: all-gather."""
        if self.size == 1:
            return partial
        return reduce_scatter_to_region(self._padded(partial), self.group, 0)

    def _check(self, x: torch.Tensor) -> None:
        if x.shape[0] != self.local:
            raise ValueError(f"tonp_parallel.SequenceSplit: this rank holds {x.shape[0]} rows; "
                             f"its share of {self.rows} rows over {self.size} ranks is "
                             f"{self.local}")

    def __repr__(self) -> str:
        return f"SequenceSplit(rows={self.rows}, size={self.size}, local={self.local})"


def enter_tp_region(x: torch.Tensor, group: Group, sp: Optional[SequenceSplit] = None
                    ) -> torch.Tensor:
    """The input of a layer's column-parallel linears, entered once: `copy_to_region`
    (replicated rows; backward sums the grads over `group`) or, under SP, the all-gather of the
    rows (backward: reduce-scatter of the grads)."""
    if sp is not None and sp.size > 1:
        return sp.gather(x)
    return copy_to_region(x, group)


__all__ = ["SequenceSplit", "enter_tp_region"]
