"""Prefix caching: K/V pages a request computed serve later requests with the same prefix.

A page is an attention block (B positions aligned to position 0), so the K/V rows of positions
0..t depend only on tokens 0..t, and a query visits the same blocks whether they were computed
for it or for another request: a cache hit changes no bit of any logit.

Pages are keyed by their content and position chain: key(page i) = blake2b(key(page i-1), the
page's B token ids), key(-1) = b"". A request takes the longest chain of whole pages (shared by
reference, read only) and then, at the first page that differs or is not complete, the indexed
page (full or partial) with the longest common prefix of tokens, whose rows it copies into a
private page (`PageAllocator.fork`). At most len(prompt) - 1 positions come from the cache: the
last prompt token is always fed, to get the logits of the first new token.

Every page a request writes is indexed as soon as its rows are committed (prompt and generated
tokens alike, so a preempted request or the next turn of a chat finds them), and retained in the
cache when its requests release it; retained pages nobody holds are evicted least recently used
first. `clear()` forgets everything (after a weight update the K/V are stale).
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .pages import PageAllocator

ROOT = b""


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full page: a 128-bit hash of its parent's key and its token ids."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class Match:
    """The cached part of a context: `pages` (whole pages, with their `keys`) shared by
    reference, then optionally `fork` = (page, rows) to copy; `length` positions in all."""
    pages: List[int] = field(default_factory=list)
    keys: List[bytes] = field(default_factory=list)
    fork: Optional[Tuple[int, int]] = None
    length: int = 0


@dataclass
class _Entry:
    parent: bytes
    tokens: List[int]       # the token ids whose K/V the page's first rows hold
    key: Optional[bytes] = None   # set when the page is full and the one indexed under it


class PrefixCache:
    """The index of the cache's computed pages (see the module doc). Owns the cache's
    `on_evict` hook."""

    def __init__(self, cache: PageAllocator):
        self.cache, self.B = cache, cache.page_size
        self._full: Dict[bytes, int] = {}                       # key -> page
        self._entries: Dict[int, _Entry] = {}                   # page -> entry
        self._children: Dict[Tuple[bytes, int], Dict[int, None]] = {}  # (parent, 1st token)
        cache.on_evict = self._forget

    @property
    def num_pages(self) -> int:
        """Pages indexed (held by requests or parked in the cache's LRU list)."""
        return len(self._entries)

    def match(self, tokens: Sequence[int], limit: int) -> Match:
        """The longest cached prefix of `tokens`, at most `limit` positions."""
        B, m, parent = self.B, Match(), ROOT
        while m.length + B <= limit:
            chunk = tokens[m.length:m.length + B]
            key = page_key(parent, chunk)
            page = self._full.get(key)
            if page is None or self._entries[page].tokens != chunk:
                break
            m.pages.append(page)
            m.keys.append(key)
            parent, m.length = key, m.length + B
        if m.length < limit:
            want = tokens[m.length:min(m.length + B, limit)]
            best, rows = None, 0
            for page in self._children.get((parent, want[0]), ()):
                n = common_prefix(self._entries[page].tokens, want)
                if n > rows:
                    best, rows = page, n
            if best is not None:
                m.fork, m.length = (best, rows), m.length + rows
        return m

    def note(self, slot: int, tokens: Sequence[int], keys: List[bytes], start: int,
             end: int) -> None:
        """Index the pages of `slot` holding positions [start, end) just committed. tokens: the
        sequence's tokens; keys: its full pages' keys so far (extended here)."""
        B = self.B
        pages = self.cache.pages(slot)
        for i in range(start // B, (end - 1) // B + 1):
            rows = list(tokens[i * B:min(end, (i + 1) * B)])
            parent = keys[i - 1] if i else ROOT
            key = self._note(pages[i], parent, rows)
            if key is not None and len(keys) == i:
                keys.append(key)

    def _note(self, page: int, parent: bytes, rows: List[int]) -> Optional[bytes]:
        e = self._entries.get(page)
        if e is None:
            e = self._entries[page] = _Entry(parent, rows)
            self._children.setdefault((parent, rows[0]), {})[page] = None
            self.cache.retain(page)
        else:
            e.tokens = rows
        if len(rows) < self.B:
            return None
        key = page_key(parent, rows)
        other = self._full.setdefault(key, page)
        if other == page:
            e.key = key
        else:  # the same content computed twice: keep the indexed page, let this one go
            self._forget(page)
            self.cache.unretain(page)
        return key

    def _forget(self, page: int) -> None:
        """Drop a page from the index (the cache evicted it, or it duplicates another)."""
        e = self._entries.pop(page)
        kids = self._children[(e.parent, e.tokens[0])]
        del kids[page]
        if not kids:
            del self._children[(e.parent, e.tokens[0])]
        if e.key is not None:
            del self._full[e.key]

    def clear(self) -> None:
        """Forget every page (their K/V no longer match the weights); pages nobody holds are
        freed, the others when their requests release them."""
        pages = list(self._entries)
        self._full.clear()
        self._entries.clear()
        self._children.clear()
        for page in pages:
            self.cache.unretain(page)
