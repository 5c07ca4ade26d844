"""Response bodies: OpenAI completions and chat completions (whole and streamed chunks) and the
Prometheus text of /metrics (SGLang's /generate result: sglang_protocol.py).

Every choice also carries `token_ids` (the generated ids; vLLM's field), so a client can score
exactly the tokens it got; logprobs are the engine's fp32 values as JSON numbers (a float's
shortest repr round-trips exactly, so `torch.tensor(values, dtype=torch.float32)` gives the
engine's bits back). vLLM's extras: `prompt_token_ids` (return_token_ids), `prompt_logprobs`
(per prompt position: None, then {id: {"logprob", "rank", "decoded_token"}}), `stop_reason`,
OpenAI's `echo` (the prompt's tokens and logprobs before the completion's).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .protocol import openai_finish
from .text import StopText, TextCodec


@dataclass
class Choice:
    """What one engine request produced so far."""
    index: int
    prompt_len: int
    tokens: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    tops: List[Optional[List[Tuple[int, float]]]] = field(default_factory=list)
    finish: Optional[str] = None
    error: Optional[Exception] = None
    cache_hit: int = 0
    weight_version: int = 0     # of the weights that generated it (one per request: updates drain)
    prompt: List[int] = field(default_factory=list)
    prompt_logprobs: Optional[list] = None     # engine PromptLogprobs, positions 1..n-1
    stop: Optional[StopText] = None            # its text and stop strings, when it has some
    stop_reason: Any = None                    # vLLM's: the stop string or stop token id


@dataclass(frozen=True)
class Render:
    """How a request wants its choices written (vLLM's and OpenAI's options)."""
    logprobs: Optional[int] = None     # top logprobs per token (None: no logprobs)
    as_ids: bool = False               # return_tokens_as_token_ids: tokens as "token_id:<id>"
    skip_special: bool = True          # skip_special_tokens in the text
    token_ids: bool = False            # return_token_ids: prompt_token_ids too
    echo: bool = False                 # the prompt's tokens and logprobs first (completions)


def text_of(codec: TextCodec, c: Choice, r: Render) -> str:
    return c.stop.text if c.stop is not None else codec.decode(c.tokens, r.skip_special)


def prompt_logprobs(codec: TextCodec, c: Choice, r: Render) -> Optional[List]:
    """vLLM's prompt_logprobs: None for position 0, then {id: {"logprob", "rank",
    "decoded_token"}} with the prompt's token first, then the top k."""
    if c.prompt_logprobs is None:
        return None
    out: List[Optional[Dict]] = [None]
    for tok, p in zip(c.prompt[1:], c.prompt_logprobs):
        d = {tok: {"logprob": p.logprob, "rank": p.rank,
                   "decoded_token": codec.token(tok, r.as_ids)}}
        for rank, (i, v) in enumerate(p.top, 1):
            d.setdefault(i, {"logprob": v, "rank": rank,
                             "decoded_token": codec.token(i, r.as_ids)})
        out.append(d)
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(choices: List[Choice], prompt_lens: List[int]) -> Dict:
    """OpenAI's usage: each prompt counted once (its n choices are consecutive); its cached
    tokens are those its choices all took from the prefix cache (the choices beyond the first
    reuse the first's pages: /metrics counts that work)."""
    n = len(choices) // max(len(prompt_lens), 1)
    prompt = sum(prompt_lens)
    done = sum(len(c.tokens) for c in choices)
    cached = sum(min(c.cache_hit for c in choices[i:i + n]) for i in range(0, len(choices), n))
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": cached}}


# -- completions ------------------------------------------------------------------------------
def completion_logprobs(codec: TextCodec, tokens, lps, tops, r: Render, offset: int = 0) -> Dict:
    """OpenAI's legacy logprobs; each top_logprobs entry holds the token itself, then the top k
    (vLLM's); a None logprob (the echoed prompt's first token) has None there."""
    strs = [codec.token(t, r.as_ids) for t in tokens]
    offsets, pos = [], offset
    for s in strs:
        offsets.append(pos)
        pos += len(s)
    # the first entry of a string wins: the token's own when two ids decode alike
    top = [None if lp is None else dict(reversed([(s, lp)] + [
        (codec.token(i, r.as_ids), v) for i, v in (t or [])][:r.logprobs]))
        for s, lp, t in zip(strs, lps, tops)]
    return {"tokens": strs, "token_logprobs": list(lps), "top_logprobs": top,
            "text_offset": offsets}


def _echoed(c: Choice) -> Tuple[List, List, List]:
    """The prompt's (tokens, logprobs, tops) as echo shows them."""
    ps = c.prompt_logprobs or []
    return (list(c.prompt), [None] + [p.logprob for p in ps], [None] + [p.top for p in ps])


