"""The request bodies the service accepts, and their translation into engine requests.

Bodies are pydantic models with `extra="forbid"` and strict types: an unknown field, a string
where a number belongs or a bool where an integer belongs is a 400 naming the field. Values are
then checked with the rules `generate` uses (tonp_models.checks): temperature 0 (greedy) or a
normal fp32 number, top_p in (0, 1], top_k >= 1, seed in [0, 2**64), token ids in the
vocabulary, prompt + max tokens within the context, n within the server's limit. OpenAI fields
tonp does not implement (penalties, logit_bias, echo, suffix, best_of != n, tools) are refused
by name rather than silently ignored.
"""
from __future__ import annotations

import secrets
from typing import Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..checks import as_int, check_temperature
from ..engine import SamplingParams


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields every generating endpoint shares (OpenAI's, plus vLLM's top_k, stop_token_ids,
    ignore_eos)."""
    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    n: int = 1
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[Dict[str, float]] = None
    user: Optional[str] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, List[int], List[str], List[List[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ChatMessage(_Body):
    role: str
    content: Union[str, List[Dict], None] = None
    name: Optional[str] = None


class ChatRequest(_Sampling):
    messages: List[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[List[Dict]] = None
    response_format: Optional[Dict] = None


class UpdateWeightsRequest(_Body):
    model_path: str


# -- translation ------------------------------------------------------------------------------
def refuse_unsupported(body: _Sampling) -> None:
    """400 for OpenAI features tonp does not implement, named."""
    unsupported = [("presence_penalty", body.presence_penalty not in (0, 0.0)),
                   ("frequency_penalty", body.frequency_penalty not in (0, 0.0)),
                   ("logit_bias", bool(body.logit_bias)),
                   ("stop", bool(body.stop))]
    if isinstance(body, CompletionRequest):
        unsupported += [("echo", body.echo), ("suffix", body.suffix is not None),
                        ("best_of", body.best_of not in (None, body.n))]
    if isinstance(body, ChatRequest):
        unsupported += [("tools", bool(body.tools)),
                        ("response_format", body.response_format not in (None, {"type": "text"}))]
    for name, bad in unsupported:
        if bad:
            hint = " (use stop_token_ids)" if name == "stop" else ""
            raise ApiError(400, f"{name} is not supported by this server{hint}", name)


def sampling_params(*, temperature, top_p, top_k, seed, max_new: int, eos: List[int],
                    stop_ids: Optional[List[int]], top_logprobs: int,
                    vocab: int) -> SamplingParams:
    """SamplingParams from request values, each checked by generate's rules (400 naming it)."""
    def check(param, fn):
        try:
            return fn()
        except (TypeError, ValueError) as e:
            raise ApiError(400, str(e), param) from None

    t = check("temperature", lambda: check_temperature(
        "request", 1.0 if temperature is None else temperature, greedy_ok=True))
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ApiError(400, f"request: top_p must be in (0, 1], got {top_p!r}", "top_p")
    k = None if top_k is None else check("top_k", lambda: as_int("request", "top_k", top_k, 1))
    s = secrets.randbits(63) if seed is None else \
        check("seed", lambda: as_int("request", "seed", seed, 0, 2**64))
    stop = check("stop_token_ids", lambda: [as_int("request", f"stop_token_ids[{j}]", v, 0, vocab)
                                            for j, v in enumerate(stop_ids or [])])
    if not 0 <= top_logprobs <= 20:
        raise ApiError(400, f"request: at most 20 top logprobs, got {top_logprobs}", "logprobs")
    return SamplingParams(max_new, t, k, None if top_p in (None, 1.0) else top_p, s,
                          frozenset(eos), frozenset(stop), top_logprobs)


def check_n(n: int, prompts: int, max_n: int) -> None:
    if n < 1:
        raise ApiError(400, f"n must be >= 1, got {n}", "n")
    if n * prompts > max_n:
        raise ApiError(400, f"n={n} x {prompts} prompt(s) = {n * prompts} sequences exceeds the "
                            f"server's limit of {max_n} per request (--max-n)", "n")


def max_new_tokens(requested: Optional[int], prompt_len: int, context: int, name: str) -> int:
    """The request's max new tokens: as asked (checked against the context) or, when None, what
    the context leaves."""
    if prompt_len >= context:
        raise ApiError(400, f"the prompt has {prompt_len} tokens but the model's context is "
                            f"{context} tokens, leaving no room to generate", "prompt")
    if requested is None:
        return context - prompt_len
    if requested < 0:
        raise ApiError(400, f"{name} must be >= 0, got {requested}", name)
    if prompt_len + requested > context:
        raise ApiError(400, f"the prompt ({prompt_len} tokens) + {name}={requested} = "
                            f"{prompt_len + requested} tokens exceeds the model's context of "
                            f"{context} tokens", name)
    return requested


FinishReason = Literal["stop", "length", "abort", "error"]


def openai_finish(reason: Optional[str]) -> Optional[str]:
    """The engine's finish reason as OpenAI names it (eos and stop tokens are both "stop")."""
    return {"eos": "stop", "stop": "stop"}.get(reason, reason)
