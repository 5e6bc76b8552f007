"""One access-log line per HTTP request, at ``info`` on the ``llmrt.server.access`` logger.

The line names the client, method, route, status, the request's prompt and completion
tokens (``-`` where the route generates nothing) and the latency from the request's arrival
to its last body byte (a stream's whole duration), as vLLM's and llama-server's logs do.
Routes report their token counts through :func:`usage_of` on the request's ASGI scope.
"""

from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping
from typing import Any

import attrs

LOGGER = logging.getLogger("llmrt.server.access")
_SCOPE_KEY = "llmrt.usage"


@attrs.define(kw_only=True, eq=False)
class RequestUsage:
    """The token counts a route fills in for its access-log line."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def usage_of(scope: MutableMapping[str, Any]) -> RequestUsage:
    """The request's usage record (created here when the middleware is not installed)."""
    usage = scope.get(_SCOPE_KEY)
    if not isinstance(usage, RequestUsage):
        usage = RequestUsage()
        scope[_SCOPE_KEY] = usage
    return usage


class AccessLog:
    """ASGI middleware writing one line per HTTP request once its response ended."""

    def __init__(self, app: Any, *, logger: logging.Logger = LOGGER) -> None:
        self.app = app
        self.logger = logger

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.logger.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        usage = usage_of(scope)
        status = 500
        logged = False

        def log(final_status: int) -> None:
            nonlocal logged
            if logged:
                return
            logged = True
            client = scope.get("client")
            who = f"{client[0]}:{client[1]}" if client else "-"
            self.logger.info(
                '%s "%s %s" %d prompt_tokens=%s completion_tokens=%s latency=%.3fs',
                who,
                scope.get("method", "-"),
                scope.get("path", "-"),
                final_status,
                "-" if usage.prompt_tokens is None else usage.prompt_tokens,
                "-" if usage.completion_tokens is None else usage.completion_tokens,
                time.perf_counter() - start,
            )

        async def logged_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                log(status)

        try:
            await self.app(scope, receive, logged_send)
        finally:
            log(status)
