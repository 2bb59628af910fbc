"""Bearer-token gates, checked before a request body is read (an unauthenticated client cannot make the
server read a large upload). Tokens are compared in constant time (`hmac.compare_digest`)."""

from __future__ import annotations

import hmac
from http import HTTPStatus

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from dsv4.server.errors import error_body

BEARER = "bearer"


def bearer_token(headers: Headers) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    value = headers.get("authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == BEARER else None


def token_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison (no early exit that would leak how much of a guess was right)."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


class BearerGate:
    """ASGI middleware: requests to `prefix` or below it need `Authorization: Bearer <token>`; others
    pass. A failure is a 401 in OpenAI's error shape.

    Args:
        app: the wrapped ASGI app.
        prefix: a path prefix such as "/admin" (matches "/admin" and "/admin/...", not "/administrator").
        token: the expected token.
        what: what the token is called in the error message ("API key", "admin token").
    """

    def __init__(self, app: ASGIApp, prefix: str, token: str, what: str):
        self.app, self.prefix, self.token, self.what = app, prefix.rstrip("/"), token, what

    def _guarded(self, path: str) -> bool:
        return path == self.prefix or path.startswith(self.prefix + "/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._guarded(scope["path"]):
            if not token_matches(bearer_token(Headers(scope=scope)), self.token):
                body = error_body(f"missing or wrong {self.what}: send 'Authorization: Bearer <{self.what}>'",
                                  HTTPStatus.UNAUTHORIZED, code="invalid_api_key")
                response = JSONResponse(body, status_code=HTTPStatus.UNAUTHORIZED,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
