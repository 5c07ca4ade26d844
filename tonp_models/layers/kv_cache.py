"""The paged KV cache: its own small object, owned by whoever decodes (the generator).

A page holds `page_size` consecutive positions of one sequence, and page_size is the attention
block B: the page is the unit of both storage and of the online-softmax reduction, so decode
visits exactly the key blocks that the full causal pass visits (CONTRACT.md, Attention).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch


class CacheFullError(RuntimeError):
    """Raised when a step needs more pages or positions than the cache holds."""


@dataclass
class CacheStep:
    """Metadata of one forward over a cache: T new tokens of S sequences (in call order).

    slots [S] cache slots; counts [S] new tokens each; positions [T] int64 absolute positions;
    q_seq [T] int32 slot of each token; slot_mapping [T] int64 flat row (page * B + offset)."""
    slots: List[int]
    counts: List[int]
    positions: torch.Tensor
    q_seq: torch.Tensor
    slot_mapping: torch.Tensor


class PagedKVCache:
    """K/V of every layer in pages [num_pages, page_size, kv_heads, head_dim] plus page tables.

    Args:
        num_layers, kv_heads (local to this rank), head_dim: the model's attention shape.
        layers: the layer ids this cache holds pages for (default all; a pipeline stage's
            cache holds its own layers, the others are empty [0, page_size, kv_heads, D]).
        page_size: positions per page; must equal the model's attention block.
        num_pages: pages shared by all sequences.
        max_seqs: sequence slots; max_seq_len: positions a sequence may reach.
        dtype: the activation dtype (K after RoPE and QK-norm and V, as the full pass uses them).
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, *, page_size: int,
                 num_pages: int, max_seqs: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, device="cpu", layers=None):
        if page_size < 1 or num_pages < 1 or max_seqs < 1 or max_seq_len < 1:
            raise ValueError("PagedKVCache: sizes must be positive")
        self.page_size, self.num_pages, self.max_seq_len = page_size, num_pages, max_seq_len
        self.layers = tuple(range(num_layers) if layers is None else layers)
        held = set(self.layers)

        def pages(layer):
            n = num_pages if layer in held else 0
            return torch.zeros((n, page_size, kv_heads, head_dim), dtype=dtype, device=device)
        self.k = [pages(i) for i in range(num_layers)]
        self.v = [pages(i) for i in range(num_layers)]
        self.max_pages_per_seq = -(-max_seq_len // page_size)
        self.page_table = torch.zeros((max_seqs, self.max_pages_per_seq), dtype=torch.int32)
        self.lengths = [0] * max_seqs
        self._pages: List[List[int]] = [[] for _ in range(max_seqs)]
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._free_slots = list(range(max_seqs - 1, -1, -1))

    # -- sequence slots ----------------------------------------------------------------------
    def add_sequence(self) -> int:
        """Claim a free slot (length 0) and return it."""
        if not self._free_slots:
            raise CacheFullError(f"PagedKVCache: all {len(self.lengths)} sequence slots are in use")
        slot = self._free_slots.pop()
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        """Return a slot and its pages to the free lists."""
        self._free_pages.extend(reversed(self._pages[slot]))
        self._pages[slot] = []
        self.lengths[slot] = 0
        self._free_slots.append(slot)

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def pages_needed(self, slot: int, new_tokens: int) -> int:
        total = -(-(self.lengths[slot] + new_tokens) // self.page_size)
        return max(0, total - len(self._pages[slot]))

    # -- one forward ---------------------------------------------------------------------------
    def prepare(self, slots: Sequence[int], counts: Sequence[int]) -> CacheStep:
        """Allocate pages for `counts[i]` new tokens of sequence `slots[i]` and describe the step."""
        if len(slots) != len(counts) or len(set(slots)) != len(slots):
            raise ValueError("PagedKVCache.prepare: one count per distinct slot")
        B = self.page_size
        new_pages = [self.pages_needed(s, n) for s, n in zip(slots, counts)]
        for s, n in zip(slots, counts):
            if self.lengths[s] + n > self.max_seq_len:
                raise CacheFullError(f"PagedKVCache: sequence slot {s} would reach "
                                     f"{self.lengths[s] + n} positions > max_seq_len "
                                     f"{self.max_seq_len}")
        if sum(new_pages) > len(self._free_pages):
            raise CacheFullError(f"PagedKVCache: step needs {sum(new_pages)} pages, "
                                 f"{len(self._free_pages)} free of {self.num_pages}")
        positions, q_seq, rows = [], [], []
        for s, n, extra in zip(slots, counts, new_pages):
            pages = self._pages[s]
            for _ in range(extra):
                page = self._free_pages.pop()
                self.page_table[s, len(pages)] = page
                pages.append(page)
            start = self.lengths[s]
            positions.extend(range(start, start + n))
            q_seq.extend([s] * n)
            rows.extend(pages[p // B] * B + p % B for p in range(start, start + n))
        return CacheStep(list(slots), list(counts), torch.tensor(positions, dtype=torch.int64),
                         torch.tensor(q_seq, dtype=torch.int32),
                         torch.tensor(rows, dtype=torch.int64))

    def write(self, layer: int, step: CacheStep, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's K/V [T, kv_heads, head_dim] (exact copies) for one layer."""
        kc, vc = self.k[layer], self.v[layer]
        if k.shape[1:] != kc.shape[2:] or k.dtype != kc.dtype:
            raise ValueError(f"PagedKVCache.write: K {tuple(k.shape)}/{k.dtype} does not fit pages "
                             f"{tuple(kc.shape)}/{kc.dtype}")
        kc.view(-1, *kc.shape[2:]).index_copy_(0, step.slot_mapping, k.detach())
        vc.view(-1, *vc.shape[2:]).index_copy_(0, step.slot_mapping, v.detach())

    def commit(self, step: CacheStep) -> None:
        """Advance the lengths once every layer has written the step."""
        for s, n in zip(step.slots, step.counts):
            self.lengths[s] += n
