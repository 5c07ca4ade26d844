"""SGLang's native routes: /generate (its GenerateReqInput dialect, sglang_protocol.py),
/abort_request, /flush_cache, /get_model_info, /get_server_info and /health_generate.

Seeds. With `sampling_params.sampling_seed` (SGLang's) every request draws with one fixed noise
key, so its noise is a hash of the seed, the position and the token only, as SGLang's: one
(prompt, seed) gives one output wherever the prompt sits in whatever batch, its n copies are
equal, and a request continuing a sequence (prompt + the tokens so far, e.g. an aborted rollout
resumed) draws what the whole request drew. tonp's `seed` keys the noise by each sequence's
index in the request, or by tonp's `request_ids` where given (they keep their meaning with
sampling_seed).
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Set, Tuple

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from ..checks import digest
from . import formats as fmt
from .calls import Call, encode, parse, start_call, state, stop_strings, stream
from .protocol import ApiError
from .sglang_protocol import (AbortRequest, SGLangGenerate, SGLangSampling, per_prompt,
                              refuse_non_neutral, result, sampling)

router = APIRouter()

# The noise key of every sampling_seed request (in [0, 2**63), the sampling kernel's int64),
# apart from the keys 0.. of tonp's own requests.
SEEDED_KEY = digest("sglang sampling_seed") % 2**63


@dataclass
class _Live:
    """The running /generate calls by rid (for /abort_request), and the rids aborted there."""
    calls: Dict[str, Tuple[Call, List[int]]] = field(default_factory=dict)  # -> choice indexes
    aborted: Set[str] = field(default_factory=set)


def _live(http: Request) -> _Live:
    s = http.app.state
    if not hasattr(s, "sglang_live"):
        s.sglang_live = _Live()
    return s.sglang_live


def _rids(rid, count: int, batch: bool) -> List[str]:
    """SGLang's rids: one per prompt (a string for a batch is their prefix), drawn if absent."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(count)] if batch else [rid]
    if len(rid) != count or len(set(rid)) != count:
        raise ApiError(400, f"rid must be {count} distinct strings (one per prompt), got "
                            f"{len(rid)} ({len(set(rid))} distinct)", "rid")
    return list(rid)


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(http: Request):
    st, live = state(http), _live(http)
    body: SGLangGenerate = await parse(http, SGLangGenerate)
    if (body.input_ids is None) == (body.text is None):
        raise ApiError(400, "give exactly one of input_ids and text", "input_ids")
    batch = isinstance(body.text, list) or (body.input_ids is not None and bool(
        body.input_ids) and isinstance(body.input_ids[0], list))
    if body.text is not None:
        items = body.text if batch else [body.text]
        ids = [await encode(st, t, f"text {i}" if batch else "text") for i, t in enumerate(items)]
    else:
        ids = [list(p) for p in (body.input_ids if batch else [body.input_ids])]
    count = len(ids)
    raw = body.sampling_params
    if isinstance(raw, list) and len(raw) != count:
        raise ApiError(400, f"sampling_params has {len(raw)} entries for {count} prompt(s)",
                       "sampling_params")
    sps = raw if isinstance(raw, list) else [raw or SGLangSampling()] * count
    if len({sp.n or 1 for sp in sps}) > 1:
        raise ApiError(400, "sampling_params.n must be the same for every prompt",
                       "sampling_params.n")
    n = (sps[0].n or 1) if sps else 1
    refuse_non_neutral(body, sps)
    want = per_prompt(body.return_logprob, False, count, n, "return_logprob")
    starts = per_prompt(body.logprob_start_len, -1, count, n, "logprob_start_len")
    tops = per_prompt(body.top_logprobs_num, 0, count, n, "top_logprobs_num")
    first = []          # each prompt's first position in input_token_logprobs
    for i, (w, s0) in enumerate(zip(want, starts)):
        if w and not -1 <= s0 <= len(ids[i]):
            raise ApiError(400, f"logprob_start_len={s0} is beyond the prompt's {len(ids[i])} "
                                f"tokens (-1: none of the prompt)", "logprob_start_len")
        first.append(len(ids[i]) if not w or s0 == -1 else s0)
    rids = _rids(body.rid, count, batch)
    if any(r in live.calls for r in rids):
        raise ApiError(400, f"a request with rid {next(r for r in rids if r in live.calls)!r} "
                            f"is running", "rid")
    seeded = [sp.sampling_seed is not None for sp in sps]

    def seed_keyed(prompts, n):     # SGLang's seeds: noise by (seed, position, token) only
        return [SEEDED_KEY if seeded[i] else i * n + j
                for i in range(len(prompts)) for j in range(n)]
    keys = seed_keyed if body.request_ids is None and any(seeded) else body.request_ids
    # prompt logprobs (the engine scores the prompt) when a position after `first` needs one
    ss = [sampling(sp, t if w else 0, stop_strings(st, sp.stop), t if f < len(p) - 1 else None)
          for sp, t, w, f, p in zip(sps, tops, want, first, ids)]
    call, _ = await start_call(st, rids[0], [("input_ids", p) for p in ids], n, ss, keys=keys)
    for i, r in enumerate(rids):
        live.calls[r] = (call, list(range(i * n, (i + 1) * n)))

    def out(c: fmt.Choice) -> Dict:
        i, sp = c.index // n, sps[c.index // n]
        return result(st.codec, c, rids[i] if n == 1 else f"{rids[i]}_{c.index % n}",
                      logprobs=want[i], text_in_lps=body.return_text_in_logprobs,
                      top=tops[i], skip_special=sp.skip_special_tokens is not False,
                      no_stop_trim=bool(sp.no_stop_trim), start=first[i],
                      prompt_ids=body.return_prompt_token_ids)

    def done() -> Set[str]:
        for r in rids:
            live.calls.pop(r, None)
        aborted = live.aborted.intersection(rids)
        live.aborted.difference_update(rids)
        return aborted

    if body.stream:
        async def events():
            try:
                async for line in stream(call, lambda c, _: [out(c)]):
                    yield line
            finally:
                done()
        return StreamingResponse(events(), media_type="text/event-stream")
    try:
        async for _ in call.updates(http):
            pass
    finally:
        call.abort()
        aborted = done()
    for c in call.choices:
        if c.error is not None:
            raise ApiError(400 if isinstance(c.error, ValueError) else 500, str(c.error))
        if c.finish == "abort" and rids[c.index // n] not in aborted:
            raise ApiError(503, "the server is shutting down: the request was cancelled")
    outs = [out(c) for c in call.choices]
    return outs if batch or n > 1 else outs[0]


@router.post("/abort_request")
async def abort_request(http: Request):
    """SGLang's: end the requests whose rid starts with `rid` (their results so far come back
    with finish_reason "abort"), or with abort_all every /generate request; no match is no
    error."""
    body: AbortRequest = await parse(http, AbortRequest)
    live, st = _live(http), state(http)
    rids = [r for r in live.calls if body.abort_all or body.rid and r.startswith(body.rid)]
    keys = []
    for r in rids:
        call, idx = live.calls[r]
        live.aborted.add(r)
        keys += [k for k, i in call.index.items() if i in idx]
    if keys:
        st.service.abort(keys)
    return Response(status_code=200)


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(http: Request):
    """SGLang's: forget the prefix cache (plain text). SGLang refuses (400) while requests run;
    tonp's running requests keep their pages, so the flush always happens."""
    try:
        fut = state(http).service.flush_cache()
    except RuntimeError as e:
        raise ApiError(503, str(e)) from None
    ok, message = await asyncio.wrap_future(fut)
    return PlainTextResponse("Cache flushed.\n" if ok else message + "\n",
                             status_code=200 if ok else 400)


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(http: Request):
    """SGLang's model facts (what its clients read)."""
    st = state(http)
    name = st.model_name     # a name, never a filesystem path
    return {"model_path": name, "tokenizer_path": name if st.codec.tokenizer else None,
            "served_model_name": name, "is_generation": True, "preferred_sampling_params": None,
            "weight_version": st.service.weight_version, "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"]}


