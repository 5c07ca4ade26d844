"""What every generating endpoint shares: the server's state, the body parser, the one prompt ->
engine-request builder (`start_call`) and `Call`, the engine requests of one HTTP request with
their outputs coming back from the engine thread through an asyncio queue.

A client that disconnects (mid-stream or while a whole response is pending) gets its engine
requests aborted: their slots and pages are freed; so does a choice once its text completes one
of its stop strings (text.StopText: its tokens and logprobs end with the token that did).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Tuple, Union

from fastapi import Request as HttpRequest
from pydantic import BaseModel, ValidationError

from ..engine import Request, SamplingParams, rules
from . import formats as fmt
from .protocol import ApiError, check_n, max_new_tokens, sampling_params
from .security import Security, error_body, incident
from .service import EngineService
from .text import StopText, TextCodec

Prompt = Union[str, List[int]]      # text (tokenized by the server) or token ids
Keys = Union[None, List[int], Callable[[List[List[int]], int], List[int]]]


@dataclass
class ServeState:
    service: EngineService
    codec: TextCodec
    model_name: str
    context: int          # prompt + max tokens at most
    vocab: int
    eos: List[int]        # default end-of-sequence ids (the config's and the tokenizer's)
    max_n: int
    max_logprobs: int = 20            # top / prompt logprobs a request may ask for
    max_prompt_chars: Optional[int] = None   # a text prompt's characters (None: 32 x context)
    ids: Any = None
    security: Security = field(default_factory=Security)   # what security.Guard enforces

    def __post_init__(self):
        self.ids = itertools.count()
        if self.max_prompt_chars is None:
            self.max_prompt_chars = 32 * self.context


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
    top_name: str = "logprobs"
    prompt_logprobs: Optional[int] = None    # also score the prompt, with its top k
    stop: Optional[List[str]] = None         # stop strings (vLLM's semantics: text.StopText)
    include_stop: bool = False
    skip_special: bool = True
    add_special: bool = False                # tokenize text prompts with special tokens


MAX_STOPS = 64


def check_text(st: ServeState, text: str, what: str, param: str = "prompt") -> None:
    """The prompt-length bound, checked before any tokenizing (a token has >= 1 character)."""
    if len(text) > st.max_prompt_chars:
        raise ApiError(400, f"{what} has {len(text)} characters, over the server's limit of "
                            f"{st.max_prompt_chars} (--max-prompt-chars)", param)


def stop_strings(st: ServeState, stop) -> Optional[List[str]]:
    """The request's stop strings, checked: non-empty, at most MAX_STOPS, each within the
    prompt bound; they need the checkpoint's tokenizer (to see the text)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if not stops:
        return None
    if st.codec.tokenizer is None:
        raise ApiError(400, "stop strings need the checkpoint's tokenizer, and this model has "
                            "none (use stop_token_ids)", "stop")
    if len(stops) > MAX_STOPS or any(not s or len(s) > st.max_prompt_chars for s in stops):
        raise ApiError(400, f"stop must be at most {MAX_STOPS} non-empty strings of at most "
                            f"{st.max_prompt_chars} characters each", "stop")
    return stops


async def encode(st: ServeState, text: str, what: str, add_special: bool = False) -> List[int]:
    """Text -> token ids, bounded first, off the event loop (a long prompt does not stall
    other requests)."""
    check_text(st, text, what)
    try:
        return await asyncio.to_thread(st.codec.encode, text, what, add_special)
    except ValueError as e:
        raise ApiError(400, str(e), "prompt") from None


