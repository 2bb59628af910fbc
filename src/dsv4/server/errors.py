"""Errors the HTTP server answers with, in OpenAI's error shape.

Every error a client can cause becomes one JSON body
``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`` with the HTTP status below;
`param` names the request field at fault. Nothing a client sends produces a traceback or a 500.
"""

from __future__ import annotations

from http import HTTPStatus

from dsv4.errors import RequestError

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
CONFLICT = "conflict_error"
UNAVAILABLE = "service_unavailable_error"
SERVER_ERROR = "server_error"

# The OpenAI error `type` that goes with each status this server answers.
ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: INVALID_REQUEST,
    HTTPStatus.UNAUTHORIZED: AUTHENTICATION,
    HTTPStatus.NOT_FOUND: NOT_FOUND,
    HTTPStatus.CONFLICT: CONFLICT,
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: INVALID_REQUEST,
    HTTPStatus.SERVICE_UNAVAILABLE: UNAVAILABLE,
    HTTPStatus.INTERNAL_SERVER_ERROR: SERVER_ERROR,
    HTTPStatus.BAD_GATEWAY: SERVER_ERROR,
}


class ApiError(RequestError):
    """A request the server refuses, with the HTTP status and the field (`param`) at fault.

    Args:
        message: what is wrong, naming the bad value.
        status: HTTP status (400 unless the problem is authentication, a missing resource, a conflict
            with the server's state, a body over the limit, or the server being unable to serve).
        param: the request field at fault (dotted path), if one is.
        code: a machine-readable code, e.g. "model_not_found".
    """

    def __init__(
        self, message: str, *, status: int = HTTPStatus.BAD_REQUEST, param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.param = param
        self.code = code

    def body(self) -> dict:
        """The OpenAI error body."""
        return error_body(self.message, self.status, self.param, self.code)


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """``{"error": {...}}`` as OpenAI's API writes it."""
    kind = ERROR_TYPES.get(HTTPStatus(status), INVALID_REQUEST)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
