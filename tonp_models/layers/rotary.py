"""Rotary position embedding (RoPE), HF's "default" rope_type.

The cos/sin tables are computed once for every position up to `max_positions`, in fp32, with
transformers' formulas, and rows are then looked up by position: a token's rotation depends
only on its position, never on which other positions were computed in the same call (torch's
vectorised cos/sin may round differently from its scalar tail, so computing them per call would
make the bits depend on the batch). Applying them (`tonp_kernels.rope`: x * cos + rotate_half(x)
* sin, each step rounded to x's dtype) is elementwise, so it rounds identically in every path.
"""
from __future__ import annotations

import torch
from torch import nn

import tonp_kernels as tk


class RotaryEmbedding(nn.Module):
    """Tables cos/sin [max_positions, head_dim] fp32 (non-persistent buffers)."""

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        super().__init__()
        self.head_dim, self.theta, self.max_positions = head_dim, theta, max_positions
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute the tables, e.g. after building on the meta device. Always on the CPU
        (a GPU's cos / sin round differently), then moved to the buffers' device: the tables,
        hence every rotation, have the same bits on every device."""
        head_dim, theta, cpu = self.head_dim, self.theta, torch.device("cpu")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                                 device=cpu).float() / head_dim))  # (D/2,)
        pos = torch.arange(self.max_positions, dtype=torch.int64, device=cpu).float()
        freqs = pos[:, None] * inv_freq[None, :]                                   # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)                                    # (P, D)
        self.cos, self.sin = emb.cos().to(self.cos.device), emb.sin().to(self.sin.device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D], positions int [T] -> rotated (q, k) in their dtype."""
        return (tk.rope(q, self.cos, self.sin, positions),
                tk.rope(k, self.cos, self.sin, positions))
