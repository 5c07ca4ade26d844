"""What the engine holds per request: its sampling settings, its tokens and its place in the
cache; and what a step hands back per request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, FrozenSet, List, Optional, Tuple


@dataclass(frozen=True)
class SamplingParams:
    """How one request draws its tokens and when it ends.

    temperature: 0 = greedy (argmax, lowest index on ties); > 0 samples from
        softmax(logits / temperature), restricted by top_k / top_p. The reported logprob of a
        token is log_softmax(logits / T) (T = 1 for greedy), untruncated.
    seed: with the request's noise key, what the sampling noise is a hash of.
    eos_token_ids / stop_token_ids: generating one ends the request (finish "eos" / "stop";
        the token is kept). max_new_tokens: then "length".
    top_logprobs: also report the k most likely tokens of each step's distribution.
    prompt_logprobs: None, or k >= 0: also score the prompt (engine/prompt_logprobs.py) with
        the k most likely tokens of each position.
    Entry points make it with `engine.rules.sampling`, which checks every value.
    """
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: int = 0
    eos_token_ids: FrozenSet[int] = frozenset()
    stop_token_ids: FrozenSet[int] = frozenset()
    top_logprobs: int = 0
    prompt_logprobs: Optional[int] = None

    @property
    def draw(self) -> Tuple:
        """The settings one sampling-kernel call shares (rows are grouped by it)."""
        return (self.temperature, self.top_k, self.top_p, self.seed)


@dataclass(eq=False)
class Request:
    """One request in the engine.

    key: the client's handle (unique among the engine's live requests); noise_key: the request
    id in the sampling noise (seed, noise_key, position, token); name: how errors name it.
    tokens: the prompt, then the generated tokens; cached: those whose K/V are in the cache.
    """
    key: Any
    tokens: List[int]
    params: SamplingParams
    noise_key: int = 0
    name: str = ""
    prompt_len: int = field(init=False)
    logprobs: List[float] = field(default_factory=list)     # fp32 values, exact as floats
    top_logprobs: List[List[Tuple[int, float]]] = field(default_factory=list)
    slot: Optional[int] = None
    cached: int = 0
    page_keys: List[bytes] = field(default_factory=list)    # prefix keys of its full pages
    prefilling: bool = True     # since (re)admission, until its next token
    cache_hit: int = 0          # positions its last admission took from the prefix cache
    finish: Optional[str] = None   # "eos" | "stop" | "length" | "abort" | "error"
    error: Optional[Exception] = None
    prompt_logprobs: Optional[list] = None   # PromptLogprob per prompt position >= 1, if asked

    def __post_init__(self):
        self.tokens = [int(t) for t in self.tokens]     # its own list: the engine extends it
        self.prompt_len = len(self.tokens)

    @property
    def pending(self) -> List[int]:
        """Tokens to feed: the context not yet in the cache (after (re)admission) or the last."""
        return self.tokens[self.cached:]

    @property
    def num_new(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def completion(self) -> List[int]:
        return self.tokens[self.prompt_len:]


@dataclass
class StepOutput:
    """A request's news from one step: its new token (None when it ended without one: abort,
    error) with the logprob and top logprobs, and its finish reason once it is done."""
    request: Request
    token: Optional[int] = None
    logprob: Optional[float] = None
    top_logprobs: Optional[List[Tuple[int, float]]] = None
    finish: Optional[str] = None


@dataclass
class EngineStats:
    """Work of an engine since it was built (tokens counted over all forwards)."""
    prompt_tokens: int = 0        # prompt tokens of the admitted requests
    cached_tokens: int = 0        # context tokens taken from the prefix cache at admission
    prefill_tokens: int = 0       # context tokens fed in prefill (cache hits excluded)
    decode_tokens: int = 0        # tokens fed in decode steps
    new_tokens: int = 0           # generated tokens
    forward_steps: int = 0        # model forwards (each a mixed prefill + decode batch)
    preemptions: int = 0          # requests evicted for lack of pages (then recomputed)
    requests_finished: int = 0

    @property
    def cache_hit_rate(self) -> float:
        """Fraction of admitted context tokens whose K/V came from the prefix cache."""
        return self.cached_tokens / max(self.cached_tokens + self.prefill_tokens, 1)
