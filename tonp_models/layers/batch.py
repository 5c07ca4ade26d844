"""`ForwardBatch`: what one forward of the model runs, typed (SGLang's ForwardBatch, vLLM's
scheduler output as the model sees it). The model builds it from its input (`model.batch`);
every layer reads its fields.

Exactly one of three ways to read keys: `cu_seqlens` (whole packed sequences: the training
forward), `kv` (a CacheStep: the pages the scheduler allocated for the new tokens, which the
attention layers write and then read positions 0..t from) or `cp` (context parallelism: this
rank holds a zig-zag slice of each sequence). `sp` splits the rows over the TP group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from tonp_parallel.context import ContextSplit
from tonp_parallel.sequence import SequenceSplit

from .kv_cache import CacheStep


@dataclass
class ForwardBatch:
    """One forward's rows and how attention reads their keys.

    positions: int64 [T] absolute position of each of this rank's rows (device).
    ids: int64 [T] their token ids (device; what the first stage embeds), or None.
    bounds: the packed sequences' cu_seqlens as a host list [S+1] (all rows, before CP).
    cu_seqlens: int32 [S+1] (device) for whole sequences; kv: a CacheStep; cp: a
        tonp_parallel.ContextSplit; sp: a tonp_parallel.SequenceSplit (or None each).
    """
    positions: torch.Tensor
    ids: Optional[torch.Tensor] = None
    bounds: Optional[List[int]] = None
    cu_seqlens: Optional[torch.Tensor] = None
    kv: Optional[CacheStep] = None
    cp: Optional[ContextSplit] = None
    sp: Optional[SequenceSplit] = None

    @property
    def hidden_rows(self) -> int:
        """Rows of the hidden state between layers (this rank's SP share under SP)."""
        return self.sp.local if self.sp is not None else len(self.positions)


__all__ = ["ForwardBatch"]