@router.get("/get_server_info")
async def server_info(http: Request):
    """What SGLang's clients read of its server args (slime compares some with its own).
    SGLang's newer alias /server_info is vLLM's route here (common_api)."""
    st = state(http)
    e = st.service.engine
    groups = getattr(e.model, "groups", None)
    info = await model_info(http)
    return {**info, "context_length": st.context,
            "tp_size": getattr(groups, "tp_size", 1), "ep_size": getattr(groups, "ep_size", 1),
            "dp_size": 1, "pp_size": 1, "max_running_requests": e.sched.max_batch_size,
            "max_total_num_tokens": e.cache.num_pages * e.cache.page_size,
            "page_size": e.cache.page_size, "chunked_prefill_size": e.sched.max_step_tokens or -1,
            "disable_radix_cache": e.prefix is None,
            "skip_tokenizer_init": st.codec.tokenizer is None, "max_n": st.max_n,
            "kernel_mode": st.service.mode, "version": "tonp"}


@router.get("/health_generate")
async def health_generate(http: Request):
    """SGLang's: 200 once a one-token greedy request ran through the engine, else 503."""
    st = state(http)
    try:
        call, _ = await start_call(st, "health", [("input_ids", [0])], 1,
                                   sampling(SGLangSampling(max_new_tokens=1, temperature=0), 0))
        await call.run(http)
    except ApiError as e:
        return PlainTextResponse(e.message, status_code=503)
    return Response(status_code=200)
