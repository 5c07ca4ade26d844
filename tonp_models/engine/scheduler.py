"""Which requests a step feeds, and how many tokens each: continuous batching over a paged KV
cache with prefix caching and chunked prefill.

Each step: (1) while the running requests' pending tokens need more pages than are free, the
most recently admitted one is preempted (LIFO: its pages released, its whole context fed again
when it rejoins); (2) every running request with one token to feed gets it (decode), then those
still prefilling get chunks of their context in admission order while the step's token budget
lasts; (3) waiting requests join in order (FIFO) while slots, pages for their whole context and
budget allow, starting from the longest prefix the prefix cache holds. A waiting request whose
prompt shares more with a running request's prompt still being prefilled than the cache holds
waits a step for it (so G samples of one prompt prefill it once). The order and split of the
feeds never change a bit of a request's output (docs/generation.md).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..layers import CacheStep
from .pages import PageAllocator
from .prefix_cache import Match, PrefixCache, common_prefix
from .request import Request


@dataclass
class ScheduledBatch:
    """The scheduler's output, the model's input: what one forward feeds and where its K/V go.

    feeds: (request, tokens fed) pairs in feed order; ids int64 [T] their tokens (host);
    cu_seqlens int32 [S+1]; kv: the CacheStep of the pages allocated for them; logits_rows
    int64 [S'] the last row of each request whose context the step completes (`sampled`)."""
    feeds: List[Tuple[Request, int]]
    ids: torch.Tensor
    cu_seqlens: torch.Tensor
    kv: CacheStep
    logits_rows: torch.Tensor
    sampled: List[Request]


class Scheduler:
    """Waiting and running requests over one cache: it decides each step's feeds, allocates
    their pages (`schedule`) and advances the requests once the forward ran (`commit`).

    Args:
        cache: the PageAllocator (max_batch_size slots at least).
        prefix: a PrefixCache over it, or None (no sharing).
        max_batch_size: requests running at once at most.
        max_step_tokens: tokens one step feeds at most (chunked prefill), None = no limit;
            at least max_batch_size, so every running request can decode each step.
    """

    def __init__(self, cache: PageAllocator, prefix: Optional[PrefixCache], max_batch_size: int,
                 max_step_tokens: Optional[int] = None):
        self.cache, self.prefix = cache, prefix
        self.max_batch_size, self.max_step_tokens = max_batch_size, max_step_tokens
        self.waiting: List[Request] = []
        self.running: List[Request] = []
        self.preemptions = 0
        self.cached_tokens = 0          # context tokens matched in the prefix cache on admission
        self.admit_started_only = False  # only preempted requests rejoin (a weight update drains)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def started_requests(self) -> bool:
        """Are requests running, or waiting with tokens generated already (preempted)?"""
        return bool(self.running) or any(r.num_new for r in self.waiting)

    def _need(self) -> int:
        return sum(self.cache.pages_needed(r.slot, len(r.pending)) for r in self.running)

    def schedule(self) -> Optional[ScheduledBatch]:
        """The next forward's batch, its pages allocated (None: nothing to feed)."""
        feeds = self._feeds()
        if not feeds:
            return None
        ids = torch.tensor([t for r, n in feeds for t in r.tokens[r.cached:r.cached + n]],
                           dtype=torch.int64)
        ends = list(itertools.accumulate(n for _, n in feeds))
        done = [i for i, (r, n) in enumerate(feeds) if r.cached + n == len(r.tokens)]
        kv = self.cache.prepare([r.slot for r, _ in feeds], [n for _, n in feeds])
        return ScheduledBatch(feeds, ids, torch.tensor([0] + ends, dtype=torch.int32), kv,
                              torch.tensor([ends[i] - 1 for i in done], dtype=torch.int64),
                              [feeds[i][0] for i in done])

    def commit(self, batch: ScheduledBatch) -> None:
        """After the forward: the fed tokens are in the cache (and the prefix index)."""
        self.cache.commit(batch.kv)
        for r, n in batch.feeds:
            if self.prefix is not None:
                self.prefix.note(r.slot, r.tokens, r.page_keys, r.cached, r.cached + n)
            r.cached += n

    def _feeds(self) -> List[Tuple[Request, int]]:
        """The next forward's (request, tokens to feed) pairs, with pages for them (and for the
        running requests' whole pending contexts) guaranteed."""
        cache = self.cache
        while self._need() > cache.free_pages and self.running:
            self._preempt(self.running[-1])
        budget = self.max_step_tokens or float("inf")
        feeds = [(r, 1) for r in self.running if len(r.pending) == 1]
        budget -= len(feeds)
        for r in self.running:
            if len(r.pending) > 1 and budget > 0:
                n = int(min(len(r.pending), budget))
                feeds.append((r, n))
                budget -= n
        need = self._need()
        i = 0
        while i < len(self.waiting) and len(self.running) < self.max_batch_size and budget > 0:
            r = self.waiting[i]
            if self.admit_started_only and not r.num_new:
                i += 1
                continue
            m = self.prefix.match(r.tokens, len(r.tokens) - 1) \
                if self.prefix is not None else Match()
            if self._in_flight(r, m.length):
                i += 1                                 # its prefix is being computed: wait
                continue
            pages, held = self._pages_for(r, m)
            if m.length and need + pages + len(held) > cache.free_pages:
                m = Match()      # the hit does not fit beside the pages it pins: recompute
                pages, held = self._pages_for(r, m)
            if need + pages + len(held) > cache.free_pages:
                break                                  # FIFO: later requests do not jump it
            self.waiting.pop(i)
            self._admit(r, m)
            need += cache.pages_needed(r.slot, len(r.pending))
            n = int(min(len(r.pending), budget))
            feeds.append((r, n))
            budget -= n
        return feeds

    def _pages_for(self, r: Request, m: Match):
        """(new pages r needs with match m, the evictable pages m would pin)."""
        cache = self.cache
        held = [p for p in m.pages + ([m.fork[0]] if m.fork else []) if not cache.is_held(p)]
        return -(-len(r.tokens) // cache.page_size) - len(m.pages), held

    def _admit(self, r: Request, m: Match) -> None:
        cache = self.cache
        r.slot = cache.add_sequence()
        cache.attach(r.slot, m.pages)
        if m.fork:
            cache.fork(r.slot, *m.fork)
        r.cached, r.page_keys, r.prefilling, r.cache_hit = m.length, list(m.keys), True, m.length
        self.cached_tokens += m.length
        self.running.append(r)

    def _in_flight(self, r: Request, matched: int) -> bool:
        """Does a running request still prefilling a prompt share more of r's context (less
        its last token) than the cache holds now?"""
        if self.prefix is None:
            return False
        limit = len(r.tokens) - 1
        for x in self.running:
            if x.cached < x.prompt_len and \
                    common_prefix(x.tokens[:min(x.prompt_len, limit)], r.tokens) > matched:
                return True
        return False

    def _preempt(self, r: Request) -> None:
        self.running.remove(r)
        self.cache.release(r.slot)
        r.slot, r.cached, r.page_keys = None, 0, []
        self.waiting.insert(0, r)
        self.preemptions += 1

    def finish(self, r: Request, reason: str) -> None:
        """End a request (running or waiting): its slot and pages are released."""
        r.finish = reason
        if r in self.running:
            self.running.remove(r)
            self.cache.release(r.slot)
            r.slot = None
        elif r in self.waiting:
            self.waiting.remove(r)