def completion_choice(codec: TextCodec, c: Choice, r: Render) -> Dict:
    text, tokens, lps, tops = text_of(codec, c, r), list(c.tokens), c.logprobs, c.tops
    if r.echo:
        pt, plp, ptop = _echoed(c)
        text = codec.decode(c.prompt, r.skip_special) + text
        tokens, lps, tops = pt + tokens, plp + lps, ptop + tops
    out = {"index": c.index, "text": text,
           "logprobs": completion_logprobs(codec, tokens, lps, tops, r)
           if r.logprobs is not None else None,
           "finish_reason": openai_finish(c.finish), "stop_reason": c.stop_reason,
           "token_ids": list(c.tokens)}
    if r.token_ids or c.prompt_logprobs is not None:
        out["prompt_token_ids"] = list(c.prompt)
    if c.prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs(codec, c, r)
    return out


def completion(model: str, rid: str, choices: List[Dict], use: Dict, chunk: bool = False
               ) -> Dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, **({} if chunk else {"usage": use})}


# -- chat -------------------------------------------------------------------------------------
def _chat_token(codec: TextCodec, token: int, lp: float, r: Render) -> Dict:
    s = codec.token(token, r.as_ids)
    return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(codec: TextCodec, tokens, lps, tops, r: Render) -> Dict:
    return {"content": [dict(_chat_token(codec, t, lp, r),
                             top_logprobs=[_chat_token(codec, i, v, r) for i, v in (top or [])])
                        for t, lp, top in zip(tokens, lps, tops)]}


def chat_choice(codec: TextCodec, c: Choice, r: Render) -> Dict:
    return {"index": c.index, "message": {"role": "assistant", "content": text_of(codec, c, r)},
            "logprobs": chat_logprobs(codec, c.tokens, c.logprobs, c.tops, r)
            if r.logprobs is not None else None,
            "finish_reason": openai_finish(c.finish), "stop_reason": c.stop_reason,
            "token_ids": list(c.tokens)}


def chat(model: str, rid: str, choices: List[Dict], use: Optional[Dict], chunk: bool = False,
         **extra) -> Dict:
    out = {"id": rid, "object": "chat.completion.chunk" if chunk else "chat.completion",
           "created": int(time.time()), "model": model, "choices": choices, **extra}
    if use is not None:
        out["usage"] = use
    return out


# -- metrics ----------------------------------------------------------------------------------
METRICS = [  # (snapshot key, metric name, type, help)
    ("running", "tonp_num_requests_running", "gauge", "Requests in the running batch."),
    ("waiting", "tonp_num_requests_waiting", "gauge", "Requests waiting to join the batch."),
    ("pages_used", "tonp_kv_cache_pages_used", "gauge", "KV-cache pages held by requests."),
    ("pages_total", "tonp_kv_cache_pages_total", "gauge", "KV-cache pages."),
    ("prefix_cache_pages", "tonp_prefix_cache_pages", "gauge",
     "Pages indexed by the prefix cache (held or evictable)."),
    ("cache_hit_rate", "tonp_prefix_cache_hit_rate", "gauge",
     "Admitted context tokens taken from the prefix cache / all admitted context tokens."),
    ("tokens_per_s", "tonp_generation_tokens_per_second", "gauge",
     "Generated tokens per second over the last 10 s."),
    ("prompt_tokens", "tonp_prompt_tokens_total", "counter", "Prompt tokens of requests."),
    ("cached_tokens", "tonp_prefix_cache_hit_tokens_total", "counter",
     "Context tokens taken from the prefix cache."),
    ("prefill_tokens", "tonp_prefill_tokens_total", "counter", "Tokens fed in prefill."),
    ("decode_tokens", "tonp_decode_tokens_total", "counter", "Tokens fed in decode."),
    ("generation_tokens", "tonp_generation_tokens_total", "counter", "Generated tokens."),
    ("forward_steps", "tonp_forward_steps_total", "counter", "Model forwards."),
    ("preemptions", "tonp_preemptions_total", "counter", "Requests preempted for pages."),
    ("weight_version", "tonp_weight_version", "gauge", "Successful weight updates so far."),
]


def prometheus(snap: Dict[str, float]) -> str:
    lines = []
    for key, name, kind, text in METRICS:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {snap[key]}"]
    lines += ["# HELP tonp_requests_finished_total Finished requests by reason.",
              "# TYPE tonp_requests_finished_total counter"]
    for key, v in sorted(snap.items()):
        if key.startswith("finished_"):
            lines.append(f'tonp_requests_finished_total{{reason="{key[9:]}"}} {v}')
    return "\n".join(lines) + "\n"
