"""Exceptions to HTTP: the one place that picks a status and writes OpenAI's error body.

Every error a client can cause (a ``KVServeError``, a body pydantic refuses, an unknown route)
ends in ``error_response``, whether raised in a route, in the guard middleware, or before the
headers of a stream went out; an error in the middle of a stream is written as an event with
the same body (``kvserve.server.streaming``).
"""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.errors import (
    AuthenticationError,
    EngineDeadError,
    InvalidArgumentError,
    KVServeError,
    MissingPackageError,
    NotFoundError,
    RequestTooLargeError,
    ServerBusyError,
    ServiceUnavailableError,
)
from kvserve.server import protocol as P

log = logging.getLogger("kvserve.server")

# (error class, HTTP status, OpenAI error type); the first match wins.
_ERROR_STATUS: list[tuple[type[BaseException], int, str]] = [
    (InvalidArgumentError, 400, "invalid_request_error"),
    (AuthenticationError, 401, "authentication_error"),
    (NotFoundError, 404, "invalid_request_error"),  # OpenAI's type for an unknown model
    (RequestTooLargeError, 413, "invalid_request_error"),
    (ServerBusyError, 429, "rate_limit_error"),
    (EngineDeadError, 503, "service_unavailable_error"),
    (ServiceUnavailableError, 503, "service_unavailable_error"),  # asleep; aborted by a weight update
    (MissingPackageError, 501, "not_implemented_error"),  # an optional package this server lacks
    (KVServeError, 400, "invalid_request_error"),
]

# What the app hands to ``handle_error``: ours, pydantic's, routing's, and anything else (a 500).
HANDLED_EXCEPTIONS: tuple[type[Exception], ...] = (KVServeError, RequestValidationError, StarletteHTTPException,
                                                   Exception)


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


def error_body(exc: BaseException) -> tuple[int, P.ErrorResponse]:
    """The HTTP status and OpenAI error body of an exception: the one mapping the server uses."""
    param = code = None
    if isinstance(exc, RequestValidationError):  # pydantic: a 400, as OpenAI answers, not FastAPI's 422
        status, kind, message, param = 400, "invalid_request_error", *describe_validation(exc)
    elif isinstance(exc, StarletteHTTPException):  # routing: 404, 405
        status = exc.status_code
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        message = str(exc.detail)
    else:
        for cls, status, kind in _ERROR_STATUS:
            if isinstance(exc, cls):
                message = str(exc)
                param = getattr(exc, "param", None)
                code = getattr(exc, "code", None)
                break
        else:
            status, kind, message = 500, "internal_error", "internal server error"
    if code is None and isinstance(exc, AuthenticationError):
        code = "invalid_api_key"
    return status, P.ErrorResponse(error=P.ErrorInfo(message=message, type=kind, param=param, code=code))


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_body(exc)
    if status >= 500 and not isinstance(exc, (EngineDeadError, ServiceUnavailableError)):
        log.error("internal error", exc_info=exc)
    return JSONResponse(body.model_dump(), status_code=status)


async def handle_error(request: Request, exc: Exception) -> Response:
    """The app's exception handler for each of ``HANDLED_EXCEPTIONS``."""
    if isinstance(exc, StarletteHTTPException) and exc.status_code == 404 and exc.detail == "Not Found":
        # routing's bare 404: say which route, as OpenAI does ("Invalid URL (POST /v1/x)")
        exc = NotFoundError(f"there is no route {request.method} {request.url.path} on this server "
                            "(docs/openai-api.md lists what it serves)", code="unknown_url")
    return error_response(exc)


def _param_path(error: dict) -> list[str]:
    """Where a complaint is, without where the parameter came from (the body, the query string)."""
    loc = [str(x) for x in error.get("loc", ())]
    return loc[1:] if loc and loc[0] in ("body", "query", "path") else loc


def describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    """A message naming (at most three of) pydantic's complaints, and the parameter of the first."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    parts = []
    for e in errors[:3]:
        loc = _param_path(e)
        if e.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}")
        else:
            parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
    first = _param_path(errors[0])
    param = first[0] if first and errors[0].get("type") != "json_invalid" else None
    return "; ".join(parts), param
