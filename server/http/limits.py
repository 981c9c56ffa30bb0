"""Request body limit (`--max-request-bytes`): 413 before the body is parsed.

Pure ASGI middleware (no BaseHTTPMiddleware: it would interfere with streaming and disconnect
detection), applied to every route. A declared Content-Length over the limit is refused before one
byte of the body is read; a body without one (chunked) is counted as it arrives and refused once it
passes the limit, so at most `limit` bytes are ever buffered for one request.
"""

from __future__ import annotations

import json
from typing import Any

from swaserve.server.errors import APIError

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds this server's limit of {limit} bytes "
                    "(--max-request-bytes)", None, "request_too_large")


class BodyLimit:
    def __init__(self, app: Any, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
        if declared is not None and declared > self.limit:
            await _send_413(send, self.limit)
            return
        seen = 0
        refused = False

        async def counted() -> dict:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit and not refused:  # answer 413 now; the app sees the client go
                    refused = True
                    await _send_413(send, self.limit)
                    return {"type": "http.disconnect"}
            return message

        async def guarded(message: dict) -> None:
            if not refused:  # after a 413 the app's own answer goes nowhere
                await send(message)

        await self.app(scope, counted, guarded)


async def _send_413(send: Any, limit: int) -> None:
    body = json.dumps(too_large(limit).body()).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
