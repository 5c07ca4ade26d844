"""Tensor-parallel linear layers; each allocates only its LOCAL shard when built.

At TP 1 (tp_group None) both are `tonp_kernels.linear(x, W, chunks=C)`. At TP t:
- ColumnParallelLinear holds out_features / t output rows (copy_to_region, then the local
  linear); its output stays sharded on the last dim. `copies` consecutive ranks may hold the
  same shard (KV heads when t exceeds them); their gradients are summed over the copies. A
  layer whose linears share one input enters the region once (`enter_tp_region`: copy, or
  the sequence-parallel all-gather) and builds them with entered=True.
- RowParallelLinear holds in_features / t input columns = C / t chunks of the chunk tree: the
  local fp32 subtree, then `reduce_from_region` finishes the tree over ranks in rank order, so
  the bits equal TP 1 (CONTRACT.md, chunk tree); under sequence parallelism (`sp`, a
  tonp_parallel.SequenceSplit) the same tree as a reduce-scatter, keeping this rank's rows.
  The bias comes after.
Each sharded parameter is described by a `tonp_parallel.Shard` in the module's `shards`.
Both hold fp32 weights also in column groups for the rollout engine's forwards where the
forward reads the local weight as it is (layers/weight_groups.py): the same bits.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

import tonp_kernels as tk
from tonp_parallel.sharding import Shard  # moe.py and embedding.py import it from here too

from .weight_groups import HoldsWeightGroups, dense_grouped


def _tp_size(group) -> int:
    if group is None:
        return 1
    import torch.distributed as dist
    return dist.get_world_size(group)


def _tp_rank(group) -> int:
    if group is None:
        return 0
    import torch.distributed as dist
    return dist.get_rank(group)


def _divide(n: int, t: int, what: str) -> int:
    if n % t:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel degree {t}")
    return n // t


class ColumnParallelLinear(HoldsWeightGroups, nn.Module):
    """y = x @ W.T (+ b) with W [out_features / s, in_features] local. x [..., in] -> [..., out/s].

    Args: in_features, out_features (global sizes), bias, chunks (C of the chunk tree over
    in_features), tp_group (None = TP 1), dtype, out_dtype (e.g. fp32 for the LM head),
    copies: consecutive TP ranks holding the same shard (s = t / copies shards; KV heads),
    entered: the owning layer enters the TP region itself (`enter_tp_region`, once for all
    its linears), so this one does not `copy_to_region` its input.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 chunks: int = tk.DEFAULT_CHUNKS, tp_group=None,
                 dtype: torch.dtype = torch.float32, out_dtype: Optional[torch.dtype] = None,
                 copies: int = 1, entered: bool = False):
        super().__init__()
        self.tp_group, self.tp_size, self.entered = tp_group, _tp_size(tp_group), entered
        if copies < 1 or self.tp_size % copies:
            raise ValueError(f"ColumnParallelLinear: copies={copies} must divide the "
                             f"tensor-parallel degree {self.tp_size}")
        self.copies = copies
        n_shards = self.tp_size // copies
        self.in_features, self.out_features = in_features, out_features
        self.local_out = _divide(out_features, n_shards, "out_features")
        self.chunks, self.out_dtype = chunks, out_dtype
        self.weight = nn.Parameter(torch.empty(self.local_out, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(self.local_out, dtype=dtype)) if bias else None
        self.shards: Dict[str, Shard] = {}
        if n_shards > 1:
            start = _tp_rank(tp_group) // copies * self.local_out
            self.shards = {name: Shard(0, start, self.local_out, out_features)
                           for name in ("weight", "bias") if getattr(self, name) is not None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if self.tp_size > 1:
            from tonp_parallel import copy_to_region
            if not self.entered:
                x = copy_to_region(x, self.tp_group)
            if self.copies > 1:
                from tonp_parallel.sharding import sum_over_replicas
                w = sum_over_replicas(w, self.tp_group, self.copies)
                b = None if b is None else sum_over_replicas(b, self.tp_group, self.copies)
        return tk.linear(x, w, b, chunks=self.chunks, out_dtype=self.out_dtype,
                         weight_groups=self._read_group() if self.copies == 1 else None)

    def _grouped_weights(self):
        # Copies > 1: the forward reads the replicas' sum, not this weight.
        return (dense_grouped(self.weight) if self.copies == 1 else None,)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.local_out}), "
                f"tp={self.tp_size}, copies={self.copies}, chunks={self.chunks}")


class RowParallelLinear(HoldsWeightGroups, nn.Module):
    """y = x @ W.T (+ b) with W [out_features, in_features / t] local; x [..., in/t] -> [..., out].

    The input is the column-parallel output of this rank; the result is complete on every rank.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 chunks: int = tk.DEFAULT_CHUNKS, tp_group=None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.tp_group, self.tp_size = tp_group, _tp_size(tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.local_in = _divide(in_features, self.tp_size, "in_features")
        _divide(chunks, self.tp_size, "reduction_chunks")
        self.chunks = chunks
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        self.shards: Dict[str, Shard] = {}
        if self.tp_size > 1:
            start = _tp_rank(tp_group) * self.local_in
            self.shards = {"weight": Shard(1, start, self.local_in, in_features)}

    def forward(self, x: torch.Tensor, sp=None) -> torch.Tensor:
        """x [T, in/t] -> [T, out] (under sequence parallelism `sp`: this rank's [n, out])."""
        if self.tp_size == 1:
            return tk.linear(x, self.weight, self.bias, chunks=self.chunks,
                             weight_groups=self._read_group())
        from tonp_parallel import reduce_from_region
        from .probe import probe
        # The kernel adds the bias in fp32 after the chunk tree, before its one rounding: the
        # same here after the cross-rank tree, so a bias keeps TP t equal to TP 1.
        partial = tk.linear_partial(x, self.weight, chunks=self.chunks // self.tp_size)
        probe("partial", partial, kind="partial")
        y = reduce_from_region(partial, self.tp_group) if sp is None else \
            sp.reduce_scatter(partial)
        probe("reduce", y, kind="collective")
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def _grouped_weights(self):
        # TP > 1: the forward reads a partial over C / t chunks (linear_partial), in place.
        return (dense_grouped(self.weight) if self.tp_size == 1 else None,)

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.local_in}), out={self.out_features}, "
                f"tp={self.tp_size}, chunks={self.chunks}")


__all__ = ["ColumnParallelLinear", "RowParallelLinear"]
