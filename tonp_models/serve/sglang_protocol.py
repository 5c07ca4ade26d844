"""SGLang's /generate body (its GenerateReqInput and sampling_params) and result, as tonp reads
and writes them.

Every field SGLang's clients send is known. A null is the field's default (as SGLang reads
it). A feature tonp does not implement (penalties, min_p, grammars, LoRA, ...) is accepted at
its neutral value and refused by name at any other (400), never silently ignored.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

from . import formats as fmt
from .calls import Sampling
from .protocol import ApiError, Body
from .text import TextCodec

PerPrompt = Union[Any, List[Any]]   # one value for every prompt, or a list with one per prompt


class SGLangSampling(Body):
    """SGLang's sampling_params. tonp's own: `seed` (with the position-keyed noise of
    tonp's `request_ids`; give one of seed and sampling_seed)."""
    max_new_tokens: Optional[int] = 128
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None                 # -1 (or null): no top-k
    min_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_new_tokens: Optional[int] = None
    n: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    stop_regex: Optional[Union[str, List[str]]] = None
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    no_stop_trim: Optional[bool] = None
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None
    custom_params: Optional[Dict[str, Any]] = None
    stream_interval: Optional[int] = None
    logit_bias: Optional[Dict[str, float]] = None
    sampling_seed: Optional[int] = None
    seed: Optional[int] = None


class SGLangGenerate(Body):
    """SGLang's GenerateReqInput (the fields its clients send). tonp's own: request_ids, the
    noise key of each prompt x sample (so a batch reproduces `generate(..., request_ids=...)`)."""
    text: Optional[Union[str, List[str]]] = None
    input_ids: Optional[Union[List[int], List[List[int]]]] = None
    sampling_params: Optional[Union[SGLangSampling, List[SGLangSampling]]] = None
    return_logprob: Optional[Union[bool, List[bool]]] = None
    logprob_start_len: Optional[Union[int, List[int]]] = None
    top_logprobs_num: Optional[Union[int, List[int]]] = None
    token_ids_logprob: Optional[List[Any]] = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: Optional[Union[str, List[str]]] = None
    request_ids: Optional[List[int]] = None
    return_prompt_token_ids: bool = False
    log_metrics: bool = True
    no_logs: bool = False
    # Features tonp does not implement: accepted at their neutral value only.
    input_embeds: Optional[List[Any]] = None
    image_data: Optional[Any] = None
    video_data: Optional[Any] = None
    audio_data: Optional[Any] = None
    modalities: Optional[List[Any]] = None
    lora_path: Optional[Union[str, List[Optional[str]]]] = None
    lora_id: Optional[Union[str, List[Optional[str]]]] = None
    custom_logit_processor: Optional[Union[str, List[Optional[str]]]] = None
    return_hidden_states: Union[bool, List[bool]] = False
    return_routed_experts: bool = False
    return_entropy: bool = False
    session_params: Optional[Dict[str, Any]] = None
    routed_dp_rank: Optional[int] = None
    data_parallel_rank: Optional[int] = None
    priority: Optional[int] = None
    extra_key: Optional[Union[str, List[str]]] = None
    cache_salt: Optional[Union[str, List[str]]] = None
    bootstrap_host: Optional[Any] = None
    bootstrap_port: Optional[Any] = None
    bootstrap_room: Optional[Any] = None


class AbortRequest(Body):
    """SGLang's /abort_request: one request by its `rid`, or every /generate request."""
    rid: Optional[str] = ""
    abort_all: bool = False
    finished_reason: Optional[Dict[str, Any]] = None
    abort_message: Optional[str] = None


def _unset(v) -> bool:
    return v in (None, "", False) or v == [] or v == {} or \
        (isinstance(v, list) and all(_unset(x) for x in v))


def refuse_non_neutral(body: SGLangGenerate, sps: List[SGLangSampling]) -> None:
    """400 naming the first field set to a value that would change what tonp does not do."""
    for name in ("input_embeds", "image_data", "video_data", "audio_data", "modalities",
                 "lora_path", "lora_id", "custom_logit_processor", "return_hidden_states",
                 "return_routed_experts", "return_entropy", "session_params", "routed_dp_rank",
                 "data_parallel_rank", "priority", "extra_key", "cache_salt", "bootstrap_host",
                 "bootstrap_port", "bootstrap_room", "token_ids_logprob"):
        if not _unset(getattr(body, name)):
            raise ApiError(400, f"{name} is not supported by this server", name)
    neutral = {"min_p": (0,), "frequency_penalty": (0,), "presence_penalty": (0,),
               "repetition_penalty": (1,), "min_new_tokens": (0,), "stream_interval": (1,),
               "spaces_between_special_tokens": (True,)}
    for sp in sps:
        for name, ok in neutral.items():
            v = getattr(sp, name)
            if v is not None and v not in ok:
                raise ApiError(400, f"sampling_params.{name}={v!r} is not supported by this "
                                    f"server (only {ok[0]!r})", f"sampling_params.{name}")
        for name in ("stop_regex", "json_schema", "regex", "ebnf", "structural_tag",
                     "custom_params", "logit_bias"):
            if not _unset(getattr(sp, name)):
                raise ApiError(400, f"sampling_params.{name} is not supported by this server",
                               f"sampling_params.{name}")
        if sp.seed is not None and sp.sampling_seed is not None:
            raise ApiError(400, "give one of sampling_params.seed (tonp's) and "
                                "sampling_params.sampling_seed (SGLang's)",
                           "sampling_params.sampling_seed")
        if sp.top_k is not None and sp.top_k != -1 and sp.top_k < 1:
            raise ApiError(400, f"sampling_params.top_k must be -1 (off) or >= 1, got "
                                f"{sp.top_k}", "sampling_params.top_k")


def per_prompt(value: PerPrompt, default, count: int, n: int, name: str) -> List:
    """SGLang's per-prompt fields: a value for every prompt, or a list of `count` (not with
    n > 1, as SGLang)."""
    if value is None:
        return [default] * count
    if not isinstance(value, list):
        return [value] * count
    if n > 1:
        raise ApiError(400, f"{name} as a list (one per prompt) cannot go with n > 1", name)
    if len(value) != count:
        raise ApiError(400, f"{name} has {len(value)} entries for {count} prompt(s)", name)
    return [default if v is None else v for v in value]


def sampling(sp: SGLangSampling, top: int, stop: Optional[List[str]] = None,
             prompt_logprobs: Optional[int] = None) -> Sampling:
    """tonp's Sampling from SGLang's sampling_params (defaults for nulls); stop: the checked
    stop strings (SGLang's semantics are vLLM's: text.StopText, no_stop_trim = include)."""
    return Sampling(sp.max_new_tokens, "max_new_tokens",
                    temperature=1.0 if sp.temperature is None else sp.temperature,
                    top_p=sp.top_p, top_k=None if sp.top_k in (None, -1) else sp.top_k,
                    seed=sp.seed if sp.sampling_seed is None else sp.sampling_seed,
                    ignore_eos=bool(sp.ignore_eos), stop_token_ids=sp.stop_token_ids,
                    top_logprobs=top, top_name="top_logprobs_num",
                    prompt_logprobs=prompt_logprobs, stop=stop,
                    include_stop=bool(sp.no_stop_trim),
                    skip_special=sp.skip_special_tokens is not False)


# -- the result --------------------------------------------------------------------------------
def _entries(codec: TextCodec, pairs, text: bool) -> List[list]:
    """SGLang's logprob entries: [logprob, token_id, the token's text or None]."""
    return [[lp, t, codec.token(t) if text else None] for lp, t in pairs]


def result(codec: TextCodec, c: fmt.Choice, rid: str, *, logprobs: bool, text_in_lps: bool,
           top: int, skip_special: bool, no_stop_trim: bool, start: int,
           prompt_ids: bool = False) -> Dict:
    """One prompt's result so far (SGLang streams the whole result so far each time). start:
    the first prompt position of input_token_logprobs (len(prompt): none)."""
    done = c.finish is not None
    reason = None
    if done:
        kind = fmt.openai_finish(c.finish)
        reason = {"type": kind}
        if c.finish in ("eos", "stop") and c.tokens:
            reason["matched"] = c.stop_reason if isinstance(c.stop_reason, str) else c.tokens[-1]
        elif c.finish == "length":
            reason["length"] = len(c.tokens)
        elif c.finish == "abort":
            reason["message"] = "Aborted"
        elif c.error is not None:
            reason["message"] = str(c.error)
    if c.stop is not None and (not done or isinstance(c.stop_reason, str)):
        text = c.stop.visible(done)      # cut at the stop string (through it: no_stop_trim)
    else:
        shown = c.tokens
        if reason is not None and "matched" in reason and not no_stop_trim:
            shown = c.tokens[:-1]        # SGLang trims the matched stop token from the text
        text = codec.decode(shown, skip_special_tokens=skip_special)
        if not done and text.endswith("\ufffd"):
            text = text[:-1]             # an incomplete UTF-8 character: the next token ends it
    meta = {"id": rid, "finish_reason": reason, "prompt_tokens": c.prompt_len,
            "completion_tokens": len(c.tokens), "cached_tokens": c.cache_hit,
            "weight_version": c.weight_version}
    if logprobs:
        plp, ids = c.prompt_logprobs or [], c.prompt
        at = range(start, len(ids))     # plp has positions 1.. when start < len(ids) - 1
        # SGLang's: position `start` has no logprob (None), as position 0 has none
        meta["input_token_logprobs"] = _entries(
            codec, [(None if i == start else plp[i - 1].logprob, ids[i]) for i in at],
            text_in_lps)
        meta["output_token_logprobs"] = _entries(codec, zip(c.logprobs, c.tokens), text_in_lps)
        if top:
            meta["input_top_logprobs"] = [None if i == start else _entries(
                codec, [(v, t) for t, v in plp[i - 1].top], text_in_lps) for i in at]
            meta["output_top_logprobs"] = [_entries(codec, [(v, i) for i, v in t or []],
                                                    text_in_lps) for t in c.tops]
    out = {"index": c.index, "text": text, "output_ids": list(c.tokens), "meta_info": meta}
    if prompt_ids:
        out["prompt_token_ids"] = list(c.prompt)
    return out
