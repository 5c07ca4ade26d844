"""Token embedding (a row lookup: exact) and the LM head (the chunk-tree linear, fp32 logits)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import tonp_kernels as tk


class Embedding(nn.Module):
    """ids int64 [...] -> weight[ids] [..., H]; weight [V, H]. (Vocab-parallel: a later issue.)"""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.index_select(0, ids.reshape(-1)).view(*ids.shape, -1)


class LMHead(nn.Module):
    """h [..., H] -> fp32 logits [..., V] = h @ W.T, with W [V, H] its own or the embedding's
    (tied). Logits are fp32 in every dtype so rollout and training score from the same bits."""

    def __init__(self, vocab_size: int, hidden_size: int, *, chunks: int = tk.DEFAULT_CHUNKS,
                 tied: Optional[Embedding] = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.chunks = chunks
        # A plain attribute list keeps the tied module out of this module's parameters.
        self._tied = [tied] if tied is not None else None
        self.weight = None if tied is not None else \
            nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w = self._tied[0].weight if self._tied is not None else self.weight
        return tk.linear(h, w, chunks=self.chunks, out_dtype=torch.float32)
