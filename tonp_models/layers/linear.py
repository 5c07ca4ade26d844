"""Tensor-parallel-ready linear layers. Each allocates only its LOCAL shard when built.

At TP degree 1 (tp_group None) both are `tonp_kernels.linear(x, W, chunks=C)`. At TP degree t:
- ColumnParallelLinear holds out_features / t output rows: copy_to_region(x) then the local
  linear; the output stays sharded on its last dim.
- RowParallelLinear holds in_features / t input columns = C / t chunks of the chunk tree: the
  local fp32 subtree (`linear_partial`), then `reduce_from_region` finishes the tree over ranks
  in rank order, so the bits equal TP 1 (CONTRACT.md, chunk tree). The bias comes after.
tonp_parallel is imported only on the TP > 1 path (layers sit above parallel in the import
order, and TP 1 must not need torch.distributed).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import tonp_kernels as tk


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


class ColumnParallelLinear(nn.Module):
    """y = x @ W.T (+ b) with W [out_features / t, in_features] local. x [..., in] -> [..., out/t].

    Args: in_features, out_features (global sizes), bias, chunks (C of the chunk tree over
    in_features), tp_group (None = TP 1), dtype, out_dtype (e.g. fp32 for the LM head).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 chunks: int = tk.DEFAULT_CHUNKS, tp_group=None,
                 dtype: torch.dtype = torch.float32, out_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.tp_group, self.tp_size = tp_group, _tp_size(tp_group)
        self.in_features, self.out_features = in_features, out_features
        self.local_out = _divide(out_features, self.tp_size, "out_features")
        self.chunks, self.out_dtype = chunks, out_dtype
        self.weight = nn.Parameter(torch.empty(self.local_out, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(self.local_out, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            from tonp_parallel import copy_to_region
            x = copy_to_region(x, self.tp_group)
        return tk.linear(x, self.weight, self.bias, chunks=self.chunks, out_dtype=self.out_dtype)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.local_out}), "
                f"tp={self.tp_size}, chunks={self.chunks}")


class RowParallelLinear(nn.Module):
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return tk.linear(x, self.weight, self.bias, chunks=self.chunks)
        from tonp_parallel import reduce_from_region
        # TODO(TP issue): check that the kernel adds the bias in fp32 before its one rounding,
        # as done here, so TP > 1 with a bias matches TP 1 (Qwen3 has no bias).
        partial = tk.linear_partial(x, self.weight, chunks=self.chunks // self.tp_size)
        y = reduce_from_region(partial, self.tp_group)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.local_in}), out={self.out_features}, "
                f"tp={self.tp_size}, chunks={self.chunks}")


def init_normal_(module: nn.Module, std: float) -> None:
    """HF-like init: weights ~ normal(0, std), biases 0 (in module order, from torch's RNG)."""
    with torch.no_grad():
        module.weight.normal_(0.0, std)
        if getattr(module, "bias", None) is not None:
            module.bias.zero_()


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "init_normal_"]
