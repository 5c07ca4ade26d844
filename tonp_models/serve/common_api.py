"""The routes every client shares: /health, /v1/models, /metrics, and vLLM's metadata and cache
routes a client such as TRL's VLLMClient calls: /version, /server_info, /get_world_size,
/reset_prefix_cache."""
from __future__ import annotations

import asyncio

import torch.distributed as dist
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from . import formats as fmt
from .calls import state
from .protocol import ApiError

router = APIRouter()


@router.get("/health")
async def health(http: Request):
    s = state(http).service
    if not s.healthy:
        return JSONResponse({"status": "error", "error": s.error}, status_code=503)
    return {"status": "ok", "weight_version": s.weight_version}


@router.get("/v1/models")
async def models(http: Request):
    st = state(http)
    return {"object": "list", "data": [{
        "id": st.model_name, "object": "model", "created": 0, "owned_by": "tonp",
        "max_model_len": st.context, "weight_version": st.service.weight_version}]}


@router.get("/metrics")
async def metrics(http: Request):
    return PlainTextResponse(fmt.prometheus(state(http).service.snapshot()))


def _world(st) -> int:
    g = st.service.group
    return 1 if g is None else dist.get_world_size(g)


@router.get("/version")
async def version():
    from importlib.metadata import PackageNotFoundError, version as installed
    try:
        v = installed("tonp")
    except PackageNotFoundError:      # run from a source checkout
        v = "source"
    return {"version": v, "server": "tonp"}


@router.get("/server_info")
async def server_info(http: Request):
    """What vLLM's /server_info holds that applies here (a vllm_config-shaped tree)."""
    st = state(http)
    return {"vllm_config": {
        "model_config": {"model": st.model_name, "served_model_name": st.model_name,
                         "max_model_len": st.context, "max_logprobs": st.max_logprobs},
        "parallel_config": {"world_size": _world(st), "data_parallel_size": 1},
        "weight_version": st.service.weight_version}}


@router.get("/get_world_size")
async def get_world_size(http: Request):
    return {"world_size": _world(state(http))}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(http: Request):
    """vLLM's: forget every cached prefix (on every rank, between two steps)."""
    try:
        fut = state(http).service.flush_cache()
    except RuntimeError as e:
        raise ApiError(503, str(e)) from None
    ok, message = await asyncio.wrap_future(fut)
    return {"success": ok, "message": message}
