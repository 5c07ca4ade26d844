"""The rollout engine: `generate` decodes ragged prompts with continuous batching over a paged KV
cache, and every logprob it reports is, bit for bit, the one the training forward gives.

    out = generate(model, prompts, max_new_tokens=64, temperature=1.0, top_p=0.95, seed=7,
                   max_batch_size=8, eos_token_id=model.config.eos_token_id)
    lps = model.token_logprobs(out.sequences, temperature=1.0)    # training forward
    assert all(torch.equal(a[p - 1:], b) for a, b, p in zip(lps, out.logprobs, out.prompt_lengths))

A request's tokens and logprobs do not depend on its batch (size, companions, order, cache size,
preemption). Arguments are checked before any forward; the ranks of a tensor-parallel group must
make the same call (checked: a mismatch raises on every rank); non-finite logits raise. The
scheduler, the cache, preemption and why the batch does not matter: docs/generation.md.
"""
from __future__ import annotations

import collections.abc
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence, Union

import torch

import tonp_kernels as tk

from .checks import (TPCheck, as_int, as_real, check_temperature, digest, sequence_list, show,
                     token_ids)
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


def _token_set(name: str, ids, vocab: int) -> set:
    """eos / stop ids: None, one token id, or a list / tuple / set / 1-D tensor or array of them
    (ints, numpy integers, 0-d integer tensors)."""
    if ids is None:
        return set()
    many = isinstance(ids, (list, tuple, set, frozenset, range)) or getattr(ids, "ndim", 0) == 1
    return {as_int("generate", f"{name}[{j}]" if many else name, v, 0, vocab)
            for j, v in enumerate(ids if many else [ids])}


def _request_ids(request_ids, n: int) -> List[int]:
    """The noise keys of the n requests: distinct ints in [0, 2**63); default 0..n-1."""
    if request_ids is None:
        return list(range(n))
    if isinstance(request_ids, (str, bytes)) or getattr(request_ids, "ndim", 1) != 1 or \
            not isinstance(request_ids, collections.abc.Iterable):
        raise TypeError(f"generate: request_ids must be a sequence of ints, got "
                        f"{show(request_ids)}")
    ids = [as_int("generate", f"request_ids[{j}]", v, 0, 2**63)
           for j, v in enumerate(request_ids)]
    if len(ids) != n:
        raise ValueError(f"generate: request_ids must be {n} ints (one per prompt), got "
                         f"{len(ids)}")
    dup = sorted(i for i, c in collections.Counter(ids).items() if c > 1)
    if dup:
        raise ValueError(f"generate: request_ids must be distinct (they key each request's "
                         f"sampling noise); {dup[:8]} occur more than once")
    return ids


def _check_logits(logits: torch.Tensor, rows: List[_Request]) -> None:
    """Raise naming the first non-finite logit: one reduction a step (NaN reaches min and max)."""
    lo, hi = torch.aminmax(logits)
    if math.isfinite(lo) and math.isfinite(hi):
        return
    bad = ~torch.isfinite(logits)
    s, v = bad.nonzero()[0].tolist()
    r = rows[s]
    raise RuntimeError(f"generate: the model's logits are not finite (NaN or inf weights, or an "
                       f"overflow in the forward): request {r.index}, position "
                       f"{len(r.tokens) - 1}, vocab id {v} is {float(logits[s, v])} "
                       f"({int(bad.sum())} non-finite logits in this step)")


def _check_logprobs(lps: List[float], logits: torch.Tensor, rows: List[_Request],
                    temperature: float) -> None:
    """Finite logits give finite logprobs unless logits / temperature overflow fp32."""
    if all(map(math.isfinite, lps)):
        return
    s = next(i for i, lp in enumerate(lps) if not math.isfinite(lp))
    r = rows[s]
    raise ValueError(f"generate: request {r.index}'s token at position {len(r.tokens)} has "
                     f"logprob {lps[s]} with temperature={temperature!r}: its logits "
                     f"(largest |logit| {float(logits[s].abs().max()):.4g}) divided by the "
                     f"temperature overflow fp32; use a larger temperature (or 0 for greedy)")