async def start_call(st: ServeState, rid: str, prompts: Sequence[Tuple[str, Prompt]], n: int,
                     s: Union[Sampling, List[Sampling]], keys: Keys = None,
                     keys_name: str = "request_ids") -> Tuple["Call", List[int]]:
    """The one way a body becomes engine requests: each (name, prompt) to token ids, n choices
    each (consecutive), every value checked (400 naming it), queued. s: one Sampling, or one per
    prompt. keys: the noise key of each sequence: None (0..), the client's (the engine's
    rules.noise_keys: distinct ints in [0, 2**63)), or a function (token ids of each prompt, n)
    -> keys derived by the server (each in [0, 2**63), repeats allowed). Every prompt and
    choice whose Sampling has no seed shares one drawn seed. -> (call, prompt lengths)."""
    ss = s if isinstance(s, list) else [s] * len(prompts)
    ids = [await encode(st, p, what, si.add_special) if isinstance(p, str) else list(p)
           for (what, p), si in zip(prompts, ss)]
    check_n(n, len(ids), st.max_n)
    n_req = len(ids) * n
    if callable(keys):
        keys = keys(ids, n)
    else:
        try:
            keys = rules.noise_keys("request", keys, n_req)
        except (TypeError, ValueError) as e:
            raise ApiError(400, f"{e} (one per prompt and sample)", keys_name) from None
    drawn, reqs, params, stops = None, [], [], []
    for p, si in zip(ids, ss):
        new = max_new_tokens(si.limit, len(p), st.context, si.limit_name)
        sp = sampling_params(temperature=si.temperature, top_p=si.top_p, top_k=si.top_k,
                             seed=drawn if si.seed is None else si.seed, max_new=new,
                             eos=[] if si.ignore_eos else st.eos, stop_ids=si.stop_token_ids,
                             top_logprobs=si.top_logprobs, vocab=st.vocab,
                             prompt_logprobs=si.prompt_logprobs, max_logprobs=st.max_logprobs,
                             top_name=si.top_name)
        if si.seed is None:
            drawn = sp.seed
        reqs += [p] * n
        # the prompt is scored once, by its first choice (the others share its result)
        params += [sp] + [replace(sp, prompt_logprobs=None)] * (n - 1)
        stops += [StopText(st.codec, si.stop, si.include_stop, si.skip_special) if si.stop
                  else None for _ in range(n)]
    return Call(st, rid, reqs, params, keys, stops, n), [len(p) for p in ids]


class Call:
    """The engine requests of one HTTP request and their outputs, in `choices`."""

    def __init__(self, st: ServeState, rid: str, prompts: List[List[int]],
                 params: List[SamplingParams], noise_keys: List[int],
                 stops: Optional[List[Optional[StopText]]] = None, n: int = 1):
        self.st, self.rid = st, rid
        if not st.service.healthy:
            raise ApiError(503, f"the server cannot generate: {st.service.error}")
        stops = stops or [None] * len(prompts)
        self.choices = [fmt.Choice(i, len(p), prompt=list(p), stop=s)
                        for i, (p, s) in enumerate(zip(prompts, stops))]
        self.n = n    # choices per prompt, consecutive
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
            r = out.request
            news = (r.key, out.token, out.logprob, out.top_logprobs, out.finish, r.error,
                    r.cache_hit, st.service.weight_version, r.prompt_logprobs)
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
                key, tok, lp, top, finish, err, hit, version, plp = \
                    await asyncio.wait_for(self.queue.get(), 0.1)
            except asyncio.TimeoutError:
                continue
            if key not in self.open:        # news after a stop string ended it: not its own
                continue
            i = self.index[key]
            c = self.choices[i]
            c.cache_hit, c.weight_version = hit, version
            if plp is not None:         # the prompt's first choice scored it for all
                for other in self.choices[i:i + self.n]:
                    other.prompt_logprobs = plp
            if tok is not None:
                c.tokens.append(tok)
                c.logprobs.append(lp)
                c.tops.append(top)
                if c.stop is not None and c.stop.add([tok], final=bool(finish)) is not None:
                    if not finish:                  # free its slot and pages now
                        self.st.service.abort([key])
                    finish, c.stop_reason = "stop", c.stop.hit
            elif finish and c.stop is not None:
                c.stop.add([], final=True)          # flush a held-back incomplete character
            if finish:
                if finish == "stop" and c.stop_reason is None and c.tokens:
                    c.stop_reason = c.tokens[-1]        # a stop token id
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


def _stream_error(call: Call, c: fmt.Choice) -> Dict:
    if isinstance(c.error, ValueError):
        return error_body(400, str(c.error))
    return error_body(500, incident(str(c.error), f"{call.rid} choice {c.index}"))


async def stream(call: Call, chunks: Callable) -> AsyncIterator[str]:
    """SSE lines: chunks(choice, new tokens) per update, errors, then [DONE]; aborts on exit."""
    try:
        sent = [0] * len(call.choices)
        async for c in call.updates(None):
            new = slice(sent[c.index], len(c.tokens))
            sent[c.index] = len(c.tokens)
            if c.error is not None:
                yield sse(_stream_error(call, c))
                continue
            for obj in chunks(c, new):
                yield sse(obj)
        yield "data: [DONE]\n\n"
    finally:
        call.abort()
