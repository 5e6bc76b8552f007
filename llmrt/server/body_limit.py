"""A request body limit: a body over ``max_bytes`` is answered 413 before it is parsed.

A declared ``Content-Length`` over the limit is refused before any of the body is read;
a chunked body is read up to the limit and refused once it passes it. Why a limit at all:
parsing JSON holds the GIL (~10 ms per MB), so one huge body would delay every other
connection's stream for as long as it parses.
"""

from __future__ import annotations

import json
from typing import Any

#: The default limit: a prompt of 128k tokens as JSON token ids is ~1 MB; 16 MiB leaves
#: room for many prompts and long tool definitions.
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024

Scope = dict[str, Any]
Message = dict[str, Any]


class BodyLimit:
    """ASGI middleware refusing HTTP bodies over ``max_bytes`` with an OpenAI-style 413."""

    def __init__(self, app: Any, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, declared)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                # The client left before sending the whole body: pass that on.
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send, size)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    async def _refuse(self, send: Any, size: int) -> None:
        payload = json.dumps(
            {
                "error": {
                    "message": f"request body of {size} bytes is over the server's limit of "
                    f"{self.max_bytes} bytes (llmrt serve --max-request-bytes)",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload, "more_body": False})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(messages: list[Message], receive: Any) -> Any:
    """A ``receive`` that hands out ``messages`` first, then defers to the real one (which
    reports the disconnect a streaming response watches for)."""
    queue = list(messages)

    async def replayed() -> Message:
        if queue:
            return queue.pop(0)
        message: Message = await receive()
        return message

    return replayed
