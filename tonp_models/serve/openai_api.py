"""OpenAI's /v1/completions and /v1/chat/completions (whole responses and SSE streams)."""
from __future__ import annotations

import asyncio
from typing import List, Sequence, Tuple

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from . import formats as fmt
from .calls import Call, Prompt, Sampling, ServeState, check_model, parse, start_call, state, \
    stream
from .protocol import ApiError, ChatRequest, CompletionRequest, refuse_unsupported
from .text import Detokenizer

router = APIRouter()


@router.post("/v1/completions")
async def completions(http: Request):
    st = state(http)
    body: CompletionRequest = await parse(http, CompletionRequest)
    check_model(st, body.model)
    refuse_unsupported(body)
    p = body.prompt
    prompts = [("the prompt", p)] if isinstance(p, str) else \
        [("prompt", list(p))] if not p or isinstance(p[0], int) else \
        [(f"prompt {i}", x) for i, x in enumerate(p)]
    return await _openai(st, http, body, prompts, body.max_tokens, "max_tokens",
                         body.logprobs or 0, body.logprobs is not None, chat=False)


@router.post("/v1/chat/completions")
async def chat(http: Request):
    st = state(http)
    body: ChatRequest = await parse(http, ChatRequest)
    check_model(st, body.model)
    refuse_unsupported(body)
    try:
        prompt = await asyncio.to_thread(
            st.codec.chat, [m.model_dump(exclude_none=True) for m in body.messages])
    except ValueError as e:
        raise ApiError(400, str(e), "messages") from None
    limit = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    return await _openai(st, http, body, [("messages", prompt)], limit, name,
                         body.top_logprobs or 0, body.logprobs, chat=True)


async def _openai(st: ServeState, http: Request, body, prompts: Sequence[Tuple[str, Prompt]],
                  limit, limit_name: str, top: int, want_lps: bool, chat: bool):
    s = Sampling(limit, limit_name, temperature=body.temperature, top_p=body.top_p,
                 top_k=body.top_k, seed=body.seed, ignore_eos=body.ignore_eos,
                 stop_token_ids=body.stop_token_ids, top_logprobs=top)
    rid = fmt.new_id("chatcmpl" if chat else "cmpl")
    call, lens = await start_call(st, rid, prompts, body.n, s)
    if body.stream:
        use = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_openai_stream(st, call, chat, want_lps, use, lens),
                                 media_type="text/event-stream")
    await call.run(http)
    cs = [(fmt.chat_choice if chat else fmt.completion_choice)(st.codec, c, want_lps)
          for c in call.choices]
    use = fmt.usage(call.choices, lens)
    return (fmt.chat if chat else fmt.completion)(st.model_name, rid, cs, use)


async def _openai_stream(st: ServeState, call: Call, chat: bool, want_lps: bool, use: bool,
                         lens: List[int]):
    detok = [Detokenizer(st.codec) for _ in call.choices]
    started = set()

    def chunks(c: fmt.Choice, new: slice):
        tokens, lps, tops = c.tokens[new], c.logprobs[new], c.tops[new]
        text = detok[c.index].add(tokens, final=c.finish is not None)
        if chat:
            delta = {"content": text}
            if c.index not in started:
                started.add(c.index)
                delta["role"] = "assistant"
            ch = {"index": c.index, "delta": delta, "finish_reason": fmt.openai_finish(
                c.finish), "logprobs": fmt.chat_logprobs(st.codec, tokens, lps, tops)
                if want_lps else None, "token_ids": tokens}
            yield fmt.chat(st.model_name, call.rid, [ch], None, chunk=True)
        else:
            ch = {"index": c.index, "text": text, "finish_reason": fmt.openai_finish(
                c.finish), "logprobs": fmt.completion_logprobs(st.codec, tokens, lps, tops)
                if want_lps else None, "token_ids": tokens}
            yield fmt.completion(st.model_name, call.rid, [ch], {}, chunk=True)
        if use and not call.open and c.finish is not None:
            u = fmt.usage(call.choices, lens)
            yield (fmt.chat(st.model_name, call.rid, [], u, chunk=True) if chat else
                   dict(fmt.completion(st.model_name, call.rid, [], {}, chunk=True), usage=u))
    async for line in stream(call, chunks):
        yield line
