"""Refuse a request whose declared Content-Length is over its route's limit, before anything reads it.

FastAPI's own limit (`max_body_size`, set in app.py) counts the bytes as they arrive, which also covers
chunked bodies with no declared length; but for a declared length over the limit Starlette answers with
a plain-text 413 of its own. This outer gate answers those first, in OpenAI's error shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from dsv4.server.errors import error_body


def too_large_message(limit: int) -> str:
    return f"the request body is larger than this route's limit of {limit} bytes"


class DeclaredBodyLimit:
    """ASGI middleware: 413 for a declared Content-Length over the limit of the request's path (400 for
    an unreadable Content-Length).

    Args:
        app: the wrapped ASGI app.
        default_limit: bytes allowed on every path not in `path_limits`.
        path_limits: exact paths with a limit of their own.
    """

    def __init__(self, app: ASGIApp, default_limit: int, path_limits: Mapping[str, int]):
        self.app, self.default_limit, self.path_limits = app, default_limit, dict(path_limits)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            declared = Headers(scope=scope).get("content-length")
            limit = self.path_limits.get(scope["path"], self.default_limit)
            problem = None
            if declared is not None and not declared.isdigit():
                status, problem = HTTPStatus.BAD_REQUEST, f"invalid Content-Length header {declared[:40]!r}"
            elif declared is not None and int(declared) > limit:
                status, problem = HTTPStatus.REQUEST_ENTITY_TOO_LARGE, too_large_message(limit)
            if problem is not None:
                await JSONResponse(error_body(problem, status), status_code=status)(scope, receive, send)
                return
        await self.app(scope, receive, send)