def _pick(logits: torch.Tensor, rows: List[_Request], s: _Sampling):
    """Next token and its logprob for each row: logits fp32 [S, V] -> ([S] ints, [S] floats,
    the fp32 values exactly)."""
    _check_logits(logits, rows)
    if s.temperature == 0:
        chosen = tk.argmax(logits)
    else:
        ids = torch.tensor([r.request_id for r in rows], dtype=torch.int64)
        pos = torch.tensor([len(r.tokens) for r in rows], dtype=torch.int64)  # the new token's
        # top_k >= V restricts nothing: the kernel takes it as V (and V fits its int64).
        chosen = tk.sample(logits, temperature=s.temperature, seed=s.seed, request_ids=ids,
                           positions=pos, top_k=s.top_k and min(s.top_k, logits.shape[-1]),
                           top_p=s.top_p)
    lps = tk.token_logprobs(logits, chosen, temperature=s.temperature or 1.0).tolist()
    _check_logprobs(lps, logits, rows, s.temperature)
    return chosen.tolist(), lps


# -- generate -----------------------------------------------------------------------------------
@dataclass
class _Call:
    """A validated generate call."""
    reqs: List[_Request]
    max_new_tokens: int
    eos: set
    stop: set
    sampling: _Sampling
    max_batch_size: Optional[int]
    num_pages: Optional[int]

    def key(self) -> tuple:
        """What every TP rank must agree on (the digest's parts)."""
        return (self.max_new_tokens, sorted(self.eos), sorted(self.stop), self.sampling,
                self.max_batch_size, self.num_pages,
                [(r.request_id, r.prompt_len) for r in self.reqs],
                torch.tensor([t for r in self.reqs for t in r.tokens], dtype=torch.int64))


def _check_call(model, prompts, max_new_tokens, eos_token_id, temperature, top_k, top_p, seed,
                max_batch_size, stop_token_ids, progress, request_ids, num_pages) -> _Call:
    """Every argument of generate checked, before any forward (TypeError for a wrong type,
    ValueError / IndexError for a wrong value, CacheFullError for a request num_pages cannot
    hold alone)."""
    c, who = model.config, "generate"
    V, limit = c.vocab_size, c.max_position_embeddings
    max_new_tokens = as_int(who, "max_new_tokens", max_new_tokens, 0)
    sampling = _Sampling(check_temperature(who, temperature, greedy_ok=True),
                         None if top_k is None else as_int(who, "top_k", top_k, 1),
                         None if top_p is None else as_real(who, "top_p", top_p),
                         as_int(who, "seed", seed, 0, 2**64))
    if sampling.top_p is not None and not 0.0 < sampling.top_p <= 1.0:
        raise ValueError(f"generate: top_p must be in (0, 1], got {top_p!r}")
    if max_batch_size is not None:
        max_batch_size = as_int(who, "max_batch_size", max_batch_size, 1)
    if num_pages is not None:
        num_pages = as_int(who, "num_pages", num_pages, 1)
    if not isinstance(progress, bool):
        raise TypeError(f"generate: progress must be True or False, got {show(progress)}")
    eos, stop = _token_set("eos_token_id", eos_token_id, V), \
        _token_set("stop_token_ids", stop_token_ids, V)
    prompts = sequence_list(who, "prompts", prompts)
    keys = _request_ids(request_ids, len(prompts))
    reqs = []
    for i, p in enumerate(prompts):
        t = token_ids(who, f"prompt {i}", p, V)
        if t.numel() == 0:
            raise ValueError(f"generate: prompt {i} is empty (a prompt needs at least one token)")
        if len(t) >= limit:
            raise ValueError(f"generate: prompt {i} has {len(t)} tokens; the model's position "
                             f"limit max_position_embeddings={limit} leaves no room to generate")
        if len(t) + max_new_tokens > limit:
            raise ValueError(f"generate: prompt {i} ({len(t)} tokens) + max_new_tokens="
                             f"{max_new_tokens} exceeds max_position_embeddings={limit}")
        reqs.append(_Request(i, keys[i], t.tolist(), len(t)))
    call = _Call(reqs, max_new_tokens, eos, stop, sampling, max_batch_size, num_pages)
    if reqs and max_new_tokens > 0:
        _cache_pages(call, c.attention_block)                 # CacheFullError before any work
    return call


