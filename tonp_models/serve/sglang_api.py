"""SGLang's /generate: token ids or text, one prompt or a batch, with tonp's `request_ids` (the
noise key of each sequence, so a batch reproduces `generate(..., request_ids=...)`)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from . import formats as fmt
from .calls import Sampling, parse, start_call, state, stream
from .protocol import ApiError, GenerateRequest

router = APIRouter()


@router.post("/generate")
async def generate(http: Request):
    st = state(http)
    body: GenerateRequest = await parse(http, GenerateRequest)
    sp = body.sampling_params
    if (body.input_ids is None) == (body.text is None):
        raise ApiError(400, "give exactly one of input_ids and text", "input_ids")
    batch = isinstance(body.text, list) or (body.input_ids is not None and bool(
        body.input_ids) and isinstance(body.input_ids[0], list))
    if body.text is not None:
        texts = body.text if batch else [body.text]
        prompts = [(f"text {i}", t) for i, t in enumerate(texts)]
    else:
        prompts = [("input_ids", p) for p in (body.input_ids if batch else [body.input_ids])]
    s = Sampling(sp.max_new_tokens, "max_new_tokens", temperature=sp.temperature,
                 top_p=sp.top_p, top_k=None if sp.top_k == -1 else sp.top_k, seed=sp.seed,
                 ignore_eos=sp.ignore_eos, stop_token_ids=sp.stop_token_ids,
                 top_logprobs=body.top_logprobs_num)
    rid = fmt.new_id("gen")
    call, _ = await start_call(st, rid, prompts, sp.n, s, keys=body.request_ids)
    if body.stream:
        def chunks(c: fmt.Choice, new: slice):
            yield fmt.generate_result(st.codec, c, rid, logprobs=body.return_logprob,
                                      tokens=c.tokens[new], lps=c.logprobs[new],
                                      tops=c.tops[new])
        return StreamingResponse(stream(call, chunks), media_type="text/event-stream")
    await call.run(http)
    out = [fmt.generate_result(st.codec, c, rid, logprobs=body.return_logprob)
           for c in call.choices]
    return out if batch or sp.n > 1 else out[0]
