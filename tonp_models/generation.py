"""`generate`: roll out ragged prompts with the rollout engine (tonp_models.engine: continuous
batching over a paged KV cache, prefix caching, chunked prefill); every logprob it reports is,
bit for bit, the one the training forward gives.

    out = generate(model, prompts, max_new_tokens=64, temperature=1.0, top_p=0.95, seed=7,
                   max_batch_size=8, eos_token_id=model.config.eos_token_id)
    lps = model.token_logprobs(out.sequences, temperature=1.0)    # training forward
    assert all(torch.equal(a[p - 1:], b) for a, b, p in zip(lps, out.logprobs, out.prompt_lengths))

A request's tokens and logprobs do not depend on its batch (size, companions, order, cache size,
preemption, prefix-cache hits, prefill chunks). Arguments are checked before any forward; the
ranks of a tensor-parallel group must make the same call (checked: a mismatch raises on every
rank); non-finite logits raise. How a call runs and why the batch does not matter:
docs/generation.md.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import torch

import tonp_parallel as tpar

from .checks import TPCheck, as_int, digest, sequence_list, show, token_ids
from .engine import Engine, Request, SamplingParams, lockstep_group, rules

TokenIds = Union[torch.Tensor, Sequence[int]]


@dataclass
class GenerationStats:
    """Work and time of one `generate` call (tokens counted over all forwards)."""
    prompt_tokens: int = 0        # prompt tokens of the requests
    prefill_tokens: int = 0       # context tokens fed in prefill (cache hits excluded; more
                                  # than the prompts' after a preemption)
    decode_tokens: int = 0        # tokens fed in decode steps
    new_tokens: int = 0           # generated tokens
    forward_steps: int = 0        # model forwards (each a mixed prefill + decode batch)
    preemptions: int = 0          # requests evicted for lack of pages (then recomputed)
    cached_tokens: int = 0        # context tokens whose K/V came from the prefix cache
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
        The tensors are on the model's device, like the training forward's logprobs.
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


# -- generate -----------------------------------------------------------------------------------
@dataclass
class _Call:
    """A validated generate call: one engine request per prompt, in order."""
    reqs: List[Request]
    params: SamplingParams
    max_batch_size: Optional[int]
    num_pages: Optional[int]
    prefix_cache: bool
    max_step_tokens: Optional[int]

    def key(self) -> tuple:
        """What every TP rank must agree on (the digest's parts)."""
        p = self.params
        return (p.max_new_tokens, sorted(p.eos_token_ids), sorted(p.stop_token_ids), p.draw,
                self.max_batch_size, self.num_pages, self.prefix_cache, self.max_step_tokens,
                [(r.noise_key, r.prompt_len) for r in self.reqs],
                torch.tensor([t for r in self.reqs for t in r.tokens], dtype=torch.int64))


def _check_call(model, prompts, max_new_tokens, eos_token_id, temperature, top_k, top_p, seed,
                max_batch_size, stop_token_ids, progress, request_ids, num_pages, prefix_cache,
                max_step_tokens) -> _Call:
    """Every argument of generate checked, before any forward, by the request rules
    (engine/rules.py) and the call's own: TypeError for a wrong type, ValueError / IndexError for
    a wrong value, CacheFullError for a request num_pages cannot hold alone."""
    c, who = model.config, "generate"
    V = c.vocab_size
    params = rules.sampling(who, max_new_tokens=max_new_tokens, temperature=temperature,
                            top_k=top_k, top_p=top_p, seed=seed, eos_token_ids=eos_token_id,
                            stop_token_ids=stop_token_ids, vocab=V)
    if max_batch_size is not None:
        max_batch_size = as_int(who, "max_batch_size", max_batch_size, 1)
    if num_pages is not None:
        num_pages = as_int(who, "num_pages", num_pages, 1)
    if max_step_tokens is not None:
        max_step_tokens = as_int(who, "max_step_tokens", max_step_tokens, 1)
    for name, flag in (("progress", progress), ("prefix_cache", prefix_cache)):
        if not isinstance(flag, bool):
            raise TypeError(f"generate: {name} must be True or False, got {show(flag)}")
    prompts = sequence_list(who, "prompts", prompts)
    keys = rules.noise_keys(who, request_ids, len(prompts))
    reqs = []
    for i, p in enumerate(prompts):
        t = token_ids(who, f"prompt {i}", p).tolist()
        rules.prompt(who, f"request {i}", t, params.max_new_tokens, vocab=V,
                     context=c.max_position_embeddings)
        reqs.append(Request(i, t, params, noise_key=keys[i], name=str(i)))
    call = _Call(reqs, params, max_batch_size, num_pages, prefix_cache, max_step_tokens)
    if reqs and params.max_new_tokens > 0:
        _cache_pages(call, c.attention_block)                 # CacheFullError before any work
    return call


def _cache_pages(call: _Call, B: int):
    """(pages, batch, longest position) of the call's cache: enough pages for its largest
    `batch` requests at full length, or num_pages when fewer (more would never be used).
    The batch is at most max_step_tokens (every running request feeds a token each step)."""
    reqs = call.reqs
    batch = min(call.max_batch_size or len(reqs), len(reqs), call.max_step_tokens or len(reqs))
    positions = [rules.positions(r.prompt_len, call.params.max_new_tokens) for r in reqs]
    pages = sorted((-(-n // B) for n in positions), reverse=True)
    enough = sum(pages[:batch])
    if call.num_pages is not None:
        i = max(range(len(reqs)), key=lambda j: positions[j])
        rules.fits_cache("generate", f"request {i}", positions[i], page_size=B,
                         num_pages=call.num_pages)
    return min(call.num_pages or enough, enough), batch, max(positions)


# no_grad, not inference_mode: the returned sequences feed the (grad-enabled) training forward.
@torch.no_grad()
def generate(model, prompts: Sequence[TokenIds], max_new_tokens: int,
             eos_token_id: Union[int, Sequence[int], None] = None, temperature: float = 0.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None, seed: int = 0,
             max_batch_size: Optional[int] = None,
             stop_token_ids: Optional[Sequence[int]] = None, progress: bool = False, *,
             request_ids: Optional[Sequence[int]] = None, num_pages: Optional[int] = None,
             prefix_cache: bool = True, max_step_tokens: Optional[int] = None,
             weight_groups: bool = True) -> GenerationOutput:
    """Roll out every prompt with `model` (a Qwen3MoeForCausalLM or anything with its forward,
    `new_cache` and `config`) through an `Engine`.

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
        prefix_cache: share the K/V pages of prompt prefixes between requests (G samples of a
            prompt prefill it once); max_step_tokens: tokens a forward feeds at most (chunked
            prefill; None = no limit). Neither changes a bit of the result.
        weight_groups: the engine keeps the expert weights (and fp32 dense weights) also in
            column groups laid out the way the CPU tiles read them (engine.Engine; AVX512-BF16,
            and fp32 on AVX2): packed when missing or stale, kept by the model for the next call
            (those weights' size again in memory; free them with `model.drop_weight_groups()`); False:
            none. It changes no bit.
        progress: show a tqdm bar over finished requests.
    Returns: GenerationOutput (sequences, fp32 logprobs, prompt lengths, finish reasons, stats).
    Raises: TypeError / ValueError / IndexError on a bad argument, named (empty prompt, token id
        out of range, prompt + max_new_tokens beyond max_position_embeddings, ...);
        CacheFullError when num_pages cannot hold a request alone; RuntimeError when the ranks
        of a TP group were given different calls, or when the model's logits are not finite.
    """
    start = time.perf_counter()
    if not isinstance(weight_groups, bool):
        raise TypeError(f"generate: weight_groups must be True or False, got "
                        f"{type(weight_groups).__name__}")
    tp = TPCheck.of(model, "generate")
    call = tp.agreed(lambda: _check_call(model, prompts, max_new_tokens, eos_token_id,
                                         temperature, top_k, top_p, seed, max_batch_size,
                                         stop_token_ids, progress, request_ids, num_pages,
                                         prefix_cache, max_step_tokens),
                     _Call.key)
    reqs = call.reqs
    stats = GenerationStats(prompt_tokens=sum(r.prompt_len for r in reqs))
    if reqs and call.params.max_new_tokens > 0:
        num_pages, batch, longest = _cache_pages(call, model.config.attention_block)
        engine = Engine(model, max_batch_size=batch, num_pages=num_pages, max_seq_len=longest,
                        prefix_caching=call.prefix_cache, max_step_tokens=call.max_step_tokens,
                        strict=True, who="generate", lockstep_group=_lockstep(model, call),
                        weight_groups=weight_groups)
        _run(engine, call, stats, progress, tp)
    stats.seconds = time.perf_counter() - start
    dev = _device(model)
    return GenerationOutput(
        sequences=[torch.tensor(r.tokens, dtype=torch.int64, device=dev) for r in reqs],
        logprobs=[torch.tensor(r.logprobs, dtype=torch.float32, device=dev) for r in reqs],
        prompt_lengths=[r.prompt_len for r in reqs],
        finish_reasons=[r.finish or "length" for r in reqs], stats=stats)


def _device(model) -> torch.device:
    """The model's device (where its forward's outputs are); the CPU for a stand-in that has
    neither a device nor parameters (a wrapper of new_cache and __call__)."""
    dev = getattr(model, "device", None)
    if dev is None and hasattr(model, "parameters"):
        dev = next(iter(model.parameters()), torch.empty(0)).device
    return torch.device(dev or "cpu")


def _lockstep(model, call: _Call):
    """The EP group when its ranks (outside this TP group) were given different calls: they
    then step in lockstep, an idle rank running a one-token forward while a peer has work."""
    group = lockstep_group(model)
    if group is None:
        return None
    mine = torch.tensor([digest(*call.key())], dtype=torch.int64)
    every = tpar.all_gather_stacked(mine, group)                                   # (W, 1)
    return None if bool((every == mine).all()) else group


def _run(engine: Engine, call: _Call, stats: GenerationStats, progress: bool,
         tp: TPCheck) -> None:
    """Feed every request to the engine and step it until all have ended."""
    from tqdm.auto import tqdm

    bar = tqdm(total=len(call.reqs), unit="req", desc="rollout", disable=not progress)
    for r in call.reqs:
        engine.add(r)
    while not engine.idle_everywhere():
        ended = sum(1 for o in engine.step() if o.finish)
        if ended:
            bar.update(ended)
        rate = engine.stats.new_tokens / max(bar.format_dict["elapsed"], 1e-9)
        bar.set_postfix(tok_s=f"{rate:.0f}", refresh=False)
    e = engine.stats
    stats.prefill_tokens, stats.decode_tokens, stats.new_tokens = \
        e.prefill_tokens, e.decode_tokens, e.new_tokens
    stats.forward_steps, stats.preemptions, stats.cached_tokens = \
        e.forward_steps, e.preemptions, e.cached_tokens
    if tp.group is not None:  # every TP rank returns the same rollouts (see docs/generation.md)
        tp.agree(digest(stats.forward_steps, [len(r.tokens) for r in call.reqs],
                        torch.tensor([t for r in call.reqs for t in r.tokens]),
                        torch.tensor([p for r in call.reqs for p in r.logprobs])), "result")
    bar.close()


__all__ = ["generate", "GenerationOutput", "GenerationStats"]
