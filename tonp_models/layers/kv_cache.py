"""The paged KV cache's storage: K/V pages that the attention layers write and read at the
pages a forward's `CacheStep` names. Which pages a sequence holds (slots, page tables,
reference counts, the prefix cache's LRU) is the scheduler's: tonp_models.engine.pages.

A page holds `page_size` consecutive positions of one sequence, and page_size is the attention
block B: the page is the unit of both storage and of the online-softmax reduction, so decode
visits exactly the key blocks that the full causal pass visits (CONTRACT.md, Attention).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

import tonp_kernels as tk


class CacheFullError(RuntimeError):
    """Raised when a step needs more pages or positions than the cache holds."""


@dataclass
class CacheStep:
    """The pages one forward writes and reads: T new tokens of S sequences (in call order),
    made by the allocator (engine/pages.py) before the forward and committed by it after.

    cache: the page storage; slots [S] sequence slots; counts [S] new tokens each; positions
    [T] int64 absolute positions; q_seq [T] int32 slot of each token; slot_mapping [T] int64
    flat row (page * B + offset); page_table int32 [max_seqs, max_pages] as of this step. The
    tensors are on the cache's device (one host-to-device copy each per step)."""
    cache: "PagedKVCache"
    slots: List[int]
    counts: List[int]
    positions: torch.Tensor
    q_seq: torch.Tensor
    slot_mapping: torch.Tensor
    page_table: torch.Tensor

    def tokens(self, a: int, b: int, slots: slice) -> "CacheStep":
        """The step of tokens [a, b) (whole sequences `slots` of it): a pipeline micro-batch."""
        return CacheStep(self.cache, self.slots[slots], self.counts[slots], self.positions[a:b],
                         self.q_seq[a:b], self.slot_mapping[a:b], self.page_table)


class PagedKVCache:
    """K/V of every layer in pages [num_pages, page_size, kv_heads, head_dim].

    Args:
        num_layers, kv_heads (local to this rank), head_dim: the model's attention shape.
        layers: the layer ids this cache holds pages for (default all; a pipeline stage's
            cache holds its own layers, the others are empty [0, page_size, kv_heads, D]).
        page_size: positions per page; must equal the model's attention block.
        num_pages: pages shared by all sequences.
        max_seqs, max_seq_len: the sequence slots and positions it was sized for (its
            allocator's defaults).
        dtype: the activation dtype (K after RoPE and QK-norm and V, as the full pass uses them).
        device: where the pages live (the model's device).
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, *, page_size: int,
                 num_pages: int, max_seqs: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, device="cpu", layers=None):
        if page_size < 1 or num_pages < 1 or max_seqs < 1 or max_seq_len < 1:
            raise ValueError("PagedKVCache: sizes must be positive")
        self.page_size, self.num_pages = page_size, num_pages
        self.max_seqs, self.max_seq_len = max_seqs, max_seq_len
        self.device = torch.device(device)
        self.layers = tuple(range(num_layers) if layers is None else layers)
        held = set(self.layers)

        # A layer's pages on 2 MB pages where the system grants them (tk.on_huge_pages; CPU
        # tensors of 4 MB or more): decode reads each sequence's pages scattered, one TLB entry
        # per 2 MB instead of 512 (docs/performance.md, paged attention). The same bits.
        def pages(layer):
            n = num_pages if layer in held else 0
            return tk.on_huge_pages(torch.zeros((n, page_size, kv_heads, head_dim), dtype=dtype, device=device))
        self.k = [pages(i) for i in range(num_layers)]
        self.v = [pages(i) for i in range(num_layers)]

    def copy_rows(self, src: int, dst: int, rows: int) -> None:
        """Copy the first `rows` positions of page src into page dst on every layer held (an
        exact copy: the rows keep their bits)."""
        for layer in self.layers:                   # a pipeline stage holds only its own
            kc, vc = self.k[layer], self.v[layer]
            kc[dst, :rows].copy_(kc[src, :rows])
            vc[dst, :rows].copy_(vc[src, :rows])

    def write(self, layer: int, step: CacheStep, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's K/V [T, kv_heads, head_dim] (exact copies) for one layer."""
        kc, vc = self.k[layer], self.v[layer]
        if k.shape[1:] != kc.shape[2:] or k.dtype != kc.dtype:
            raise ValueError(f"PagedKVCache.write: K {tuple(k.shape)}/{k.dtype} does not fit pages "
                             f"{tuple(kc.shape)}/{kc.dtype}")
        kc.view(-1, *kc.shape[2:]).index_copy_(0, step.slot_mapping, k.detach())
        vc.view(-1, *vc.shape[2:]).index_copy_(0, step.slot_mapping, v.detach())
