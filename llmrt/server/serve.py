"""Running the app: ``llmrt serve`` in the foreground, or a server on a thread (tests, bench).

The socket is bound before the runtime is built (``llmrt serve`` binds it before importing
the server at all), so ``--port 0`` reports its port at once and ``GET /health`` answers
503 while the model warms. SIGINT/SIGTERM stop accepting and let in-flight requests finish
for ``shutdown_timeout`` seconds; then every request still open is cut: its stream gets a
final chunk with ``finish_reason: "abort"`` and ``[DONE]`` (a non-streamed one its answer
so far), one log line each, and the lifespan tears the runtime down through its scopes; a
clean signalled shutdown exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Generator, Sequence
from types import FrameType

import uvicorn
from fastapi import FastAPI

from llmrt.recipe.loader import load_recipe
from llmrt.server.app import ServerState, create_app
from llmrt.server.body_limit import DEFAULT_MAX_REQUEST_BYTES
from llmrt.server.listen import StartingResponder, bind_socket
from llmrt.serving.llm import LLM

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "BackgroundServer", "bind_socket", "serve"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
#: How long the cut streams get to send their last chunk before uvicorn cancels them.
CUT_GRACE_S = 2.0


class _Server(uvicorn.Server):
    """uvicorn's server, except that a signal that shut it down gracefully is not raised
    again afterwards (a drained, torn-down server exits 0), and that ``cut_after`` seconds
    into a shutdown every open request is cut with a proper ending instead of its task
    being cancelled mid-stream."""

    def __init__(self, config: uvicorn.Config, *, state: ServerState, cut_after: float) -> None:
        super().__init__(config)
        self.state = state
        self.cut_after = cut_after
        self._cuts_asked = False

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        reason = f"still open {self.cut_after:g} s into shutdown (--shutdown-timeout)"
        cutter = asyncio.get_running_loop().call_later(
            self.cut_after, self.state.cut_streams, reason
        )
        try:
            await super().shutdown(sockets)
        finally:
            cutter.cancel()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A second SIGINT / SIGTERM during the shutdown cuts every open request now (each
        gets its ending: ``finish_reason="abort"``, ``[DONE]``), where uvicorn's forced exit
        cancelled the responses mid-write (500s, streams without an end, tracebacks). A third
        SIGINT is uvicorn's forced exit, for a shutdown that still hangs."""
        if not self.should_exit or self._cuts_asked:
            super().handle_exit(sig, frame)
            return
        self._cuts_asked = True
        self._captured_signals.append(sig)
        # Runs on the main thread between bytecodes; cut_all only sets a flag under the
        # engine loop's reentrant lock.
        self.state.cut_streams(f"{signal.Signals(sig).name} again during shutdown")

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def _config(app: FastAPI, *, shutdown_timeout: float, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        lifespan="on",
        log_config=None,
        log_level=log_level,
        access_log=False,
        # Past the timeout the streams are cut (``_Server.shutdown``); uvicorn's own
        # cancellation is only the backstop for a response that ignores its cut.
        timeout_graceful_shutdown=shutdown_timeout + CUT_GRACE_S,  # type: ignore[arg-type]
        http="h11",
        ws="none",
    )


