"""The admin routes (/admin/...): pause and resume generation, weight update sessions, reload, report, and
weight sync from a trainer.

Mounted only when the server has an admin token; `BearerGate` (auth.py) checks it before any body is
read. Every operation but /admin/state runs on the driver's admin thread in arrival order (driver.py), so a
pause, a resume and the steps of a weight update never interleave with each other; the engine changes
weights only between its steps, never under a forward.

    POST /admin/pause            {"mode": "abort"|"wait"|"retract"}   -> state once paused
    POST /admin/resume                                                 -> state
    GET  /admin/state                                                  -> paused, versions, queue
    POST /admin/weights/begin    {"atomic", "full", "mode"}           -> version in effect
    POST /admin/weights/bucket   safetensors bytes (the whole body)    -> tensors staged / written
    POST /admin/weights/finish                                         -> new version
    POST /admin/weights/abort                                          -> version in effect
    POST /admin/weights/reload   {"path", "mode"} (under --weights-root) -> new version
    GET  /admin/weights/report                                         -> weight_report()

From a trainer process (`dsv4.rl`; docs/rl.md), the engine side of `LLM.init_weight_transfer` and
`LLM.update_weights_from_distributed` / `update_weights_from_shared`:

    POST /admin/weights/init_transfer       {"master_address", "master_port", "rank_offset", "world_size",
                                             "group_name", "backend", "timeout"}  -> the group joined
    POST /admin/weights/update_distributed  {"metadata", "atomic", "full", "mode"} -> new version, timings
    POST /admin/weights/update_shared       {"metadata", "handle", "atomic", "full", "mode"} -> likewise

init_transfer returns once the trainer's `WeightSender` joined too, and update_distributed once the
trainer's `send` delivered every bucket: the trainer calls those concurrently with the HTTP request.
Both wait on the admin thread only; generation goes on meanwhile (until the update's pause, for the write).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from starlette.concurrency import run_in_threadpool

from dsv4.server.driver import EngineDriver, resolve_under
from dsv4.server.errors import ApiError
from dsv4.server.protocol import (
    InitTransferRequest,
    PauseRequest,
    UpdateFromDistributedRequest,
    UpdateFromSharedRequest,
    WeightsBeginRequest,
    WeightsReloadRequest,
)


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

    @router.post("/weights/init_transfer")
    async def init_transfer(body: InitTransferRequest):
        return await driver.init_weight_transfer(body.master_address, body.master_port, body.rank_offset,
                                                 body.world_size, body.group_name, body.backend, body.timeout)

    @router.post("/weights/update_distributed")
    async def update_distributed(body: UpdateFromDistributedRequest):
        return await driver.update_weights_from_distributed(body.metadata, body.atomic, body.full, body.mode)

    @router.post("/weights/update_shared")
    async def update_shared(body: UpdateFromSharedRequest):
        return await driver.update_weights_from_shared(body.metadata, body.handle, body.atomic, body.full,
                                                       body.mode)

    return router
