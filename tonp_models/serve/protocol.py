"""The request bodies the service accepts, and their translation into engine requests.

Bodies are pydantic models with `extra="forbid"` and strict types: an unknown field, a string
where a number belongs or a bool where an integer belongs is a 400 naming the field. Values are
then checked with the rules `generate` uses (tonp_models/engine/rules.py): temperature 0 (greedy) or a
normal fp32 number, top_p in (0, 1], top_k >= 1, seed in [0, 2**64), token ids in the
vocabulary, prompt + max tokens within the context, n within the server's limit, logprob
counts within --max-logprobs. vLLM's and OpenAI's fields tonp does not implement (penalties,
min_p, logit_bias, beam search, guided decoding, suffix, best_of != n, tools, ...) are accepted
at their neutral value only (`NEUTRAL`) and refused by name otherwise, never silently ignored.
"""
from __future__ import annotations

import json
import secrets
from typing import Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..engine import SamplingParams, rules


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class Body(BaseModel):
    """Every request body's base (all dialects): an unknown field or a value of the wrong type
    is a 400 naming it, never ignored or coerced."""
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Body):
    include_usage: bool = False


class _Sampling(Body):
    """Fields every OpenAI endpoint shares: OpenAI's, and vLLM's sampling extras with their
    vLLM names and JSON types. Those tonp does not implement are accepted at their neutral
    value only (`NEUTRAL`), refused by name otherwise."""
    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None              # vLLM: 0 or -1 = off
    n: Optional[int] = 1
    seed: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: Optional[bool] = None
    return_tokens_as_token_ids: Optional[bool] = None
    prompt_logprobs: Optional[int] = None
    best_of: Optional[int] = None
    user: Optional[str] = None
    # accepted at their neutral value only (NEUTRAL)
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    repetition_penalty: Optional[float] = None
    min_p: Optional[float] = None
    min_tokens: int = 0
    length_penalty: float = 1.0
    use_beam_search: bool = False
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = None
    allowed_token_ids: Optional[List[int]] = None
    bad_words: Optional[List[str]] = None
    logit_bias: Optional[Dict[str, float]] = None
    priority: int = 0
    response_format: Optional[Dict] = None
    structured_outputs: Optional[Dict] = None
    guided_json: Optional[Union[str, Dict]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[List[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    logits_processors: Optional[List] = None
    cache_salt: Optional[str] = None
    kv_transfer_params: Optional[Dict] = None
    vllm_xargs: Optional[Dict] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, List[int], List[str], List[List[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    add_special_tokens: bool = True          # vLLM's default for completions
    suffix: Optional[str] = None
    prompt_embeds: Optional[Union[str, List[str]]] = None


class ChatMessage(Body):
    role: str
    content: Union[str, List[Dict], None] = None
    name: Optional[str] = None


class ChatRequest(_Sampling):
    messages: List[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    add_special_tokens: bool = False         # vLLM's default for chat (the template has them)
    chat_template_kwargs: Optional[Dict] = None
    # accepted at their neutral value only (NEUTRAL)
    echo: bool = False
    tools: Optional[List[Dict]] = None
    tool_choice: Optional[Union[str, Dict]] = None
    parallel_tool_calls: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    documents: Optional[List[Dict]] = None
    mm_processor_kwargs: Optional[Dict] = None
    structural_tag: Optional[str] = None
    reasoning_effort: Optional[str] = None
    include_reasoning: bool = True


def _is(*values):
    """A value test: one of `values` (the bodies are strict: no bool passes for a number)."""
    return lambda v: v in values


# field -> (is its value a no-op for tonp?, the value(s) it accepts). vLLM's defaults; a client
# that sends them (TRL sends repetition_penalty 1, top_k 0, min_p 0) is served unchanged.
NEUTRAL = {
    "presence_penalty": (_is(None, 0), "0"),
    "frequency_penalty": (_is(None, 0), "0"),
    "repetition_penalty": (_is(None, 1), "1"),
    "min_p": (_is(None, 0), "0"),
    "min_tokens": (_is(0), "0"),
    "length_penalty": (_is(1), "1"),
    "use_beam_search": (_is(False), "false"),
    "spaces_between_special_tokens": (_is(True), "true"),
    "truncate_prompt_tokens": (_is(None), "null"),
    "allowed_token_ids": (_is(None), "null"),
    "bad_words": (lambda v: not v, "[]"),
    "logit_bias": (lambda v: not v, "{}"),
    "priority": (_is(0), "0"),
    "response_format": (lambda v: v in (None, {"type": "text"}), '{"type": "text"}'),
    "structured_outputs": (_is(None), "null"),
    "guided_json": (_is(None), "null"),
    "guided_regex": (_is(None), "null"),
    "guided_choice": (_is(None), "null"),
    "guided_grammar": (_is(None), "null"),
    "guided_decoding_backend": (_is(None), "null"),
    "guided_whitespace_pattern": (_is(None), "null"),
    "logits_processors": (lambda v: not v, "null"),
    "cache_salt": (_is(None), "null"),
    "kv_transfer_params": (_is(None), "null"),
    "vllm_xargs": (lambda v: not v, "null"),
    "suffix": (_is(None), "null"),
    "prompt_embeds": (_is(None), "null"),
    "tools": (lambda v: not v, "[]"),
    "tool_choice": (_is(None, "none"), '"none"'),
    "parallel_tool_calls": (_is(None, False), "false"),
    "add_generation_prompt": (_is(True), "true"),
    "continue_final_message": (_is(False), "false"),
    "chat_template": (_is(None), "null (the checkpoint's template)"),
    "documents": (_is(None), "null"),
    "mm_processor_kwargs": (_is(None), "null"),
    "structural_tag": (_is(None), "null"),
    "reasoning_effort": (_is(None), "null"),
    "include_reasoning": (_is(True), "true"),
}


# -- translation ------------------------------------------------------------------------------
def refuse_unsupported(body: _Sampling) -> None:
    """400 naming the first field set to a value tonp does not implement (never ignored)."""
    for name, (neutral, want) in NEUTRAL.items():
        if name in type(body).model_fields and not neutral(getattr(body, name)):
            got = json.dumps(getattr(body, name))[:80]
            raise ApiError(400, f"{name} is not supported by this server: it accepts {want} "
                                f"only (got {got})", name)
    if isinstance(body, ChatRequest) and body.echo:
        raise ApiError(400, "echo is not supported on chat completions (use /v1/completions)",
                       "echo")
    if body.best_of not in (None, body.n):
        raise ApiError(400, f"best_of must equal n (no beam or best-of search), got "
                            f"best_of={body.best_of}, n={body.n}", "best_of")


def sampling_params(*, temperature, top_p, top_k, seed, max_new: int, eos: List[int],
                    stop_ids: Optional[List[int]], top_logprobs: int, vocab: int,
                    prompt_logprobs: Optional[int] = None, max_logprobs: int = 20,
                    top_name: str = "logprobs") -> SamplingParams:
    """SamplingParams from request values, checked by the engine's request rules
    (engine/rules.py, the ones `generate` uses); a 400 naming the field otherwise. The server's
    own defaults: temperature 1, top_p 1 = off, a missing seed drawn at random; the top
    logprobs bound is --max-logprobs."""
    try:
        return rules.sampling(
            "request", max_new_tokens=max_new, vocab=vocab,
            temperature=1.0 if temperature is None else temperature, top_k=top_k,
            top_p=None if top_p == 1.0 else top_p,
            seed=secrets.randbits(63) if seed is None else seed, eos_token_ids=eos,
            stop_token_ids=stop_ids or [], top_logprobs=top_logprobs,
            max_top_logprobs=max_logprobs, prompt_logprobs=prompt_logprobs)
    except (TypeError, ValueError) as e:
        field = getattr(e, "field", None)
        param = top_name if field == "top_logprobs" else field
        msg = str(e).replace("top_logprobs", top_name) if param == top_name else str(e)
        hint = " (the server's --max-logprobs)" if "must be at most" in msg and param in (
            top_name, "prompt_logprobs") else ""
        raise ApiError(400, msg + hint, param) from None


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
