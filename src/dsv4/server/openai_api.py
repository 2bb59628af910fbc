"""The public routes: OpenAI's /v1 API, /tokenize and /detokenize, /health, /version, /metrics."""

from __future__ import annotations

from http import HTTPStatus

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask

import dsv4
from dsv4.engine.outputs import RequestOutput
from dsv4.server.completions import ChatRenderer, CompletionRenderer, new_id, plan_chat, plan_completion
from dsv4.server.driver import EngineDriver, OutputStream
from dsv4.server.metrics import ServerMetrics
from dsv4.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from dsv4.server.served_model import ServedModel
from dsv4.server.streaming import ClientGone, event_stream, until_disconnected

# Status a non-streamed request gets when its client left before the result (nobody reads it; nginx's
# "client closed request").
CLIENT_CLOSED_REQUEST = 499
MODEL_OWNER = "dsv4"


def _json(body) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


async def _finals(stream: OutputStream, count: int) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * count
    while not stream.done:
        index, out = await stream.next()
        if out.finished:
            finals[index] = out
    return finals  # type: ignore[return-value]


def openai_router(model: ServedModel, driver: EngineDriver, metrics: ServerMetrics) -> APIRouter:
    """The routes, bound to one served model and its engine driver."""
    router = APIRouter()

    async def _respond(request: Request, plan, renderer, stream_wanted: bool, include_usage: bool):
        stream = driver.submit(plan.inputs, renderer.id, stream=stream_wanted)
        if stream_wanted:
            if isinstance(renderer, ChatRenderer):
                events = renderer.chunks(stream, include_usage, driver.llm.weights_version)
            else:
                events = renderer.chunks(stream, include_usage)
            response = event_stream(events)
            # Closing also runs when the client disconnects before the first event was produced.
            response.background = BackgroundTask(stream.close)
            return response
        try:
            finals = await until_disconnected(request, _finals(stream, len(plan.inputs)))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            stream.close()
        return _json(renderer.response(finals))

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        plan = plan_completion(body, model)
        renderer = CompletionRenderer(plan, model, new_id("cmpl"))
        return await _respond(request, plan, renderer, body.stream, body.include_usage)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        plan = plan_chat(body, model)
        renderer = ChatRenderer(plan, model, new_id("chatcmpl"))
        return await _respond(request, plan, renderer, body.stream, body.include_usage)

    @router.get("/v1/models")
    async def models():
        card = {"id": model.name, "object": "model", "created": 0, "owned_by": MODEL_OWNER, "root": model.name,
                "max_model_len": model.max_model_len, "weights_version": driver.llm.weights_version}
        return {"object": "list", "data": [card]}

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        body.check()
        model.check_name(body.model)
        if body.prompt is not None:
            ids = model.encode(body.prompt, "prompt", body.add_special_tokens)
        else:
            _, ids = model.render_chat(body.messages, body.add_generation_prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": model.max_model_len}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        model.check_name(body.model)
        return {"prompt": model.decode(model.check_ids(body.tokens, "tokens"))}

    @router.get("/health")
    async def health():
        if not driver.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=HTTPStatus.SERVICE_UNAVAILABLE)
        if not driver.weights_ready():
            return JSONResponse({"status": "weights not ready (a failed weight update)"},
                                status_code=HTTPStatus.SERVICE_UNAVAILABLE)
        return {"status": "ok"}

    @router.get("/version")
    async def version():
        return {"version": dsv4.__version__, "weights_version": driver.llm.weights_version}

    @router.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router
