"""OpenAI's /v1/completions and /v1/chat/completions in vLLM's dialect (whole responses and
SSE streams): vLLM's sampling extras (neutral values only where tonp does not implement them:
protocol.NEUTRAL), `return_token_ids`, `return_tokens_as_token_ids`, `prompt_logprobs`, OpenAI's
`echo` with `logprobs`, and `stop` strings with vLLM's semantics (calls.Call, text.StopText)."""
from __future__ import annotations

import asyncio
from typing import List, Optional, Sequence, Tuple

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from . import formats as fmt
from .calls import Call, Prompt, Sampling, ServeState, check_model, check_text, parse, \
    start_call, state, stop_strings, stream
from .protocol import ApiError, ChatRequest, CompletionRequest, refuse_unsupported
from .text import Detokenizer

router = APIRouter()


async def _admit(http: Request, model):
    """The server's state and the body parsed as `model`, for this server's model name, with
    vLLM's unimplemented extras at neutral values (else 400 naming the field)."""
    st = state(http)
    body = await parse(http, model)
    check_model(st, body.model)
    refuse_unsupported(body)
    return st, body


@router.post("/v1/completions")
async def completions(http: Request):
    st, body = await _admit(http, CompletionRequest)
    p = body.prompt
    prompts = [("the prompt", p)] if isinstance(p, str) else \
        [("prompt", list(p))] if not p or isinstance(p[0], int) else \
        [(f"prompt {i}", x) for i, x in enumerate(p)]
    for what, x in prompts:       # every text bounded before any is tokenized
        if isinstance(x, str):
            check_text(st, x, what)
    plp = body.prompt_logprobs
    if body.echo:
        if body.logprobs is not None and plp is None:
            plp = body.logprobs   # vLLM: echo scores the prompt with logprobs' top k
    render = fmt.Render(logprobs=body.logprobs, as_ids=bool(body.return_tokens_as_token_ids),
                        skip_special=body.skip_special_tokens,
                        token_ids=bool(body.return_token_ids), echo=bool(body.echo))
    return await _openai(st, http, body, prompts, body.max_tokens, "max_tokens",
                         body.logprobs or 0, "logprobs", plp, render, chat=False)


@router.post("/v1/chat/completions")
async def chat(http: Request):
    st, body = await _admit(http, ChatRequest)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    check_text(st, "".join(str(m.get("content", "")) for m in messages), "the messages",
               "messages")
    try:
        prompt = await asyncio.to_thread(st.codec.chat, messages, body.add_special_tokens,
                                         **(body.chat_template_kwargs or {}))
    except (ValueError, TypeError) as e:
        raise ApiError(400, str(e), "messages") from None
    limit = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    render = fmt.Render(logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                        as_ids=bool(body.return_tokens_as_token_ids),
                        skip_special=body.skip_special_tokens,
                        token_ids=bool(body.return_token_ids))
    return await _openai(st, http, body, [("messages", prompt)], limit, name,
                         body.top_logprobs or 0, "top_logprobs", body.prompt_logprobs, render,
                         chat=True)


async def _openai(st: ServeState, http: Request, body, prompts: Sequence[Tuple[str, Prompt]],
                  limit, limit_name: str, top: int, top_name: str, plp: Optional[int],
                  render: fmt.Render, chat: bool):
    if body.stream and (plp is not None or render.echo):
        what = "echo" if render.echo else "prompt_logprobs"
        raise ApiError(400, f"{what} is not available when stream=true", what)
    top_k = None if body.top_k in (0, -1) else body.top_k          # vLLM: 0 and -1 are off
    s = Sampling(limit, limit_name, temperature=body.temperature, top_p=body.top_p,
                 top_k=top_k, seed=body.seed, ignore_eos=body.ignore_eos,
                 stop_token_ids=body.stop_token_ids, top_logprobs=top, top_name=top_name,
                 prompt_logprobs=plp, stop=stop_strings(st, body.stop),
                 include_stop=body.include_stop_str_in_output,
                 skip_special=body.skip_special_tokens,
                 add_special=getattr(body, "add_special_tokens", False))
    rid = fmt.new_id("chatcmpl" if chat else "cmpl")
    call, lens = await start_call(st, rid, prompts, 1 if body.n is None else body.n, s)
    if body.stream:
        use = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_openai_stream(st, call, chat, render, use, lens),
                                 media_type="text/event-stream")
    await call.run(http)
    cs = [(fmt.chat_choice if chat else fmt.completion_choice)(st.codec, c, render)
          for c in call.choices]
    use = fmt.usage(call.choices, lens)
    if not chat:
        return fmt.completion(st.model_name, rid, cs, use)
    first = call.choices[0]    # one prompt: vLLM puts its ids and logprobs on the response
    extra = {"prompt_token_ids": first.prompt} if render.token_ids else {}
    if first.prompt_logprobs is not None:
        extra["prompt_logprobs"] = fmt.prompt_logprobs(st.codec, first, render)
    return fmt.chat(st.model_name, rid, cs, use, **extra)


async def _openai_stream(st: ServeState, call: Call, chat: bool, r: fmt.Render, use: bool,
                         lens: List[int]):
    detok = [Detokenizer(st.codec, r.skip_special) for _ in call.choices]
    sent = [0] * len(call.choices)       # characters of a stop-string choice's text sent
    started = set()

    def chunks(c: fmt.Choice, new: slice):
        tokens, lps, tops = c.tokens[new], c.logprobs[new], c.tops[new]
        done = c.finish is not None
        if c.stop is not None:
            shown = c.stop.visible(done)
            text, sent[c.index] = shown[sent[c.index]:], len(shown)
        else:
            text = detok[c.index].add(tokens, final=done)
        first = c.index not in started
        started.add(c.index)
        ids = {"prompt_token_ids": c.prompt} if first and r.token_ids else {}
        if chat:
            delta = {"content": text}
            if first:
                delta["role"] = "assistant"
            ch = {"index": c.index, "delta": delta, "finish_reason": fmt.openai_finish(
                c.finish), "stop_reason": c.stop_reason, "logprobs": fmt.chat_logprobs(
                st.codec, tokens, lps, tops, r) if r.logprobs is not None else None,
                "token_ids": tokens, **ids}
            yield fmt.chat(st.model_name, call.rid, [ch], None, chunk=True)
        else:
            ch = {"index": c.index, "text": text, "finish_reason": fmt.openai_finish(
                c.finish), "stop_reason": c.stop_reason, "logprobs": fmt.completion_logprobs(
                st.codec, tokens, lps, tops, r) if r.logprobs is not None else None,
                "token_ids": tokens, **ids}
            yield fmt.completion(st.model_name, call.rid, [ch], {}, chunk=True)
        if use and not call.open and c.finish is not None:
            u = fmt.usage(call.choices, lens)
            yield (fmt.chat(st.model_name, call.rid, [], u, chunk=True) if chat else
                   dict(fmt.completion(st.model_name, call.rid, [], {}, chunk=True), usage=u))
    async for line in stream(call, chunks):
        yield line
