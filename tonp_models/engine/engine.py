"""`Engine`: the rollout engine. Requests join and leave a running continuous batch at any step,
each with its own sampling settings, max tokens, eos / stop ids and noise key; a step is one
forward of the model over a ragged batch of prefill chunks and decode tokens.

    engine = Engine(model, max_batch_size=8, max_step_tokens=256)
    engine.add(Request("a", prompt_ids, SamplingParams(max_new_tokens=32, temperature=1.0)))
    while engine.has_work:
        for out in engine.step():      # StepOutput: request, token, logprob, finish
            ...

Every token and logprob is, bit for bit, what the request gets alone and what the training
forward gives its sequence (`model.token_logprobs`), with prefix caching and chunked prefill on
(docs/generation.md). The engine is single-threaded: one thread owns it (tonp_models.serve runs
it in its own thread and talks to it through a queue).
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from tonp_parallel import ParallelGroups, group_device

from ..layers import CacheFullError
from ..layers.weight_groups import reading_weight_groups
from . import rules
from .pages import PageAllocator
from .prefix_cache import PrefixCache
from .prompt_logprobs import score_prompt
from .request import EngineStats, Request, StepOutput
from .sampling import pick
from .scheduler import ScheduledBatch, Scheduler


class Engine:
    """A request queue and a scheduler over one model and one paged KV cache.

    Args:
        model: a Qwen3MoeForCausalLM (anything with its forward, `new_cache` and `config`).
        max_batch_size: requests running at once at most (the cache's sequence slots).
        num_pages: KV-cache pages (None = max_batch_size sequences of max_seq_len).
        max_seq_len: positions a request may reach (None = max_position_embeddings).
        prefix_caching: share the K/V pages of computed prefixes (engine/prefix_cache.py).
        max_step_tokens: tokens one forward feeds at most (None = no limit): long prompts are
            prefilled in chunks while the running requests keep decoding. >= max_batch_size.
        strict: raise a request's error (non-finite logits, overflowing temperature) from step()
            instead of ending that request with finish "error".
        who: the name errors start with.
        lockstep_group: a process group whose ranks step together although they hold different
            requests (expert parallelism without tensor parallelism between them): a rank
            without work runs a one-token forward while a peer has work (see `idle_everywhere`).
        weight_groups: keep the expert weights (and fp32 dense weights) also in column groups,
            laid out the way the AVX512-BF16 build's tiles read them, fp32 ones also on the AVX2
            build (layers/weight_groups.py; the same bits). Costs those weights' size again in
            memory where they are read (held by the model until
            drop_weight_groups()), nothing elsewhere. After changing the weights other than by
            in-place tensor ops or a torch optimizer, call clear_prefix_cache() (as the prefix
            cache's K/V need anyway).
    """

    def __init__(self, model, *, max_batch_size: int = 8, num_pages: Optional[int] = None,
                 max_seq_len: Optional[int] = None, prefix_caching: bool = True,
                 max_step_tokens: Optional[int] = None, strict: bool = False,
                 who: str = "engine", lockstep_group=None, weight_groups: bool = True):
        c = model.config
        if not isinstance(weight_groups, bool):
            raise TypeError(f"{who}: weight_groups must be True or False, got "
                            f"{type(weight_groups).__name__}")
        self.model, self.who, self.strict = model, who, strict
        self.max_seq_len = max_seq_len or c.max_position_embeddings
        if max_batch_size < 1 or (num_pages is not None and num_pages < 1):
            raise ValueError(f"{who}: max_batch_size and num_pages must be >= 1, got "
                             f"{max_batch_size}, {num_pages}")
        if max_step_tokens is not None and max_step_tokens < max_batch_size:
            raise ValueError(f"{who}: max_step_tokens={max_step_tokens} must be >= "
                             f"max_batch_size={max_batch_size} (every running request feeds "
                             f"a token each step)")
        self.cache = PageAllocator(model.new_cache(max_batch_size, self.max_seq_len,
                                                   num_pages=num_pages))
        self.prefix = PrefixCache(self.cache) if prefix_caching else None
        self.sched = Scheduler(self.cache, self.prefix, max_batch_size, max_step_tokens)
        self.stats = EngineStats()
        self.lockstep_group = lockstep_group
        self.requests: Dict[Any, Request] = {}
        self._news: List[StepOutput] = []   # outputs of requests that ended between steps
        # Layers that keep their weights in column groups in the kernels' reading order (the
        # experts; the dense linears and the LM head, fp32 weights),
        # read by engine forwards only: packed before a step where missing or made from weights
        # that changed since (layers/weight_groups.py checks), and afresh after clear_prefix_cache
        # (every weight update calls it). The same bits, more speed, and those weights'
        # size again in memory, held by the model (weight_groups=False: none).
        modules = getattr(model, "modules", None) if weight_groups else None
        self._grouped = [m for m in modules() if hasattr(m, "pack_weight_groups")] \
            if modules is not None else []
        self._groups_fresh = True   # groups the model holds and that are current are used

    # -- requests ----------------------------------------------------------------------------
    def check(self, r: Request) -> None:
        """Raise (TypeError / ValueError / IndexError / CacheFullError, naming the request)
        unless r can run: the request rules (engine/rules.py) for its noise key, its prompt
        (token ids in the vocabulary, prompt + max_new_tokens within the context) and its fit
        in the cache alone. Reads constants only, so another thread may call it."""
        c, name = self.model.config, f"request {r.name}"
        limit = c.max_position_embeddings
        rules.noise_key(self.who, f"{name}: noise_key", r.noise_key)
        context, what = (limit, "max_position_embeddings") if self.max_seq_len + 1 >= limit \
            else (self.max_seq_len + 1, f"max_seq_len={self.max_seq_len}")
        rules.prompt(self.who, name, r.tokens, r.params.max_new_tokens, vocab=c.vocab_size,
                     context=context, limit=what)
        rules.fits_cache(self.who, name, rules.positions(len(r.tokens), r.params.max_new_tokens),
                         page_size=self.cache.page_size, num_pages=self.cache.num_pages)

    def add(self, r: Request) -> None:
        """Queue a request (checked first); it joins the running batch when it fits."""
        if r.key in self.requests:
            raise ValueError(f"{self.who}: a request with key {r.key!r} is already queued")
        self.check(r)
        if r.params.prompt_logprobs is not None:   # a forward: every lockstep rank adds it too
            r.prompt_logprobs = score_prompt(self.who, self.model, r)
        self.requests[r.key] = r
        self.stats.prompt_tokens += r.prompt_len
        if r.params.max_new_tokens == 0:
            self._end(r, "length")
        else:
            self.sched.waiting.append(r)

    def abort(self, key) -> bool:
        """End a waiting or running request now (finish "abort"; its pages are released).
        False when no live request has this key."""
        r = self.requests.get(key)
        if r is None:
            return False
        self._end(r, "abort")
        return True

    def fail(self, key, error: Exception) -> bool:
        """End a waiting or running request now with finish "error" and `error` (its pages are
        released). False when no live request has this key."""
        r = self.requests.get(key)
        if r is None:
            return False
        self._end(r, "error", error)
        return True

    def fail_running(self, error: Exception) -> List[Any]:
        """End every running request with finish "error" (after a step that raised: the batch
        it fed was among them); the keys of those ended."""
        keys = [r.key for r in self.sched.running]
        for key in keys:
            self.fail(key, error)
        return keys

    def hold_admission(self, on: bool) -> None:
        """While on, only requests that already generated tokens (preempted ones) rejoin the
        batch; new ones wait (a weight update drains the running requests first)."""
        self.sched.admit_started_only = bool(on)

    @property
    def has_started_requests(self) -> bool:
        """Are requests running, or preempted after producing tokens?"""
        return self.sched.started_requests()

    def _end(self, r: Request, reason: str, error: Optional[Exception] = None,
             out: Optional[StepOutput] = None) -> None:
        """Finish r (its pages released) and queue its last output (default: no token)."""
        self.sched.finish(r, reason)
        r.error = error
        del self.requests[r.key]
        self.stats.requests_finished += 1
        self._news.append(out or StepOutput(r, finish=reason))

    @property
    def has_work(self) -> bool:
        return not self.sched.done or bool(self._news)

    @property
    def weight_group_bytes(self) -> int:
        """Bytes the model's weight groups hold (0: none made, or none read by these kernels)."""
        return sum(m.weight_group_bytes() for m in self._grouped)

    def refresh_weight_groups(self) -> int:
        """Pack the weight groups that are missing or stale, all of them after
        clear_prefix_cache; how many layers were packed."""
        stale = [m for m in self._grouped if not (self._groups_fresh and m.weight_groups_current())]
        for m in stale:
            m.pack_weight_groups()
        self._groups_fresh = True
        return len(stale)

    def drop_weight_groups(self) -> None:
        """Free the weight groups (the next step packs them again)."""
        for m in self._grouped:
            m.drop_weight_groups()
        self._groups_fresh = False

    @property
    def num_running(self) -> int:
        return len(self.sched.running)

    @property
    def num_waiting(self) -> int:
        return len(self.sched.waiting)

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (after a weight update their K/V are stale) and re-pack the
        weight groups before the next step (they are copies of the old weights)."""
        if self.prefix is not None:
            self.prefix.clear()
        self._groups_fresh = False

    # -- stepping ----------------------------------------------------------------------------
    def idle_everywhere(self) -> bool:
        """True when this engine, and under lockstep every engine of the group, has no work.
        Collective under lockstep: every rank calls it, then step() when it returned False."""
        busy = self.has_work
        if self.lockstep_group is None:
            return not busy
        flag = torch.tensor([int(busy)], dtype=torch.int64,
                            device=group_device(self.lockstep_group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.lockstep_group)
        return not flag.item()

    @torch.no_grad()
    def step(self) -> List[StepOutput]:
        """One forward over the scheduled batch: schedule -> run -> sample and update. The
        outputs since the last step (one per request that got a token or ended). Under
        lockstep, a rank without work runs a one-token forward."""
        batch = self._schedule()
        if batch is not None:
            self._update(batch, self._run(batch))
        elif self.lockstep_group is not None:
            self.model(torch.zeros(1, dtype=torch.int64),
                       logits_rows=torch.zeros(0, dtype=torch.int64))
        news, self._news = self._news, []
        return news

    def _schedule(self) -> Optional[ScheduledBatch]:
        """The scheduler's batch for this step, its pages allocated."""
        batch = self.sched.schedule()
        self.stats.preemptions = self.sched.preemptions
        self.stats.cached_tokens = self.sched.cached_tokens
        if batch is None and self.sched.waiting and not self.sched.admit_started_only \
                and self.lockstep_group is None:
            # cannot happen: add() checked that each request fits alone
            raise CacheFullError(f"{self.who}: request {self.sched.waiting[0].name} does "
                                 f"not fit in {self.cache.free_pages} free pages")
        return batch

    def _run(self, batch: ScheduledBatch) -> torch.Tensor:
        """The forward over the batch -> fp32 logits [S', V] of its sampled requests; then the
        scheduler commits the fed tokens."""
        with reading_weight_groups() if self._grouped else contextlib.nullcontext():
            self.refresh_weight_groups()
            logits = self.model(batch.ids, batch.cu_seqlens, kv=batch.kv,
                                logits_rows=batch.logits_rows)
        self.stats.forward_steps += 1
        for r, n in batch.feeds:
            if r.prefilling:
                self.stats.prefill_tokens += n
            else:
                self.stats.decode_tokens += n
        self.sched.commit(batch)
        return logits

    def _update(self, batch: ScheduledBatch, logits: torch.Tensor) -> None:
        """Sample each completed request's next token, append it and check its stops."""
        sampled = batch.sampled
        picks = pick(self.who, logits, sampled) if sampled else []
        for r, (tok, lp, top, err) in zip(sampled, picks):
            if err is not None:
                if self.strict:
                    raise err
                self._end(r, "error", err)
                continue
            r.tokens.append(tok)
            r.logprobs.append(lp)
            if top is not None:
                r.top_logprobs.append(top)
            r.prefilling = False
            self.stats.new_tokens += 1
            p = r.params
            reason = "eos" if tok in p.eos_token_ids else "stop" if tok in p.stop_token_ids \
                else "length" if r.num_new >= p.max_new_tokens else None
            out = StepOutput(r, tok, lp, top, reason)
            if reason:
                self._end(r, reason, out=out)
            else:
                self._news.append(out)


def lockstep_group(model):
    """The group a generate call must step in lockstep with: the model's expert-parallel group
    when it holds ranks outside this rank's tensor-parallel group (those may hold other
    requests, and every MoE forward is an all_to_all over the EP group); else None."""
    groups = getattr(model, "groups", None) or ParallelGroups.single()   # a stand-in model
    ep, tp = groups.ep_group, groups.tp_group
    if ep is None or dist.get_world_size(ep) == 1:
        return None
    tp_ranks = set(dist.get_process_group_ranks(tp)) if tp is not None else {dist.get_rank()}
    return None if set(dist.get_process_group_ranks(ep)) <= tp_ranks else ep
