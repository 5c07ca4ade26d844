"""The paged KV cache: its own small object, owned by whoever decodes (the rollout engine).

A page holds `page_size` consecutive positions of one sequence, and page_size is the attention
block B: the page is the unit of both storage and of the online-softmax reduction, so decode
visits exactly the key blocks that the full causal pass visits (CONTRACT.md, Attention).

Pages are reference-counted so that sequences can share them (prefix caching): `attach` gives a
new sequence full pages another one computed (read only: a sequence only ever writes positions
past its length, which lie in its own pages), `fork` copies a page's first rows into a private
page (the copy is exact, so the rows keep their bits). A page its owner marked `retain`ed is not
freed when its last sequence releases it but parked in a least-recently-used list, counted as
free, and reclaimed (evicted, `on_evict(page)` called) only when a free page is needed.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

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
        self.refs = [0] * num_pages                  # sequences holding each page
        self.on_evict: Optional[Callable[[int], None]] = None
        self._pages: List[List[int]] = [[] for _ in range(max_seqs)]
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._retained: set = set()
        self._lru: "OrderedDict[int, None]" = OrderedDict()   # retained pages nobody holds

    # -- sequence slots ----------------------------------------------------------------------
    def add_sequence(self) -> int:
        """Claim a free slot (length 0) and return it."""
        if not self._free_slots:
            raise CacheFullError(f"PagedKVCache: all {len(self.lengths)} sequence slots are in use")
        slot = self._free_slots.pop()
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        """Return a slot to the free list and drop its pages (a retained page goes to the LRU
        list, its last page first: a sequence's tail is evicted before its head)."""
        for page in reversed(self._pages[slot]):
            self._unref(page)
        self._pages[slot] = []
        self.lengths[slot] = 0
        self._free_slots.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def free_pages(self) -> int:
        """Pages a sequence can get: free ones plus retained ones nobody holds (evictable)."""
        return len(self._free_pages) + len(self._lru)

    @property
    def used_pages(self) -> int:
        """Pages held by at least one sequence."""
        return self.num_pages - self.free_pages

    def pages(self, slot: int) -> List[int]:
        """The pages of a slot, in position order (a copy)."""
        return list(self._pages[slot])

    def pages_needed(self, slot: int, new_tokens: int) -> int:
        total = -(-(self.lengths[slot] + new_tokens) // self.page_size)
        return max(0, total - len(self._pages[slot]))

    # -- sharing -----------------------------------------------------------------------------
    def attach(self, slot: int, pages: Sequence[int]) -> None:
        """Give an empty slot full pages another sequence computed (positions 0..len*B-1)."""
        if self.lengths[slot] or self._pages[slot]:
            raise ValueError(f"PagedKVCache.attach: slot {slot} is not empty")
        for page in pages:
            self._ref(page)
            self._append(slot, page)
        self.lengths[slot] = len(pages) * self.page_size

    def fork(self, slot: int, src: int, rows: int) -> int:
        """Copy the first `rows` positions of page `src` into a new private page of `slot`
        (whose length must be a whole number of pages); returns the new page."""
        B = self.page_size
        if not 0 < rows < B or self.lengths[slot] != len(self._pages[slot]) * B:
            raise ValueError(f"PagedKVCache.fork: rows={rows} must be in (0, {B}) and slot "
                             f"{slot} page-aligned")
        self._ref(src)                              # src may be evictable: keep it meanwhile
        try:
            page = self._take_page()
        finally:
            self._unref(src)
        for layer in self.layers:                   # a pipeline stage holds only its own
            kc, vc = self.k[layer], self.v[layer]
            kc[page, :rows].copy_(kc[src, :rows])
            vc[page, :rows].copy_(vc[src, :rows])
        self._append(slot, page)
        self.lengths[slot] += rows
        return page

    def retain(self, page: int) -> None:
        """Keep `page` (and its K/V) when its last sequence releases it, until evicted."""
        self._retained.add(page)

    def unretain(self, page: int) -> None:
        """Stop keeping `page`: freed now if nobody holds it, else when its last holder does."""
        self._retained.discard(page)
        if self._lru.pop(page, False) is None:
            self._free_pages.append(page)

    def is_held(self, page: int) -> bool:
        return self.refs[page] > 0

    def _ref(self, page: int) -> None:
        if self.refs[page] == 0:
            self._lru.pop(page, None)
        self.refs[page] += 1

    def _unref(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page] == 0:
            if page in self._retained:
                self._lru[page] = None
            else:
                self._free_pages.append(page)

    def _take_page(self) -> int:
        """A free page (held once), evicting the least recently used retained page if needed."""
        if self._free_pages:
            page = self._free_pages.pop()
        elif self._lru:
            page, _ = self._lru.popitem(last=False)
            self._retained.discard(page)
            if self.on_evict is not None:
                self.on_evict(page)
        else:
            raise CacheFullError(f"PagedKVCache: all {self.num_pages} pages are in use")
        self.refs[page] = 1
        return page

    def _append(self, slot: int, page: int) -> None:
        pages = self._pages[slot]
        self.page_table[slot, len(pages)] = page
        pages.append(page)

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
        if sum(new_pages) > self.free_pages:
            raise CacheFullError(f"PagedKVCache: step needs {sum(new_pages)} pages, "
                                 f"{self.free_pages} free of {self.num_pages}")
        positions, q_seq, rows = [], [], []
        for s, n, extra in zip(slots, counts, new_pages):
            for _ in range(extra):
                self._append(s, self._take_page())
            pages, start = self._pages[s], self.lengths[s]
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