def server_logging(level: str) -> None:
    """Send the server's standard-library log lines (access log, cut requests) to stderr
    from ``level`` (idempotent)."""
    logger = logging.getLogger("llmrt.server")
    logger.setLevel(level.upper())
    if not any(getattr(h, "llmrt_server", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler.llmrt_server = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False


def serve(
    *,
    recipe: str,
    overrides: Sequence[str] = (),
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    sock: socket.socket | None = None,
    starting: StartingResponder | None = None,
    api_key: str | None = None,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    log_level: str = "warning",
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    allowed_origins: Sequence[str] = (),
) -> int:
    """``llmrt serve``: serve until SIGINT/SIGTERM; returns the exit status.

    ``sock`` is a socket already listening (owned from then on); without it one is bound
    on ``host:port``. ``starting`` is the responder answering 503 on it until now (stopped
    here, just before the server takes the socket over).
    """
    if sock is None:
        sock = bind_socket(host, port)
    try:
        loaded = load_recipe(recipe, overrides=list(overrides))
    except BaseException:
        if starting is not None:
            starting.stop()
        sock.close()
        raise
    server_logging(log_level)
    bound = sock.getsockname()[1]
    server: _Server | None = None

    def build() -> LLM:
        llm = LLM.from_recipe(loaded)
        # What bounds the service, as the engine runs it: requests decoded at once, and the
        # prompt tokens a step prefills while every stream waits for it.
        scheduling = llm.engine.scheduler.config
        print(
            f"llmrt serve: ready ({loaded.name}: {scheduling.max_num_seqs} requests at once, "
            f"{scheduling.max_num_batched_tokens} prompt tokens a step)",
            file=sys.stderr,
            flush=True,
        )
        return llm

    def fatal(exc: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    app = create_app(
        build=build,
        model_name=loaded.name,
        max_waiting=loaded.serving.max_waiting,
        api_key=api_key,
        on_fatal=fatal,
        max_request_bytes=max_request_bytes,
        allowed_origins=allowed_origins,
        freeze_heap=True,
    )
    server = _Server(
        _config(app, shutdown_timeout=shutdown_timeout, log_level=log_level),
        state=app.state.llmrt,
        cut_after=shutdown_timeout,
    )
    shown = f"[{host}]" if ":" in host else host
    print(
        f"llmrt serve: listening on http://{shown}:{bound} (model {loaded.name}; "
        "GET /health answers 503 until warm)",
        file=sys.stderr,
        flush=True,
    )
    if starting is not None:
        starting.stop()
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        sock.close()
    state: ServerState = app.state.llmrt
    if state.build_error is not None:
        raise state.build_error
    if state.loop is not None and state.loop.failed is not None:
        raise state.loop.failed
    print("llmrt serve: stopped", file=sys.stderr, flush=True)
    return 0


class BackgroundServer:
    """A real uvicorn server on a thread, on a free loopback port (tests and ``bench``).

    A context manager: entering starts it and waits until ``/health`` is ready; leaving
    shuts it down (draining for ``shutdown_timeout``) and re-raises a build failure.
    ``freeze_heap`` as ``create_app``'s: off here, since this process is not the server's
    alone (``llmrt serve`` turns it on).
    """

    def __init__(
        self,
        *,
        build: Callable[[], LLM],
        model_name: str,
        max_waiting: int,
        api_key: str | None = None,
        host: str = DEFAULT_HOST,
        shutdown_timeout: float = 5.0,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        allowed_origins: Sequence[str] = (),
        freeze_heap: bool = False,
    ) -> None:
        self.app = create_app(
            build=build,
            model_name=model_name,
            max_waiting=max_waiting,
            api_key=api_key,
            on_fatal=self._fatal,
            max_request_bytes=max_request_bytes,
            allowed_origins=allowed_origins,
            freeze_heap=freeze_heap,
        )
        self._sock = bind_socket(host, 0)
        self.port = int(self._sock.getsockname()[1])
        self.url = f"http://{host}:{self.port}"
        self._server = _Server(
            _config(self.app, shutdown_timeout=shutdown_timeout, log_level="warning"),
            state=self.state,
            cut_after=shutdown_timeout,
        )
        self._thread = threading.Thread(target=self._run, name="llmrt-server", daemon=True)
        self._error: BaseException | None = None

    @property
    def state(self) -> ServerState:
        state: ServerState = self.app.state.llmrt
        return state

    def _fatal(self, exc: BaseException) -> None:
        self._server.should_exit = True

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._sock]))
        except BaseException as exc:
            self._error = exc

    def start(self, *, timeout: float = 300.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while self.state.loop is None:
            if self.state.build_error is not None or not self._thread.is_alive():
                self.stop()
                raise RuntimeError("the server failed to start") from (
                    self.state.build_error or self._error
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"server not ready after {timeout} s")
            time.sleep(0.02)
        return self

    def stop(self, *, timeout: float = 60.0) -> None:
        """Shut down gracefully and join (idempotent)."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._sock.close()
        if self._thread.is_alive():
            raise RuntimeError(f"server thread still running after {timeout} s")
        if self._error is not None:
            raise self._error

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
