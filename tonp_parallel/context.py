"""Context parallelism (CP): each rank of a CP group holds a load-balanced slice of every packed
sequence's tokens.

    split = ContextSplit(bounds=[0, 700, 1000], group=cp_group)
    ids_local = ids[split.rows]                 # this rank's rows, in packed order
    full = split.gather(x_local)                # every rank's rows, back in packed order
    dest, table = split.key_pages(block=64)     # K/V of every row as pages for attention_paged

Zig-zag halves: sequence i of n tokens is cut into 2C chunks (`row_share`: the first n % 2C
chunks one row longer); CP rank r holds chunks r and 2C-1-r, so with causal attention every
rank does about the same work (an early chunk is cheap, its mirror expensive). Every rank of
the group computes every rank's rows from the bounds alone: nothing about the split travels.
Row-wise ops need nothing more; attention gathers the keys and values of all rows
(tonp_models.layers.context_attention). Gathers move bytes only, so the bits are CP = 1's.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .collectives import all_gather_stacked, group_rank, group_size

Group = Optional[dist.ProcessGroup]


class ContextSplit:
    """The zig-zag split of packed sequences (`bounds`: cu_seqlens as a list, 0 .. T) over
    `group` (None or a group of one: every row local).

    Attributes: rows int64 [T_local] (this rank's packed rows, ascending), rows_of (every
    rank's), seq int64 [T] (sequence of each packed row), positions int64 [T] (position of each
    packed row in its sequence), bounds, total (T).
    """

    def __init__(self, bounds: Sequence[int], group: Group):
        self.group, self.bounds = group, list(bounds)
        self.size, self.rank = group_size(group), group_rank(group)
        self.total = self.bounds[-1] if self.bounds else 0
        C, T = self.size, self.total
        counts = torch.tensor([b - a for a, b in zip(self.bounds, self.bounds[1:])],
                              dtype=torch.int64)
        self.seq = torch.repeat_interleave(torch.arange(len(counts)), counts, output_size=T)
        self.positions = positions_of(self.bounds)
        # The chunk j of each row (row_share's 2C chunks of its sequence: the first n % 2C one
        # row longer) and the rank holding that chunk: j for j < C, else 2C - 1 - j.
        n = counts[self.seq]
        base, extra = n // (2 * C), n % (2 * C)
        long_rows = extra * (base + 1)
        chunk = torch.where(self.positions < long_rows, self.positions // (base + 1),
                            extra + (self.positions - long_rows) // base.clamp(min=1))
        owner = torch.where(chunk < C, chunk, 2 * C - 1 - chunk)
        self.rows_of = [(owner == r).nonzero().squeeze(1) for r in range(C)]
        self.rows = self.rows_of[self.rank]
        self._order = torch.cat(self.rows_of)
        self._memo: Dict[Tuple, object] = {}

    @property
    def width(self) -> int:
        """The largest rank's row count (every rank pads to it for the all-gather)."""
        return max((len(r) for r in self.rows_of), default=0)

    def gather_raw(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's rows x [T_local, ...] -> [T, ...] in packed order (no autograd)."""
        if self.size == 1:
            return x
        if x.shape[0] != len(self.rows):
            raise ValueError(f"tonp_parallel.ContextSplit: this rank holds {len(self.rows)} "
                             f"rows, got a tensor of {x.shape[0]}")
        pad = x.new_zeros((self.width - x.shape[0], *x.shape[1:]))
        stacked = all_gather_stacked(torch.cat([x.detach(), pad]), self.group)     # (C, w, ...)
        parts = torch.cat([stacked[r, :len(rows)] for r, rows in enumerate(self.rows_of)])
        full = x.new_empty((self.total, *x.shape[1:]))
        full[self._order] = parts
        return full

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Differentiable `gather_raw` for a replicated consumer (every CP rank computes the
        same thing from the gathered rows): backward keeps this rank's rows of the grad."""
        if self.size == 1:
            return x
        return _Gather.apply(x, self)

    def key_pages(self, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every packed row's K/V as pages of `block` positions (a page holds one sequence's
        positions [p*B, (p+1)*B)): (dest int64 [T]: the row of the flat page buffer [pages*B]
        that packed row t goes to; page_table int32 [S, max pages]). Memoised."""
        key = ("pages", block)
        if key not in self._memo:
            counts = [b - a for a, b in zip(self.bounds, self.bounds[1:])]
            pages = [-(-n // block) for n in counts]
            first = torch.tensor([sum(pages[:i]) for i in range(len(pages))], dtype=torch.int64)
            table = torch.zeros((len(pages), max(pages, default=0) or 1), dtype=torch.int32)
            for i, (f, p) in enumerate(zip(first.tolist(), pages)):
                table[i, :p] = torch.arange(f, f + p, dtype=torch.int32)
            dest = first[self.seq] * block + self.positions if self.total else self.seq
            self._memo[key] = (dest, table, sum(pages))
        dest, table, _ = self._memo[key]
        return dest, table

    def num_pages(self, block: int) -> int:
        self.key_pages(block)
        return self._memo[("pages", block)][2]

    def __repr__(self) -> str:
        return (f"ContextSplit(sequences={len(self.bounds) - 1}, rows={self.total}, "
                f"size={self.size}, local={len(self.rows)})")


def positions_of(bounds: Sequence[int]) -> torch.Tensor:
    """Position of every packed row in its sequence: int64 [T] for cu_seqlens `bounds`."""
    counts = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])], dtype=torch.int64)
    T = int(bounds[-1]) if len(bounds) else 0
    starts = torch.tensor(list(bounds[:-1]), dtype=torch.int64)
    return torch.arange(T) - starts.repeat_interleave(counts, output_size=T)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split):
        ctx.split = split
        return split.gather_raw(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.split.rows), None


__all__ = ["ContextSplit", "positions_of"]
