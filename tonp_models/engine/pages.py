"""`PageAllocator`: which KV-cache pages each sequence holds. The scheduler's half of the paged
cache; the pages themselves (tonp_models.layers.PagedKVCache) are storage the attention layers
write and read at the rows a forward's `CacheStep` names.

    pages = PageAllocator(model.new_cache(max_seqs, max_seq_len))
    slot = pages.add_sequence()
    step = pages.prepare([slot], [len(ids)])      # pages for the new tokens, before the forward
    logits = model(ids, kv=step)
    pages.commit(step)                            # the slot's length advances
    logits = extend(model, pages, ids, [slot])    # the three lines above (outside an engine)

Pages are reference-counted so that sequences can share them (prefix caching): `attach` gives a
new sequence full pages another one computed (read only: a sequence only ever writes positions
past its length, which lie in its own pages), `fork` copies a page's first rows into a private
page (the copy is exact, so the rows keep their bits). A page its owner marked `retain`ed is not
freed when its last sequence releases it but parked in a least-recently-used list, counted as
free, and reclaimed (evicted, `on_evict(page)` called) only when a free page is needed.
"""
from __future__ import annotations

import operator
from collections import OrderedDict
from typing import Callable, List, Optional, Sequence

import torch

from ..layers import CacheFullError, CacheStep, PagedKVCache


class PageAllocator:
    """Sequence slots, their page tables and the pages' reference counts over one cache.

    Args:
        kv: the PagedKVCache (its max_seqs slots and max_seq_len positions a slot).
    The page table and the bookkeeping stay on the host; `prepare` copies a step's metadata
    to the cache's device.
    """

    def __init__(self, kv: PagedKVCache):
        self.kv, self.page_size, self.num_pages = kv, kv.page_size, kv.num_pages
        self.max_seq_len = kv.max_seq_len
        self.max_pages_per_seq = -(-kv.max_seq_len // kv.page_size)
        self.page_table = torch.zeros((kv.max_seqs, self.max_pages_per_seq), dtype=torch.int32)
        self.lengths = [0] * kv.max_seqs
        self.refs = [0] * kv.num_pages                # sequences holding each page
        self.on_evict: Optional[Callable[[int], None]] = None
        self._pages: List[List[int]] = [[] for _ in range(kv.max_seqs)]
        self._free_pages = list(range(kv.num_pages - 1, -1, -1))
        self._free_slots = list(range(kv.max_seqs - 1, -1, -1))
        self._retained: set = set()
        self._lru: "OrderedDict[int, None]" = OrderedDict()   # retained pages nobody holds

    # -- sequence slots ----------------------------------------------------------------------
    def add_sequence(self) -> int:
        """Claim a free slot (length 0) and return it."""
        if not self._free_slots:
            raise CacheFullError(f"PageAllocator: all {len(self.lengths)} sequence slots are "
                                 f"in use")
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
            raise ValueError(f"PageAllocator.attach: slot {slot} is not empty")
        for page in pages:
            self._ref(page)
            self._append(slot, page)
        self.lengths[slot] = len(pages) * self.page_size

    def fork(self, slot: int, src: int, rows: int) -> int:
        """Copy the first `rows` positions of page `src` into a new private page of `slot`
        (whose length must be a whole number of pages); returns the new page."""
        B = self.page_size
        if not 0 < rows < B or self.lengths[slot] != len(self._pages[slot]) * B:
            raise ValueError(f"PageAllocator.fork: rows={rows} must be in (0, {B}) and slot "
                             f"{slot} page-aligned")
        self._ref(src)                              # src may be evictable: keep it meanwhile
        try:
            page = self._take_page()
        finally:
            self._unref(src)
        self.kv.copy_rows(src, page, rows)
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
            raise CacheFullError(f"PageAllocator: all {self.num_pages} pages are in use")
        self.refs[page] = 1
        return page

    def _append(self, slot: int, page: int) -> None:
        pages = self._pages[slot]
        self.page_table[slot, len(pages)] = page
        pages.append(page)

    # -- one forward ---------------------------------------------------------------------------
    def prepare(self, slots: Sequence[int], counts: Sequence[int]) -> CacheStep:
        """Allocate pages for `counts[i]` new tokens of sequence `slots[i]` and describe the
        step. All or nothing: a step beyond a slot's max_seq_len positions (its page-table
        row) or the free pages raises CacheFullError before any page is taken."""
        try:
            slots, counts = [operator.index(s) for s in slots], [operator.index(n) for n in counts]
        except TypeError:
            raise TypeError(f"PageAllocator.prepare: slots and counts must be integers, got "
                            f"{list(slots)[:8]}, {list(counts)[:8]}") from None
        n_slots = len(self.lengths)
        if len(slots) != len(counts) or len(set(slots)) != len(slots) or \
                any(not 0 <= s < n_slots for s in slots):
            raise ValueError(f"PageAllocator.prepare: slots {slots[:8]} must be distinct slots "
                             f"in [0, {n_slots}), one count each")
        for s, n in zip(slots, counts):
            if self.lengths[s] + n > self.max_seq_len:
                raise CacheFullError(f"PageAllocator: sequence slot {s} would reach "
                                     f"{self.lengths[s] + n} positions > max_seq_len "
                                     f"{self.max_seq_len}")
        new_pages = [self.pages_needed(s, n) for s, n in zip(slots, counts)]
        if sum(new_pages) > self.free_pages:
            raise CacheFullError(f"PageAllocator: step needs {sum(new_pages)} pages, "
                                 f"{self.free_pages} free of {self.num_pages}")
        B = self.page_size
        positions, q_seq, rows = [], [], []
        for s, n, extra in zip(slots, counts, new_pages):
            for _ in range(extra):
                self._append(s, self._take_page())
            pages, start = self._pages[s], self.lengths[s]
            positions.extend(range(start, start + n))
            q_seq.extend([s] * n)
            rows.extend(pages[p // B] * B + p % B for p in range(start, start + n))
        dev = self.kv.device
        return CacheStep(self.kv, slots, counts,
                         torch.tensor(positions, dtype=torch.int64, device=dev),
                         torch.tensor(q_seq, dtype=torch.int32, device=dev),
                         torch.tensor(rows, dtype=torch.int64, device=dev),
                         self.page_table.to(dev, copy=dev.type != "cpu"))

    def commit(self, step: CacheStep) -> None:
        """Advance the lengths once the forward has written every layer of the step."""
        for s, n in zip(step.slots, step.counts):
            self.lengths[s] += n


def extend(model, pages: PageAllocator, ids: torch.Tensor, slots: Sequence[int],
           cu_seqlens: Optional[torch.Tensor] = None, **forward_kw) -> torch.Tensor:
    """One forward that extends sequences `slots` by the packed `ids` (cu_seqlens as the
    model's; None = one sequence): prepare the pages, run `model(ids, cu, kv=step, ...)`,
    commit. A decode step outside an engine (tests, diagnose, benchmarks)."""
    T = len(ids)
    bounds = [0, T] if cu_seqlens is None else [int(b) for b in cu_seqlens]
    step = pages.prepare(slots, [b - a for a, b in zip(bounds, bounds[1:])])
    out = model(ids, cu_seqlens, kv=step, **forward_kw)
    pages.commit(step)
    return out


__all__ = ["PageAllocator", "extend"]
