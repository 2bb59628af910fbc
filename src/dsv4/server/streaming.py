"""Server-sent events, and what happens when a client goes away.

A streamed response is an async generator of `data: <json>` events ending with `data: [DONE]`. When the
client disconnects, Starlette cancels the generator; the generator's `finally` closes its `OutputStream`,
which sends the abort to the engine thread, and the engine frees the request's cache slots before its
next step. A non-streamed request races its result against the client's disconnect
(`until_disconnected`) for the same effect.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse

DONE_EVENT = "data: [DONE]\n\n"
T = TypeVar("T")


def sse_event(payload: BaseModel | dict, exclude: set[str] | None = None) -> str:
    """One server-sent event carrying `payload` (a response model, serialized by pydantic's own encoder,
    less the `exclude` fields; or a plain dict) as compact JSON."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    # no-cache / no buffering: every event should reach the client as soon as it is produced.
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the request body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The client disconnected before its result was ready."""


async def until_disconnected(request: Request, result: Awaitable[T]) -> T:
    """Await `result`, unless the client disconnects first.

    Raises:
        ClientGone: the client disconnected; `result` was cancelled.
    """
    work: asyncio.Future[Any] = asyncio.ensure_future(result)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if work.cancelled():
        raise ClientGone()
    return work.result()