def _cache_pages(call: _Call, B: int):
    """(pages, batch, longest position) of the call's cache: enough pages for its largest
    `batch` requests at full length, or num_pages when fewer (more would never be used). The
    last new token is never fed, so a request writes prompt_len + max_new_tokens - 1 positions."""
    reqs = call.reqs
    batch = min(call.max_batch_size or len(reqs), len(reqs))
    positions = [r.prompt_len + call.max_new_tokens - 1 for r in reqs]
    pages = sorted((-(-n // B) for n in positions), reverse=True)
    enough = sum(pages[:batch])
    if call.num_pages is not None and call.num_pages < pages[0]:
        i = max(range(len(reqs)), key=lambda j: positions[j])
        raise CacheFullError(f"generate: request {i} needs {pages[0]} KV-cache pages of {B} "
                             f"positions ({positions[i]} positions) but the cache holds "
                             f"num_pages={call.num_pages}; it cannot run even alone")
    return min(call.num_pages or enough, enough), batch, max(positions)


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
        prompts: 1-D integer token-id sequences (tensors, arrays or lists), ragged, non-empty.
        max_new_tokens: tokens to generate per request at most (an int >= 0).
        eos_token_id, stop_token_ids: a token id or a sequence of them (ints, numpy integers,
            integer tensors); generating one ends the request (the token is kept, with its
            logprob). None = no eos (the model config's is not implied).
        temperature: 0 = greedy (argmax, lowest index on ties); > 0 samples from
            softmax(logits / temperature) restricted by top_k (int >= 1) / top_p (in (0, 1]),
            both ignored when greedy. A temperature must be a normal number in fp32 (>= about
            1.18e-38), and one so small that logits / temperature overflow fp32 raises.
        seed, request_ids: the sampling noise of request i at position t is a hash of
            (seed, request_ids[i], t, token); seed in [0, 2**64); request_ids distinct ints in
            [0, 2**63), default 0..n-1 (prompt order): pass them to keep a request's draws
            when the prompt list is reordered or split.
        max_batch_size: requests decoded together at most (None = all).
        num_pages: KV-cache pages (None = enough for the largest max_batch_size requests; fewer
            makes requests wait or be preempted and recomputed: docs/generation.md).
        progress: show a tqdm bar over finished requests.
    Returns: GenerationOutput (sequences, fp32 logprobs, prompt lengths, finish reasons, stats).
    Raises: TypeError / ValueError / IndexError on a bad argument, named (empty prompt, token id
        out of range, prompt + max_new_tokens beyond max_position_embeddings, ...);
        CacheFullError when num_pages cannot hold a request alone; RuntimeError when the ranks
        of a TP group were given different calls, or when the model's logits are not finite.
    """
    start = time.perf_counter()
    tp = TPCheck.of(model, "generate")
    call = tp.agreed(lambda: _check_call(model, prompts, max_new_tokens, eos_token_id,
                                         temperature, top_k, top_p, seed, max_batch_size,
                                         stop_token_ids, progress, request_ids, num_pages),
                     _Call.key)
    reqs = call.reqs
    stats = GenerationStats(prompt_tokens=sum(r.prompt_len for r in reqs))
    if reqs and call.max_new_tokens > 0:
        num_pages, batch, longest = _cache_pages(call, model.config.attention_block)
        cache = model.new_cache(batch, longest, num_pages=num_pages)
        _run(model, _Scheduler(cache, reqs, batch), call, stats, progress, tp)
    stats.seconds = time.perf_counter() - start
    return GenerationOutput(
        sequences=[torch.tensor(r.tokens, dtype=torch.int64) for r in reqs],
        logprobs=[torch.tensor(r.logprobs, dtype=torch.float32) for r in reqs],
        prompt_lengths=[r.prompt_len for r in reqs],
        finish_reasons=[r.finish or "length" for r in reqs], stats=stats)


def _run(model, sched: _Scheduler, call: _Call, stats: GenerationStats, progress: bool,
         tp: TPCheck) -> None:
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
        chosen, lps = _pick(logits, rows, call.sampling)
        for r, tok, lp in zip(rows, chosen, lps):
            r.cached = len(r.tokens)
            r.tokens.append(tok)
            r.logprobs.append(lp)
            stats.new_tokens += 1
            reason = "eos" if tok in call.eos else "stop" if tok in call.stop else \
                "length" if len(r.logprobs) >= call.max_new_tokens else None
            if reason:
                sched.finish(r, reason)
                bar.update(1)
        bar.set_postfix(tok_s=f"{stats.new_tokens / max(bar.format_dict['elapsed'], 1e-9):.0f}",
                        refresh=False)
    if tp.group is not None:  # every TP rank returns the same rollouts (see docs/generation.md)
        tp.agree(digest(stats.forward_steps, [len(r.tokens) for r in call.reqs],
                        torch.tensor([t for r in call.reqs for t in r.tokens]),
                        torch.tensor([p for r in call.reqs for p in r.logprobs])), "result")
    stats.preemptions = sched.preemptions
    bar.close()


__all__ = ["generate", "GenerationOutput", "GenerationStats"]
