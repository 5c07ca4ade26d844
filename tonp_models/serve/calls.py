"""What every generating endpoint shares: the server's state, the body parser, the one prompt ->
engine-request builder (`start_call`) and `Call`, the engine requests of one HTTP request with
their outputs coming back from the engine thread through an asyncio queue.

A client that disconnects (mid-stream or while a whole response is pending) gets its engine
requests aborted: their slots and pages are freed.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Tuple, Union

from fastapi import Request as HttpRequest
from pydantic import BaseModel, ValidationError

from ..engine import Request, SamplingParams
from . import formats as fmt
from .protocol import ApiError, check_n, max_new_tokens, sampling_params
from .service import EngineService
from .text import TextCodec

Prompt = Union[str, List[int]]      # text (tokenized by the server) or token ids


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


def state(http: HttpRequest) -> ServeState:
    return http.app.state.serve


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


def check_model(st: ServeState, name: Optional[str]) -> None:
    if name not in (None, st.model_name):
        raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                            f"{st.model_name!r}", "model")


@dataclass
class Sampling:
    """A request's sampling values, as its dialect named them (checked by `sampling_params`).
    limit: the max new tokens asked (None: what the context leaves), `limit_name` its field."""
    limit: Optional[int]
    limit_name: str
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None       # None: no top-k
    seed: Optional[int] = None
    ignore_eos: bool = False
    stop_token_ids: Optional[List[int]] = None
    top_logprobs: int = 0


async def encode(st: ServeState, text: str, what: str) -> List[int]:
    """Text -> token ids, off the event loop (a long prompt does not stall other requests)."""
    try:
        return await asyncio.to_thread(st.codec.encode, text, what)
    except ValueError as e:
        raise ApiError(400, str(e), "prompt") from None


async def start_call(st: ServeState, rid: str, prompts: Sequence[Tuple[str, Prompt]], n: int,
                     s: Sampling, keys: Optional[List[int]] = None,
                     keys_name: str = "request_ids") -> Tuple["Call", List[int]]:
    """The one way a body becomes engine requests: each (name, prompt) to token ids, n choices
    each (consecutive), every value checked (400 naming it), queued. keys: the noise key of each
    sequence (default 0..); every prompt and choice shares one seed. -> (call, prompt lengths)."""
    ids = [await encode(st, p, what) if isinstance(p, str) else list(p) for what, p in prompts]
    check_n(n, len(ids), st.max_n)
    n_req = len(ids) * n
    given = keys
    keys = list(range(n_req)) if keys is None else keys
    if len(keys) != n_req or len(set(keys)) != n_req or min(keys, default=0) < 0:
        raise ApiError(400, f"{keys_name} must be {n_req} distinct ints >= 0 (one per "
                            f"prompt and sample), got {given}", keys_name)
    seed, reqs, params = s.seed, [], []
    for p in ids:
        new = max_new_tokens(s.limit, len(p), st.context, s.limit_name)
        sp = sampling_params(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=seed,
                             max_new=new, eos=[] if s.ignore_eos else st.eos,
                             stop_ids=s.stop_token_ids, top_logprobs=s.top_logprobs,
                             vocab=st.vocab)
        seed = sp.seed
        reqs += [p] * n
        params += [sp] * n
    return Call(st, rid, reqs, params, keys), [len(p) for p in ids]


class Call:
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


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _stream_error(c: fmt.Choice) -> Dict:
    return {"error": {"message": str(c.error), "type": "invalid_request_error"
                      if isinstance(c.error, ValueError) else "server_error",
                      "code": 400 if isinstance(c.error, ValueError) else 500}}


async def stream(call: Call, chunks: Callable) -> AsyncIterator[str]:
    """SSE lines: chunks(choice, new tokens) per update, errors, then [DONE]; aborts on exit."""
    try:
        sent = [0] * len(call.choices)
        async for c in call.updates(None):
            new = slice(sent[c.index], len(c.tokens))
            sent[c.index] = len(c.tokens)
            if c.error is not None:
                yield sse(_stream_error(c))
                continue
            for obj in chunks(c, new):
                yield sse(obj)
        yield "data: [DONE]\n\n"
    finally:
        call.abort()
