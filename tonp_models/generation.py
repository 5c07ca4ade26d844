"""The rollout engine: batched decoding of ragged prompts with a paged KV cache.

    out = generate(model, prompts, max_new_tokens=64, temperature=1.0, top_p=0.95, seed=7,
                   max_batch_size=8, eos_token_id=model.config.eos_token_id)
    lps = model.token_logprobs(out.sequences, temperature=1.0)    # training forward
    assert all(torch.equal(a[p - 1:], b) for a, b, p in zip(lps, out.logprobs, out.prompt_lengths))

How it works. A scheduler keeps at most `max_batch_size` requests running, each in a slot of a
`PagedKVCache` (page = the model's attention block). Every step is ONE forward over a ragged packed
batch: a request that just joined feeds its whole context (prefill), a running one its last token
(decode); both extend their cache slot. Only each sequence's last row goes through the final norm
and LM head (`logits_rows`). Finished requests (eos / stop token / max_new_tokens) leave and free
their pages between steps; waiting prompts join in order while slots and pages allow.

Why a request's output never depends on its batch: with tonp's invariant kernels a row's logits
depend only on that row's own sequence (CONTRACT.md), greedy picks the lowest index among ties
(`tonp_kernels.argmax`), and sampling noise is a hash of (seed, request id, position, token)
(`tonp_kernels.sample`). So the batch size, the companions, their order, prefill vs decode and even
a preemption (which recomputes the context) leave every token and logprob bit-for-bit unchanged,
and `model.token_logprobs(out.sequences, temperature=T)` reproduces `out.logprobs` exactly.

Cache capacity. By default the cache holds the `max_batch_size` largest requests at their full
length, so nothing ever waits for pages. With a smaller `num_pages`, pages are allocated as
sequences grow; a waiting prompt joins only when its context fits, and when running requests
outgrow the free pages the most recently admitted one is preempted (its pages freed, its context,
prompt + tokens so far, recomputed when it rejoins). A request that cannot fit even alone raises
CacheFullError before any work is done.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence, Union

import torch

import tonp_kernels as tk

from .layers import CacheFullError, PagedKVCache

TokenIds = Union[torch.Tensor, Sequence[int]]


@dataclass
class GenerationStats:
    """Work and time of one `generate` call (tokens counted over all forwards)."""
    prompt_tokens: int = 0        # prompt tokens of the requests
    prefill_tokens: int = 0       # context tokens fed in prefill (> prompt_tokens after preemption)
    decode_tokens: int = 0        # tokens fed in decode steps
    new_tokens: int = 0           # generated tokens
    forward_steps: int = 0        # model forwards (each a mixed prefill + decode batch)
    preemptions: int = 0          # requests evicted for lack of pages (then recomputed)
    seconds: float = 0.0          # wall time of the whole call

    @property
    def tokens_per_s(self) -> float:
        """Tokens through the model per second (prefill + decode)."""
        return (self.prefill_tokens + self.decode_tokens) / max(self.seconds, 1e-9)

    @property
    def new_tokens_per_s(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)


@dataclass
class GenerationOutput:
    """The rollouts, in the order of the prompts.

    sequences: int64 [prompt_len + n_new] per request (prompt then completion, eos included).
    logprobs: fp32 [n_new] per request: the chosen token's log_softmax(logits / T) (T = 1 for
        greedy), the untruncated tempered distribution even when top-k / top-p restricted the draw.
    prompt_lengths, finish_reasons ("eos" | "stop" | "length") per request; stats for the call.
    """
    sequences: List[torch.Tensor]
    logprobs: List[torch.Tensor]
    prompt_lengths: List[int]
    finish_reasons: List[str]
    stats: GenerationStats = field(default_factory=GenerationStats)

    @property
    def completions(self) -> List[torch.Tensor]:
        return [s[p:] for s, p in zip(self.sequences, self.prompt_lengths)]

    @property
    def num_new_tokens(self) -> List[int]:
        return [len(lp) for lp in self.logprobs]


@dataclass
class _Request:
    index: int                    # position in the prompts list (output order)
    request_id: int               # the key of its sampling noise
    tokens: List[int]             # prompt + generated so far
    prompt_len: int
    logprobs: List[float] = field(default_factory=list)   # fp32 values (exact as floats)
    slot: Optional[int] = None    # cache slot while running
    cached: int = 0               # tokens whose K/V are in the cache
    finish: Optional[str] = None

    @property
    def pending(self) -> List[int]:
        """Tokens to feed next: the whole context after (re)admission, else the last token."""
        return self.tokens[self.cached:]


class _Scheduler:
    """Continuous batching over a PagedKVCache: FIFO admission, LIFO preemption."""

    def __init__(self, cache: PagedKVCache, requests: List[_Request], max_batch_size: int):
        self.cache, self.max_batch_size = cache, max_batch_size
        self.waiting: List[_Request] = list(requests)
        self.running: List[_Request] = []
        self.preemptions = 0

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def _need(self, reqs: Iterable[_Request]) -> int:
        return sum(self.cache.pages_needed(r.slot, len(r.pending)) for r in reqs)

    def next_batch(self) -> List[_Request]:
        """The requests of the next forward, with pages for their pending tokens guaranteed."""
        cache = self.cache
        need = self._need(self.running)
        while need > cache.free_pages and self.running:
            victim = self.running.pop()          # the most recently admitted gives way
            cache.release(victim.slot)
            victim.slot, victim.cached = None, 0
            self.waiting.insert(0, victim)
            self.preemptions += 1
            need = self._need(self.running)
        B = cache.page_size
        while self.waiting and len(self.running) < self.max_batch_size:
            r = self.waiting[0]
            pages = -(-len(r.tokens) // B)
            if need + pages > cache.free_pages:
                break                            # FIFO: later prompts do not jump the queue
            self.waiting.pop(0)
            r.slot = cache.add_sequence()
            self.running.append(r)
            need += pages
        if not self.running:  # cannot happen: generate() checked each request fits alone
            raise CacheFullError(f"generate: request {self.waiting[0].index} does not fit in "
                                 f"{cache.num_pages} free pages")
        return list(self.running)

    def finish(self, r: _Request, reason: str) -> None:
        r.finish = reason
        self.running.remove(r)
        self.cache.release(r.slot)
        r.slot = None


@dataclass
class _Sampling:
    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    seed: int


def _pick(logits: torch.Tensor, rows: List[_Request], s: _Sampling):
    """Next token and its logprob for each row. logits fp32 [S, V] -> (int64 [S], fp32 [S])."""
    if s.temperature == 0:
        chosen = tk.argmax(logits)
    else:
        ids = torch.tensor([r.request_id for r in rows], dtype=torch.int64)
        pos = torch.tensor([len(r.tokens) for r in rows], dtype=torch.int64)  # the new token's
        chosen = tk.sample(logits, temperature=s.temperature, seed=s.seed, request_ids=ids,
                           positions=pos, top_k=s.top_k, top_p=s.top_p)
    lps = tk.token_logprobs(logits, chosen, temperature=s.temperature or 1.0)
    return chosen, lps


def _as_ids(name: str, x: TokenIds) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dim() != 1 or (t.numel() and (t.is_floating_point() or t.is_complex()
                                       or t.dtype == torch.bool)):
        raise TypeError(f"generate: {name} must be a 1-D sequence of integer token ids, got "
                        f"{tuple(t.shape)} {t.dtype}")
    return t.long()


def _token_set(name: str, ids, vocab: int) -> set:
    if ids is None:
        return set()
    ids = [ids] if isinstance(ids, int) else list(ids)
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < vocab]
    if bad:
        raise ValueError(f"generate: {name} {bad} are not token ids in [0, {vocab})")
    return set(ids)


def _make_requests(model, prompts, max_new_tokens: int, request_ids) -> List[_Request]:
    if isinstance(prompts, torch.Tensor) and prompts.dim() == 1:
        raise TypeError("generate: prompts must be a list of 1-D token-id sequences (got one "
                        "1-D tensor: wrap it in a list)")
    c = model.config
    V, limit = c.vocab_size, c.max_position_embeddings
    if request_ids is None:
        request_ids = range(len(prompts))
    request_ids = [int(i) for i in request_ids]
    if len(request_ids) != len(prompts) or any(i < 0 for i in request_ids):
        raise ValueError(f"generate: request_ids must be {len(prompts)} non-negative ints")
    reqs = []
    for i, p in enumerate(prompts):
        t = _as_ids(f"prompt {i}", p)
        if t.numel() == 0:
            raise ValueError(f"generate: prompt {i} is empty (a prompt needs at least one token)")
        if int(t.min()) < 0 or int(t.max()) >= V:
            bad = t[(t < 0) | (t >= V)].unique()[:8].tolist()
            raise IndexError(f"generate: prompt {i} holds token ids {bad} outside the vocabulary "
                             f"[0, {V})")
        if len(t) >= limit:
            raise ValueError(f"generate: prompt {i} has {len(t)} tokens; the model's position "
                             f"limit max_position_embeddings={limit} leaves no room to generate")
        if len(t) + max_new_tokens > limit:
            raise ValueError(f"generate: prompt {i} ({len(t)} tokens) + max_new_tokens="
                             f"{max_new_tokens} exceeds max_position_embeddings={limit}")
        reqs.append(_Request(i, request_ids[i], t.tolist(), len(t)))
    return reqs


def _new_cache(model, reqs: List[_Request], max_new_tokens: int, max_batch_size: int,
               num_pages: Optional[int]) -> PagedKVCache:
    """A cache for these requests: slots for the running batch; pages for its largest members at
    full length unless num_pages says fewer. The last new token is never fed, so a request writes
    prompt_len + max_new_tokens - 1 positions."""
    B = model.config.attention_block
    positions = [r.prompt_len + max_new_tokens - 1 for r in reqs]
    pages = sorted((-(-n // B) for n in positions), reverse=True)
    if num_pages is None:
        num_pages = sum(pages[:max_batch_size])
    elif num_pages < pages[0]:
        i = max(range(len(reqs)), key=lambda j: positions[j])
        raise CacheFullError(f"generate: request {i} needs {pages[0]} KV-cache pages of {B} "
                             f"positions ({positions[i]} positions) but the cache holds "
                             f"num_pages={num_pages}; it cannot run even alone")
    return model.new_cache(max_batch_size, max(positions), num_pages=num_pages)


# no_grad, not inference_mode: the returned sequences feed the (grad-enabled) training forward.
@torch.no_grad()
def generate(model, prompts: Sequence[TokenIds], max_new_tokens: int,
             eos_token_id: Union[int, Sequence[int], None] = None, temperature: float = 0.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None, seed: int = 0,
             max_batch_size: Optional[int] = None,
             stop_token_ids: Optional[Sequence[int]] = None, progress: bool = False, *,
             request_ids: Optional[Sequence[int]] = None,
             num_pages: Optional[int] = None) -> GenerationOutput:
    """Roll out every prompt with `model` (a Qwen3MoeForCausalLM or anything with its forward,
    `new_cache` and `config`), continuous batching over a paged KV cache.

    Args:
        prompts: 1-D int token-id sequences (tensors or lists), ragged, each non-empty.
        max_new_tokens: tokens to generate per request at most (>= 0).
        eos_token_id, stop_token_ids: an int or ints; generating one ends the request (the token
            is kept, with its logprob). None = no eos (the model config's is not implied).
        temperature: 0 = greedy (argmax, lowest index on ties); > 0 samples from
            softmax(logits / temperature) restricted by top_k / top_p (ignored when greedy).
        seed, request_ids: the sampling noise of request i at position t is a hash of
            (seed, request_ids[i], t, token); request_ids default to 0..n-1 (prompt order), so pass
            them to keep a request's draws when the prompt list is reordered or split.
        max_batch_size: requests decoded together at most (None = all).
        num_pages: KV-cache pages (None = enough for the largest max_batch_size requests; fewer
            makes requests wait or be preempted and recomputed, see the module docstring).
        progress: show a tqdm bar over finished requests.
    Returns: GenerationOutput (sequences, fp32 logprobs, prompt lengths, finish reasons, stats).
    Raises: TypeError / ValueError / IndexError on bad prompts or settings (empty prompt, token id
        out of range, prompt + max_new_tokens beyond max_position_embeddings); CacheFullError when
        num_pages cannot hold a request alone.
    """
    start = time.perf_counter()
    V = model.config.vocab_size
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if temperature < 0 or (top_k is not None and top_k < 1) or \
            (top_p is not None and not 0.0 < top_p <= 1.0):
        raise ValueError(f"generate: need temperature >= 0, top_k >= 1, 0 < top_p <= 1; got "
                         f"temperature={temperature} top_k={top_k} top_p={top_p}")
    if max_batch_size is not None and max_batch_size < 1:
        raise ValueError(f"generate: max_batch_size must be >= 1, got {max_batch_size}")
    if num_pages is not None and num_pages < 1:
        raise ValueError(f"generate: num_pages must be >= 1, got {num_pages}")
    eos = _token_set("eos_token_id", eos_token_id, V)
    stop = _token_set("stop_token_ids", stop_token_ids, V)
    sampling = _Sampling(float(temperature), top_k, top_p, int(seed))
    reqs = _make_requests(model, prompts, max_new_tokens, request_ids)
    stats = GenerationStats(prompt_tokens=sum(r.prompt_len for r in reqs))
    if reqs and max_new_tokens > 0:
        batch = min(max_batch_size or len(reqs), len(reqs))
        cache = _new_cache(model, reqs, max_new_tokens, batch, num_pages)
        _run(model, _Scheduler(cache, reqs, batch), max_new_tokens, eos, stop, sampling, stats,
             progress)
    stats.seconds = time.perf_counter() - start
    return GenerationOutput(
        sequences=[torch.tensor(r.tokens, dtype=torch.int64) for r in reqs],
        logprobs=[torch.tensor(r.logprobs, dtype=torch.float32) for r in reqs],
        prompt_lengths=[r.prompt_len for r in reqs],
        finish_reasons=[r.finish or "length" for r in reqs], stats=stats)


def _run(model, sched: _Scheduler, max_new_tokens: int, eos: set, stop: set, sampling: _Sampling,
         stats: GenerationStats, progress: bool) -> None:
    """The decode loop: one mixed prefill/decode forward per step until every request ends."""
    from tqdm.auto import tqdm

    bar = tqdm(total=len(sched.waiting), unit="req", desc="rollout", disable=not progress)
    cache = sched.cache
    while not sched.done:
        rows = sched.next_batch()
        feeds = [r.pending for r in rows]
        counts = [len(f) for f in feeds]
        stats.prefill_tokens += sum(n for r, n in zip(rows, counts) if r.cached == 0)
        stats.decode_tokens += sum(n for r, n in zip(rows, counts) if r.cached > 0)
        ids = torch.tensor([t for f in feeds for t in f], dtype=torch.int64)
        ends = list(itertools.accumulate(counts))
        cu = torch.tensor([0] + ends, dtype=torch.int32)
        last = torch.tensor([e - 1 for e in ends], dtype=torch.int64)  # each sequence's last row
        logits = model(ids, cu, cache=cache, cache_slots=[r.slot for r in rows],
                       logits_rows=last)                                          # (S, V) fp32
        stats.forward_steps += 1
        chosen, lps = _pick(logits, rows, sampling)
        for r, tok, lp in zip(rows, chosen.tolist(), lps.tolist()):  # fp32 -> float: exact
            r.cached = len(r.tokens)
            r.tokens.append(tok)
            r.logprobs.append(lp)
            stats.new_tokens += 1
            reason = "eos" if tok in eos else "stop" if tok in stop else \
                "length" if len(r.logprobs) >= max_new_tokens else None
            if reason:
                sched.finish(r, reason)
                bar.update(1)
        bar.set_postfix(tok_s=f"{stats.new_tokens / max(bar.format_dict['elapsed'], 1e-9):.0f}",
                        refresh=False)
    stats.preemptions = sched.preemptions
    bar.close()


__all__ = ["generate", "GenerationOutput", "GenerationStats"]
