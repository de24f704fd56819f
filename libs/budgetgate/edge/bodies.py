"""A bound on request bodies, declared or streamed, for every budgetgate HTTP service.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which wraps every request in extra tasks
and streams and cost about a quarter of the service's CPU under load. A body sent in chunks
(no Content-Length) is counted as it arrives and reading stops at the limit: nothing past it is
buffered or parsed.
"""

from __future__ import annotations

import json
from typing import Any

Scope = dict[str, Any]
Receive = Any
Send = Any


class BodyLimit:
    """Answers 413 to a request whose declared or actual body is larger than `max_bytes`."""

    def __init__(self, app: Any, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._too_large(send)
            return
        seen = 0

        async def limited() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise _TooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._too_large(send)

    async def _too_large(self, send: Send) -> None:
        body = json.dumps({"detail": f"request body larger than {self.max_bytes} bytes"}).encode()
        await send(
            {"type": "http.response.start", "status": 413, "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
        )
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass
