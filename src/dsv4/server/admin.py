"""The admin routes (/admin/...): pause and resume generation, weight update sessions, reload, report.

Mounted only when the server has an admin token; `BearerGate` (auth.py) checks it before any body is
read. Every operation runs on the engine thread in arrival order (see driver.py), so a pause, a resume
and the steps of a weight update never interleave with each other or with a forward.

    POST /admin/pause            {"mode": "abort"|"wait"|"retract"}   -> state once paused
    POST /admin/resume                                                 -> state
    GET  /admin/state                                                  -> paused, versions, queue
    POST /admin/weights/begin    {"atomic", "full", "mode"}           -> version in effect
    POST /admin/weights/bucket   safetensors bytes (the whole body)    -> tensors staged / written
    POST /admin/weights/finish                                         -> new version
    POST /admin/weights/abort                                          -> version in effect
    POST /admin/weights/reload   {"path", "mode"} (under --weights-root) -> new version
    GET  /admin/weights/report                                         -> weight_report()
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from starlette.concurrency import run_in_threadpool

from dsv4.server.driver import EngineDriver, resolve_under
from dsv4.server.errors import ApiError
from dsv4.server.protocol import PauseRequest, WeightsBeginRequest, WeightsReloadRequest


def parse_bucket(data: bytes) -> dict:
    """A safetensors byte body -> {name: tensor} (parsed by safetensors; never pickle).

    Raises:
        ApiError: an empty or malformed body.
    """
    if not data:
        raise ApiError("the bucket body is empty: send the bytes of a safetensors file", param="body")
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError, OSError) as exc:
        raise ApiError(f"the bucket body is not safetensors bytes: {exc}", param="body") from None
    if not tensors:
        raise ApiError("the bucket holds no tensors", param="body")
    return tensors


def admin_router(driver: EngineDriver, max_bucket_bytes: int) -> APIRouter:
    router = APIRouter(prefix="/admin")

    @router.post("/pause")
    async def pause(body: PauseRequest | None = None):
        return await driver.pause((body or PauseRequest()).mode)

    @router.post("/resume")
    async def resume():
        return await driver.resume()

    @router.get("/state")
    async def state():
        return await driver.state()

    @router.post("/weights/begin")
    async def begin(body: WeightsBeginRequest | None = None):
        body = body or WeightsBeginRequest()
        return await driver.begin_weight_update(body.atomic, body.full, body.mode)

    @router.post("/weights/bucket", max_body_size=max_bucket_bytes)
    async def bucket(request: Request):
        tensors = await run_in_threadpool(parse_bucket, await request.body())
        return await driver.load_weight_bucket(tensors)

    @router.post("/weights/finish")
    async def finish():
        return await driver.finish_weight_update()

    @router.post("/weights/abort")
    async def abort():
        return await driver.abort_weight_update()

    @router.post("/weights/reload")
    async def reload(body: WeightsReloadRequest):
        path = resolve_under(driver.weights_root, body.path)
        return await driver.reload_weights(path, body.mode)

    @router.get("/weights/report")
    async def report():
        return await driver.weight_report()

    return router
