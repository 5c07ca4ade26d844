"""Dense SwiGLU MLP (Qwen3's `mlp_only_layers` / non-sparse layers): down(silu(gate(x)) * up(x))."""
from __future__ import annotations

import torch
from torch import nn

import tonp_kernels as tk

from .linear import ColumnParallelLinear, RowParallelLinear
from .probe import probe


class DenseMLP(nn.Module):
    """x [T, H] -> [T, H]. gate/up are column-parallel (I / t local), down is row-parallel."""

    def __init__(self, hidden_size: int, intermediate_size: int, *,
                 chunks: int = tk.DEFAULT_CHUNKS, tp_group=None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        kw = dict(chunks=chunks, tp_group=tp_group, dtype=dtype)
        # forward enters the TP region once for gate and up
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, entered=True, **kw)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, entered=True, **kw)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor, sp=None) -> torch.Tensor:
        """x [T, H] (under sequence parallelism `sp`: this rank's [n, H]) -> like x."""
        from tonp_parallel.sequence import enter_tp_region
        x = enter_tp_region(x, self.gate_proj.tp_group, sp)                        # (T, H)
        h = tk.silu_mul(self.gate_proj(x), self.up_proj(x))                       # (T, I/t)
        probe("act", h, shard_dim=-1 if self.gate_proj.tp_size > 1 else None)
        return self.down_proj(h) if sp is None else self.down_proj(h, sp=sp)
