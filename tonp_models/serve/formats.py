"""Response bodies: OpenAI completions and chat completions (whole and streamed chunks) and the
Prometheus text of /metrics (SGLang's /generate result: sglang_protocol.py).

Every choice also carries `token_ids` (the generated ids; vLLM's field), so a client can score
exactly the tokens it got; logprobs are the engine's fp32 values as JSON numbers (a float's
shortest repr round-trips exactly, so `torch.tensor(values, dtype=torch.float32)` gives the
engine's bits back).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .protocol import openai_finish
from .text import TextCodec


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
def completion_logprobs(codec: TextCodec, tokens, lps, tops, offset: int = 0) -> Dict:
    strs = [codec.token(t) for t in tokens]
    offsets, pos = [], offset
    for s in strs:
        offsets.append(pos)
        pos += len(s)
    top = None if all(t is None for t in tops) else \
        [{codec.token(i): v for i, v in (t or [])} for t in tops]
    return {"tokens": strs, "token_logprobs": list(lps), "top_logprobs": top,
            "text_offset": offsets}


def completion_choice(codec: TextCodec, c: Choice, want_logprobs: bool) -> Dict:
    return {"index": c.index, "text": codec.decode(c.tokens),
            "logprobs": completion_logprobs(codec, c.tokens, c.logprobs, c.tops)
            if want_logprobs else None,
            "finish_reason": openai_finish(c.finish), "token_ids": list(c.tokens)}


def completion(model: str, rid: str, choices: List[Dict], use: Dict, chunk: bool = False
               ) -> Dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, **({} if chunk else {"usage": use})}


# -- chat -------------------------------------------------------------------------------------
def _chat_token(codec: TextCodec, token: int, lp: float) -> Dict:
    s = codec.token(token)
    return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(codec: TextCodec, tokens, lps, tops) -> Dict:
    return {"content": [dict(_chat_token(codec, t, lp),
                             top_logprobs=[_chat_token(codec, i, v) for i, v in (top or [])])
                        for t, lp, top in zip(tokens, lps, tops)]}


def chat_choice(codec: TextCodec, c: Choice, want_logprobs: bool) -> Dict:
    return {"index": c.index, "message": {"role": "assistant", "content": codec.decode(c.tokens)},
            "logprobs": chat_logprobs(codec, c.tokens, c.logprobs, c.tops)
            if want_logprobs else None,
            "finish_reason": openai_finish(c.finish), "token_ids": list(c.tokens)}


def chat(model: str, rid: str, choices: List[Dict], use: Optional[Dict], chunk: bool = False
         ) -> Dict:
    out = {"id": rid, "object": "chat.completion.chunk" if chunk else "chat.completion",
           "created": int(time.time()), "model": model, "choices": choices}
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
