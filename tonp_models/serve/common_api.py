"""The routes every client shares: /health, /v1/models, /metrics."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from . import formats as fmt
from .calls import state

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
