"""The HTTP routes (FastAPI): OpenAI completions and chat completions, SGLang's token-id
/generate, /v1/models, /health, /metrics and /update_weights, over an `EngineService`.

Each HTTP request becomes one engine request per prompt and choice; their outputs come back from
the engine thread through an asyncio queue. A client that disconnects (mid-stream or while a
whole response is pending) gets its engine requests aborted: their slots and pages are freed.
Every error is a JSON body {"error": {"message", "type", "param", "code"}} with a 4xx status
when the request was at fault, and the server keeps serving.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from ..engine import Request, SamplingParams
from . import formats as fmt
from .protocol import (ApiError, ChatRequest, CompletionRequest, GenerateRequest,
                       UpdateWeightsRequest, check_n, max_new_tokens, refuse_unsupported,
                       sampling_params)
from .service import EngineService
from .text import Detokenizer, TextCodec


@dataclass
class ServeState:
    service: EngineService
    codec: TextCodec
    model_name: str
    context: int          # prompt + max tokens at most
    vocab: int
    eos: List[int]        # default end-of-sequence ids (the config's and the tokenizer's)
    max_n: int
    ids: Any = None

    def __post_init__(self):
        self.ids = itertools.count()


async def parse(http: HttpRequest, model: type) -> BaseModel:
    """The JSON body as `model`; a 400 naming the first problem (malformed JSON, unknown field,
    wrong type) otherwise."""
    raw = await http.body()
    try:
        return model.model_validate_json(raw or b"null")
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("list[", "str")))
        if err["type"] == "json_invalid":
            raise ApiError(400, f"malformed JSON body: {err['msg']}") from None
        if err["type"] == "extra_forbidden":
            raise ApiError(400, f"unknown field {where!r}", where) from None
        got = json.dumps(err.get("input"))[:80]
        raise ApiError(400, f"{where or 'body'}: {err['msg']} (got {got})", where) from None


class _Call:
    """The engine requests of one HTTP request and their outputs, in `choices`."""

    def __init__(self, st: ServeState, rid: str, prompts: List[List[int]],
                 params: List[SamplingParams], noise_keys: List[int]):
        self.st, self.rid = st, rid
        if not st.service.healthy:
            raise ApiError(503, f"the server cannot generate: {st.service.error}")
        self.choices = [fmt.Choice(i, len(p)) for i, p in enumerate(prompts)]
        reqs = [Request(next(st.ids), list(p), s, noise_key=k, name=f"{rid} choice {i}")
                for i, (p, s, k) in enumerate(zip(prompts, params, noise_keys))]
        for r in reqs:
            try:
                st.service.engine.check(r)
            except (ValueError, IndexError, RuntimeError) as e:
                raise ApiError(400, str(e), "prompt") from None
        self.index = {r.key: i for i, r in enumerate(reqs)}
        self.open = set(self.index)
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(out):  # on the engine thread: hand a copy of the news to the event loop
            news = (out.request.key, out.token, out.logprob, out.top_logprobs, out.finish,
                    out.request.error, out.request.cache_hit, st.service.weight_version)
            with contextlib.suppress(RuntimeError):       # the loop closed: nobody listens
                loop.call_soon_threadsafe(self.queue.put_nowait, news)
        try:
            st.service.submit(reqs, sink)
        except RuntimeError as e:
            raise ApiError(503, str(e)) from None

    async def updates(self, http: Optional[HttpRequest]) -> AsyncIterator[fmt.Choice]:
        """Each choice as it gets a token or ends, until all have ended. With `http`, a client
        that went away ends the call (its requests are aborted by `abort`)."""
        checked = time.monotonic()
        while self.open:
            if http is not None and time.monotonic() - checked > 0.1:
                if await http.is_disconnected():
                    return
                checked = time.monotonic()
            try:
                key, tok, lp, top, finish, err, hit, version = \
                    await asyncio.wait_for(self.queue.get(), 0.1)
            except asyncio.TimeoutError:
                continue
            c = self.choices[self.index[key]]
            c.cache_hit, c.weight_version = hit, version
            if tok is not None:
                c.tokens.append(tok)
                c.logprobs.append(lp)
                c.tops.append(top)
            if finish:
                c.finish, c.error = finish, err
                self.open.discard(key)
            yield c

    def abort(self) -> None:
        if self.open:
            self.st.service.abort(sorted(self.open))
            self.open.clear()

    def raise_errors(self) -> None:
        for c in self.choices:
            if c.error is not None:
                status = 400 if isinstance(c.error, ValueError) else 500
                raise ApiError(status, str(c.error))
            if c.finish == "abort":
                raise ApiError(503, "the server is shutting down: the request was cancelled")

    async def run(self, http: HttpRequest) -> None:
        try:
            async for _ in self.updates(http):
                pass
        finally:
            self.abort()
        self.raise_errors()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _stream_error(c: fmt.Choice) -> Dict:
    return {"error": {"message": str(c.error), "type": "invalid_request_error"
                      if isinstance(c.error, ValueError) else "server_error",
                      "code": 400 if isinstance(c.error, ValueError) else 500}}


async def _stream(call: _Call, chunks) -> AsyncIterator[str]:
    """SSE lines: chunks(choice, new tokens) per update, errors, then [DONE]; aborts on exit."""
    try:
        sent = [0] * len(call.choices)
        async for c in call.updates(None):
            new = slice(sent[c.index], len(c.tokens))
            sent[c.index] = len(c.tokens)
            if c.error is not None:
                yield _sse(_stream_error(c))
                continue
            for obj in chunks(c, new):
                yield _sse(obj)
        yield "data: [DONE]\n\n"
    finally:
        call.abort()


def create_app(st: ServeState, ready: Optional[str] = None,
               stopping: Optional[Callable[[], bool]] = None, grace: float = 10.0) -> FastAPI:
    """The FastAPI app over a started EngineService (shut down when the app stops); `ready` is
    printed (flushed) when the app has started. Once `stopping()` turns true (the server got
    SIGINT / SIGTERM), running requests have `grace` seconds, then every request left is aborted:
    streams end with finish_reason "abort" and [DONE], whole responses with a 503."""

    async def cancel_after_grace():
        while not stopping():
            await asyncio.sleep(0.05)
        await asyncio.sleep(grace)
        st.service.abort_all()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if ready:
            print(ready, flush=True)
        watch = asyncio.create_task(cancel_after_grace()) if stopping else None
        yield
        if watch is not None:
            watch.cancel()
        await asyncio.to_thread(st.service.shutdown)

    app = FastAPI(title="tonp rollout service", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        return JSONResponse({"error": {"message": e.message, "type": kind, "param": e.param,
                                       "code": e.status}}, status_code=e.status)

    def check_model(name: Optional[str]) -> None:
        if name not in (None, st.model_name):
            raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                                f"{st.model_name!r}", "model")

    def eos(ignore: bool) -> List[int]:
        return [] if ignore else st.eos

    def encode(text: str, what: str) -> List[int]:
        try:
            return st.codec.encode(text, what)
        except ValueError as e:
            raise ApiError(400, str(e), "prompt") from None

    @app.get("/health")
    async def health():
        s = st.service
        if not s.healthy:
            return JSONResponse({"status": "error", "error": s.error}, status_code=503)
        return {"status": "ok", "weight_version": s.weight_version}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": st.model_name, "object": "model", "created": 0, "owned_by": "tonp",
            "max_model_len": st.context, "weight_version": st.service.weight_version}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(fmt.prometheus(st.service.snapshot()))

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        body: CompletionRequest = await parse(http, CompletionRequest)
        check_model(body.model)
        refuse_unsupported(body)
        p = body.prompt
        prompts = [encode(p, "the prompt")] if isinstance(p, str) else \
            [list(p)] if not p or isinstance(p[0], int) else \
            [encode(x, f"prompt {i}") if isinstance(x, str) else list(x)
             for i, x in enumerate(p)]
        return await _openai(http, body, prompts, body.max_tokens, "max_tokens",
                             body.logprobs or 0, body.logprobs is not None, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest):
        body: ChatRequest = await parse(http, ChatRequest)
        check_model(body.model)
        refuse_unsupported(body)
        try:
            prompt = st.codec.chat([m.model_dump(exclude_none=True) for m in body.messages])
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        limit = body.max_completion_tokens if body.max_completion_tokens is not None \
            else body.max_tokens
        name = "max_completion_tokens" if body.max_completion_tokens is not None \
            else "max_tokens"
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        return await _openai(http, body, [prompt], limit, name, body.top_logprobs or 0,
                             body.logprobs, chat=True)

    async def _openai(http, body, prompts, limit, limit_name, top, want_lps, chat):
        check_n(body.n, len(prompts), st.max_n)
        seed = body.seed
        reqs, params, keys = [], [], []
        for p in prompts:
            new = max_new_tokens(limit, len(p), st.context, limit_name)
            s = sampling_params(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                seed=seed, max_new=new, eos=eos(body.ignore_eos),
                                stop_ids=body.stop_token_ids, top_logprobs=top, vocab=st.vocab)
            seed = s.seed        # every prompt and choice of a request shares one seed
            for _ in range(body.n):
                reqs.append(p)
                params.append(s)
                keys.append(len(keys))      # noise key: the choice index
        rid = fmt.new_id("chatcmpl" if chat else "cmpl")
        call = _Call(st, rid, reqs, params, keys)
        lens = [len(p) for p in prompts]
        if body.stream:
            use = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_openai_stream(call, chat, want_lps, use, lens),
                                     media_type="text/event-stream")
        await call.run(http)
        cs = [(fmt.chat_choice if chat else fmt.completion_choice)(st.codec, c, want_lps)
              for c in call.choices]
        use = fmt.usage(call.choices, lens)
        return (fmt.chat if chat else fmt.completion)(st.model_name, rid, cs, use)

    async def _openai_stream(call: _Call, chat: bool, want_lps: bool, use: bool, lens):
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
                       dict(fmt.completion(st.model_name, call.rid, [], {}, chunk=True),
                            usage=u))
        async for line in _stream(call, chunks):
            yield line

    @app.post("/generate")
    async def generate(http: HttpRequest):
        body: GenerateRequest = await parse(http, GenerateRequest)
        sp = body.sampling_params
        if (body.input_ids is None) == (body.text is None):
            raise ApiError(400, "give exactly one of input_ids and text", "input_ids")
        batch = isinstance(body.text, list) or (body.input_ids is not None and bool(
            body.input_ids) and isinstance(body.input_ids[0], list))
        if body.text is not None:
            texts = body.text if batch else [body.text]
            prompts = [encode(t, f"text {i}") for i, t in enumerate(texts)]
        else:
            prompts = body.input_ids if batch else [body.input_ids]
        check_n(sp.n, len(prompts), st.max_n)
        n_req = len(prompts) * sp.n
        keys = body.request_ids if body.request_ids is not None else list(range(n_req))
        if len(keys) != n_req or len(set(keys)) != n_req or min(keys, default=0) < 0:
            raise ApiError(400, f"request_ids must be {n_req} distinct ints >= 0 (one per "
                                f"prompt and sample), got {body.request_ids}", "request_ids")
        seed, reqs, params = sp.seed, [], []
        for p in prompts:
            new = max_new_tokens(sp.max_new_tokens, len(p), st.context, "max_new_tokens")
            s = sampling_params(temperature=sp.temperature, top_p=sp.top_p,
                                top_k=None if sp.top_k == -1 else sp.top_k, seed=seed,
                                max_new=new, eos=eos(sp.ignore_eos), stop_ids=sp.stop_token_ids,
                                top_logprobs=body.top_logprobs_num, vocab=st.vocab)
            seed = s.seed
            reqs += [list(p)] * sp.n
            params += [s] * sp.n
        rid = fmt.new_id("gen")
        call = _Call(st, rid, reqs, params, keys)
        if body.stream:
            def chunks(c: fmt.Choice, new: slice):
                yield fmt.generate_result(st.codec, c, rid, logprobs=body.return_logprob,
                                          tokens=c.tokens[new], lps=c.logprobs[new],
                                          tops=c.tops[new])
            return StreamingResponse(_stream(call, chunks), media_type="text/event-stream")
        await call.run(http)
        out = [fmt.generate_result(st.codec, c, rid, logprobs=body.return_logprob)
               for c in call.choices]
        return out if batch or sp.n > 1 else out[0]

    @app.post("/update_weights")
    @app.post("/update_weights_from_disk")
    async def update_weights(http: HttpRequest):
        body: UpdateWeightsRequest = await parse(http, UpdateWeightsRequest)
        t0 = time.perf_counter()
        try:
            fut = st.service.update_weights(body.model_path)
        except RuntimeError as e:
            raise ApiError(503, str(e)) from None
        ok, message = await asyncio.wrap_future(fut)
        status = 200 if ok else 400 if st.service.healthy else 500
        return JSONResponse({"success": ok, "message": message,
                             "weight_version": st.service.weight_version,
                             "seconds": time.perf_counter() - t0}, status_code=status)

    return app
