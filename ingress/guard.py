"""What every HTTP request passes before a route sees it: a request id, the API key, draining, and the body's
size and time limits. A pure ASGI middleware, so streamed responses pass through untouched.

The body is read here, whole, before the route runs: a body over `max_request_bytes` is answered 413 as soon as
its Content-Length (or, when streamed, its bytes so far) says so, without reading the rest, and one that does not
arrive within `request_timeout_s` is answered 408. Either way no slot was taken and no work was done.
"""

from __future__ import annotations

import asyncio
import secrets
import uuid

import structlog

from blink.ingress.errors import APIError, error_response
from blink.ingress.state import IngressState

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/openapi.json"})  # for orchestrators and scrapers
DRAINED_PREFIX = "/v1/"  # what a draining server refuses; the rest answers until it exits


class RequestGuard:
    def __init__(self, app, state: IngressState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        request_id = (headers.get(b"x-request-id") or uuid.uuid4().hex.encode())[:128]
        structlog.contextvars.bind_contextvars(request_id=request_id.decode("latin-1"))

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id)]
            await send(message)

        try:
            error = self._refusal(scope["path"], headers.get(b"authorization", b""))
            if error is None and scope["method"] in ("POST", "PUT", "PATCH"):
                body, error = await self._read_body(headers.get(b"content-length"), receive)
                if body is None and error is None:
                    return  # the client left while sending
                receive = _replay(body, receive)
            if error is not None:
                closing = {"Connection": "close"} if error.status in (408, 413) else None  # the rest goes unread
                await error_response(error.status, error.message, error.type, code=error.code,
                                     headers=closing)(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    def _refusal(self, path: str, authorization: bytes) -> APIError | None:
        if path in OPEN_PATHS:
            return None
        key = self.state.api_key
        if key is not None and not secrets.compare_digest(authorization, f"Bearer {key}".encode()):
            return APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
        if self.state.draining and path.startswith(DRAINED_PREFIX):
            return APIError(503, "the server is shutting down", "service_unavailable", code="draining")
        return None

    async def _read_body(self, content_length: bytes | None, receive) -> tuple[bytes | None, APIError | None]:
        """The whole body, or why not: (None, None) when the client disconnected."""
        limit, timeout_s = self.state.max_request_bytes, self.state.request_timeout_s
        too_large = APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                             code="request_too_large")
        if content_length is not None and content_length.isdigit() and int(content_length) > limit:
            return None, too_large
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return None, APIError(408, f"the request body did not arrive within {timeout_s:g} s",
                                      code="request_timeout")
            if message["type"] == "http.disconnect":
                return None, None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None, too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _replay(body: bytes, receive):
    """The body once, as one message; then the connection's own messages (a disconnect, for streaming routes)."""
    replayed = False

    async def replay():
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay

