"""The guard in front of the app: the API key, then the request body within the size limit."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.errors import AuthenticationError, InvalidArgumentError, RequestTooLargeError
from kvserve.server.errors import error_response

# routes that need the API key (the /kv/ routes check it themselves): the OpenAI routes, the live view, the model's admin
GUARDED = ("/v1", "/ui/events", "/ui/state", "/update_weights_from_disk", "/sleep", "/wake_up", "/is_sleeping")


class GuardMiddleware:
    """Checks the API key before anything else, then reads the body within the size limit.

    The body is read here, whole, and replayed to the app: the limit holds whether or not the
    client sent Content-Length. Over the limit, the rest of the body is drained (up to a bound)
    so that the client reads its 413 instead of a reset connection.
    """

    DRAIN_FACTOR = 8

    def __init__(self, app: ASGIApp, api_key: str | None, max_bytes: int):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key is not None and scope["path"].startswith(GUARDED) and not self._authorized(scope):
            await error_response(AuthenticationError("missing or wrong API key"))(scope, receive, send)
            return
        too_large = RequestTooLargeError(f"the request body is over the limit of {self.max_bytes} bytes")
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            if not length.isdigit():
                await error_response(InvalidArgumentError("bad Content-Length"))(scope, receive, send)
            else:
                await error_response(too_large)(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size <= self.max_bytes:
                chunks.append(message.get("body", b""))
            if not message.get("more_body", False) or size > self.max_bytes * self.DRAIN_FACTOR:
                break
        if size > self.max_bytes:
            await error_response(too_large)(scope, receive, send)
            return
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect

        await self.app(scope, replay, send)

    def _authorized(self, scope: Scope) -> bool:
        value = _header(scope, b"authorization") or ""
        scheme, _, token = value.partition(" ")
        assert self.api_key is not None
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None
