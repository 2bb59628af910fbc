"""The ASGI app: FastAPI routes over one `EngineDriver`, errors in OpenAI's shape, body limits, auth.

`build_app(llm, config)` wires it; uvicorn serves it (launch.py). The engine thread starts and stops with
the app's lifespan.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from dsv4.engine.llm import LLM
from dsv4.errors import Dsv4Error, WeightsNotReadyError, WeightTransferError
from dsv4.server.admin import admin_router
from dsv4.server.auth import BearerGate
from dsv4.server.body_limit import DeclaredBodyLimit, too_large_message
from dsv4.server.config import ServerConfig
from dsv4.server.driver import EngineDriver
from dsv4.server.errors import ApiError, error_body
from dsv4.server.metrics import ServerMetrics
from dsv4.server.openai_api import openai_router
from dsv4.server.served_model import ServedModel

log = logging.getLogger("dsv4.server")
ADMIN_PREFIX = "/admin"
API_PREFIX = "/v1"
BUCKET_PATH = ADMIN_PREFIX + "/weights/bucket"
# How much of a bad value an error message quotes.
SHOWN_VALUE_CHARS = 80
# What pydantic puts before the message of a ValueError raised in a validator.
PYDANTIC_VALUE_ERROR = "Value error, "
# Union-branch tags pydantic puts in error locations; they are not request fields.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}
# The status of a dsv4 error that is not the request's fault (any other is a 400): the models cannot
# serve (a failed weight update), or the trainer's end of a weight transfer failed (unreachable, dead,
# timed out: the server is the gateway to it).
ERROR_STATUS = ((WeightsNotReadyError, HTTPStatus.SERVICE_UNAVAILABLE), (WeightTransferError, HTTPStatus.BAD_GATEWAY))


def _param(loc: tuple) -> str | None:
    """The request field of a pydantic error location: ("body", "messages", 0, "content") -> messages[0].content;
    union-branch tags pydantic adds ("str", "list[int]", ...) are not fields and are dropped."""
    parts = [p for p in loc[1:] if isinstance(p, int) or (not any(ch in p for ch in "[]") and p not in _TYPE_TAGS)]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out or None



def _validation_error(exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    param = _param(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
        param = None
    elif param is None and not isinstance(first.get("input"), dict):
        message = "the body must be a JSON object, sent with Content-Type: application/json"
    else:
        shown = repr(first.get("input"))
        if len(shown) > SHOWN_VALUE_CHARS:
            shown = shown[:SHOWN_VALUE_CHARS] + "..."
        reason = str(first.get("msg")).removeprefix(PYDANTIC_VALUE_ERROR)
        message = f"{param or 'body'}: {reason} (got {shown})"
    return JSONResponse(error_body(message, HTTPStatus.BAD_REQUEST, param), status_code=HTTPStatus.BAD_REQUEST)


def build_app(llm: LLM, config: ServerConfig) -> ASGIApp:
    """The server for `llm`, as `config` sets it up (the engine thread runs while the app does): the
    FastAPI app behind the token gates and the declared-length gate."""
    metrics = ServerMetrics(config.model_name)
    driver = EngineDriver(llm, metrics, config.max_queued_requests, config.weights_root)
    model = ServedModel.from_llm(llm, config.model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        driver.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            driver.stop()

    app = FastAPI(title="dsv4", lifespan=lifespan, max_body_size=config.max_body_bytes,
                  docs_url=None, redoc_url=None)
    app.state.driver = driver
    app.include_router(openai_router(model, driver, metrics))
    if config.admin_token:
        app.include_router(admin_router(driver, config.max_bucket_bytes))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        return _validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == HTTPStatus.REQUEST_ENTITY_TOO_LARGE:
            limit = config.max_bucket_bytes if request.url.path == BUCKET_PATH else config.max_body_bytes
            message = too_large_message(limit)
        elif exc.status_code == HTTPStatus.NOT_FOUND:
            message = f"no route {request.url.path}"
        else:
            message = str(exc.detail)
        return JSONResponse(error_body(message, exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Dsv4Error)
    async def dsv4_error(request: Request, exc: Dsv4Error):
        status = next((s for kind, s in ERROR_STATUS if isinstance(exc, kind)), HTTPStatus.BAD_REQUEST)
        return JSONResponse(error_body(str(exc), status), status_code=status)

    limits = {BUCKET_PATH: config.max_bucket_bytes} if config.admin_token else {}
    asgi = DeclaredBodyLimit(app, config.max_body_bytes, limits)
    # Outermost: a client without the token learns nothing else (not even a body limit).
    if config.admin_token:
        asgi = BearerGate(asgi, ADMIN_PREFIX, config.admin_token, "admin token")
    if config.api_key:
        asgi = BearerGate(asgi, API_PREFIX, config.api_key, "API key")
    return asgi
