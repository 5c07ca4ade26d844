"""Weight updates from a checkpoint directory: /update_weights (= SGLang's
/update_weights_from_disk). The update drains running requests first (service.py)."""
from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .calls import parse, state
from .protocol import ApiError, UpdateWeightsRequest

router = APIRouter()


@router.post("/update_weights")
@router.post("/update_weights_from_disk")
async def update_weights(http: Request):
    st = state(http)
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
