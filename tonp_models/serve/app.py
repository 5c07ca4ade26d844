"""The FastAPI app over an `EngineService`: its lifespan, its error handler and the routers of
each dialect (common_api: /health, /v1/models, /metrics; openai_api: /v1/completions and
/v1/chat/completions; sglang_api: /generate; weights_api: /update_weights).

Handlers are module-level functions that find the server's `ServeState` in
`http.app.state.serve`. Every error is a JSON body {"error": {"message", "type", "param",
"code"}} with a 4xx status when the request was at fault, and the server keeps serving; a 500
says only where the server log has its details. In front of every route, security.py's `Guard`
checks the Host, the API key, the Origin, the Content-Type and the body size.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Callable, Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from . import common_api, openai_api, sglang_api, weights_api
from .calls import ServeState
from .protocol import ApiError
from .security import Guard, error_body, internal_error

__all__ = ["ServeState", "create_app"]


async def _api_error(http, e: ApiError):
    if e.status == 500:     # a server fault: its details go to the server log, not the client
        return internal_error(http.scope, e.message)
    return JSONResponse(error_body(e.status, e.message, e.param), status_code=e.status)


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
    app.state.serve = st
    app.add_exception_handler(ApiError, _api_error)
    app.add_middleware(Guard, policy=st.security)
    for api in (common_api, openai_api, sglang_api, weights_api):
        app.include_router(api.router)
    return app
