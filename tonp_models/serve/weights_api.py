"""Weight updates: from a checkpoint directory (/update_weights = SGLang's
/update_weights_from_disk) and from a trainer's process group (SGLang's
/init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group;
the trainer side is weight_sync.WeightSender). Every update drains running requests first
(service.py); docs/serving.md, "Weight updates", says what is guaranteed.

Replies are SGLang's {"success", "message"} plus tonp's "weight_version" and "seconds"; the
status is 200, a 4xx when the update was refused with nothing changed (403: outside
--allowed-weights-dir; 400: a master_address security.py does not allow), 500 when it failed part-way (the server is then unhealthy until a good
update), 503 when the engine is not running.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from typing import List, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .calls import parse, state
from .protocol import ApiError, Body
from .service import UpdateResult, WeightsRefused
from .weight_sync import DEFAULT_GROUP

router = APIRouter()


class _Update(Body):
    """Fields SGLang's update requests share. weight_version: the version after the update
    (an int, or a string of one; default: the current one + 1). flush_cache: accepted either
    way; tonp always drops the prefix cache when weights change (its K/V are stale).
    abort_all_requests: abort every live request first instead of letting them finish."""
    weight_version: Optional[Union[int, str]] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    load_format: Optional[str] = None
    torch_empty_cache: bool = False


class DiskUpdate(_Update):
    model_path: str


class InitGroup(Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"


class DistributedUpdate(_Update):
    names: List[str]
    dtypes: List[str]
    shapes: List[List[int]]
    group_name: str = DEFAULT_GROUP


class DestroyGroup(Body):
    group_name: str = DEFAULT_GROUP


def _version(body: _Update) -> Optional[int]:
    v = body.weight_version
    if v is None or isinstance(v, int):
        ok = v is None or v >= 0
    else:
        ok = v.isdigit()
        v = int(v) if ok else None
    if not ok:
        raise ApiError(400, "weight_version must be an int >= 0 (or a string of one)",
                       "weight_version")
    if body.load_format not in (None, "auto"):
        raise ApiError(400, "load_format: only the default (safetensors) is supported",
                       "load_format")
    return v


async def _reply(http: Request, start, body: _Update) -> JSONResponse:
    """Queue the update (`start()` -> Future of UpdateResult) and answer once it resolved."""
    service, t0 = state(http).service, time.perf_counter()
    version = _version(body)
    try:
        if body.abort_all_requests:
            service.abort_all()
        fut: Future = start(version)
    except WeightsRefused as e:
        res = UpdateResult(False, str(e), e.status)
    except RuntimeError as e:
        raise ApiError(503, str(e)) from None
    else:
        res = await asyncio.wrap_future(fut)
    return JSONResponse({"success": res.ok, "message": res.message,
                         "weight_version": service.weight_version,
                         "seconds": time.perf_counter() - t0}, status_code=res.status)


@router.post("/update_weights")
@router.post("/update_weights_from_disk")
async def update_weights(http: Request):
    body: DiskUpdate = await parse(http, DiskUpdate)
    service = state(http).service
    return await _reply(http, lambda v: service.update_weights(body.model_path, v), body)


@router.post("/init_weights_update_group")
async def init_weights_update_group(http: Request):
    b: InitGroup = await parse(http, InitGroup)
    st = state(http)
    if not st.security.sync_address_ok(b.master_address):
        raise ApiError(400, f"master_address {b.master_address!r} is not a loopback address, "
                            f"and this server connects its ranks elsewhere only to the "
                            f"addresses --allowed-host or --allowed-master-address name",
                       "master_address")
    service = st.service
    return await _reply(http, lambda v: service.run_everywhere(
        "init_group", b.master_address, b.master_port, b.rank_offset, b.world_size,
        b.group_name, b.backend), _Update())


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(http: Request):
    b: DistributedUpdate = await parse(http, DistributedUpdate)
    service = state(http).service
    return await _reply(http, lambda v: service.run_everywhere(
        "receive", b.names, b.dtypes, b.shapes, b.group_name, version=v), b)


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(http: Request):
    b: DestroyGroup = await parse(http, DestroyGroup)
    service = state(http).service
    return await _reply(http, lambda v: service.run_everywhere("destroy_group", b.group_name),
                        _Update())
