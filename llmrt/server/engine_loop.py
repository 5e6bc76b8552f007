"""One engine thread that every connection submits to: the continuous batch of the server.

The thread owns the :class:`~llmrt.serving.engine.Engine` (nothing else touches it while
the loop runs): it drains the inbox of submissions and aborts between steps, runs one
step, and hands each produced token to its connection's asyncio queue through
``loop.call_soon_threadsafe``. Connections never call the runtime and never hold a lock
across a generation; a request a connection gives up on is aborted at the next step
boundary, which returns its slot and KV blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from llmrt.errors import LLMRTError
from llmrt.sampling.params import SamplingParams
from llmrt.server.metrics import ServerMetrics
from llmrt.serving.engine import Engine, TokenEvent
from llmrt.serving.request import Request

LOGGER = logging.getLogger("llmrt.server")


class Overloaded(LLMRTError, RuntimeError):
    """More requests are queued than ``serving.max_waiting`` allows (HTTP 429)."""


class EngineUnavailable(LLMRTError, RuntimeError):
    """The loop is stopping or its engine failed; nothing new is accepted (HTTP 503)."""


@attrs.frozen(kw_only=True)
class Delta:
    """One generated token of one request, as its connection receives it."""

    choice: int
    token_id: int
    text: str
    logprob: float | None
    top_logprobs: dict[int, float] | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


@attrs.frozen(kw_only=True)
class Failure:
    """The request ends with this error: the engine's (HTTP 500, every request) or the
    request's own :class:`~llmrt.errors.RequestError` (HTTP 400, that request alone); a
    stream gets it as an error event."""

    choice: int
    error: BaseException
    own: bool = False
    """The request's own failure (the engine runs on), not the engine's."""


Item = Delta | Failure


@attrs.define(kw_only=True, eq=False)
class Ticket:
    """A connection's handle on one submitted request (borrowed by the engine thread)."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    choice: int
    sink: asyncio.Queue[Item]
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future[None]
    submitted: float
    label: str = ""
    """What log lines call this request (the HTTP response id and choice)."""
    request: Request | None = None
    last_token_time: float | None = None
    done: bool = False


class EngineLoop:
    """Steps one engine on a dedicated thread for every connection (owns the thread)."""

    def __init__(
        self,
        *,
        engine: Engine,
        max_waiting: int,
        metrics: ServerMetrics | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._on_failure = on_failure
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, Ticket]] = []
        self._pending_adds = 0
        self._engine_queued = 0
        self._slots = min(engine.scheduler.config.capacity, engine.scheduler.config.max_num_seqs)
        self._stopping = False
        self._cut_reason: str | None = None
        self._failed: BaseException | None = None
        self._live: dict[str, Ticket] = {}
        self._thread = threading.Thread(target=self._run, name="llmrt-engine", daemon=True)
        self.peak_running = 0

    # -- connection side (event-loop thread) --------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def failed(self) -> BaseException | None:
        return self._failed

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self._failed is None

    async def submit(
        self,
        *,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        choice: int,
        sink: asyncio.Queue[Item],
        label: str = "",
    ) -> Ticket:
        """Queue one request; returns once the engine accepted it.

        Raises :class:`Overloaded` when ``max_waiting`` requests already wait for a decode
        slot (submitted, running or not, beyond the engine's slots), the engine's
        :class:`~llmrt.errors.RequestError` for a request it refuses, and
        :class:`EngineUnavailable` while stopping.
        """
        loop = asyncio.get_running_loop()
        ticket = Ticket(
            prompt_token_ids=tuple(prompt_token_ids),
            params=params,
            choice=choice,
            sink=sink,
            loop=loop,
            accepted=loop.create_future(),
            submitted=time.perf_counter(),
            label=label,
        )
        with self._cond:
            if self._stopping or self._failed is not None:
                raise EngineUnavailable("the engine is not accepting requests")
            # Only what the engine could not schedule waits: submissions not yet picked up
            # count as waiting only beyond the slots that would take them.
            if self._pending_adds + self._engine_queued >= self._slots + self.max_waiting:
                raise Overloaded(
                    f"serving.max_waiting={self.max_waiting} requests already wait for one "
                    f"of the {self._slots} decode slots"
                )
            self._inbox.append(("add", ticket))
            self._pending_adds += 1
            self._cond.notify()
        try:
            await ticket.accepted
        except asyncio.CancelledError:
            self.abort(ticket)
            raise
        return ticket

    def abort(self, ticket: Ticket) -> None:
        """Abort the ticket's request at the next step boundary (idempotent, thread-safe)."""
        if ticket.done:
            return
        with self._cond:
            self._inbox.append(("abort", ticket))
            self._cond.notify()

    def cut_all(self, reason: str) -> None:
        """End every request still queued or running now, each with a final
        ``finish_reason="abort"`` delta and one log line naming ``reason`` (thread-safe)."""
        with self._cond:
            self._cut_reason = reason
            self._cond.notify()

    def stop(self, *, timeout: float = 30.0) -> None:
        """Abort everything still running and join the thread (idempotent)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"engine thread still running after {timeout} s")

    # -- engine side (the engine thread) ------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (
                        self._inbox or self._stopping or self._cut_reason or self.engine.has_work
                    ):
                        self._cond.wait()
                    inbox, self._inbox = self._inbox, []
                    stopping = self._stopping
                    cut, self._cut_reason = self._cut_reason, None
                self._drain(inbox)
                if cut is not None:
                    self._cut_live(cut)
                if stopping:
                    self._abort_live()
                    return
                if self.engine.has_work:
                    running = len(self.engine.scheduler.running)
                    events = self.engine.step()
                    self._after_step(events, running_before=running)
                self._observe()
        except BaseException as exc:
            self._fail(exc)

    def _drain(self, inbox: Sequence[tuple[str, Ticket]]) -> None:
        adds = 0
        for kind, ticket in inbox:
            if kind == "add":
                adds += 1
                self._add(ticket)
            elif ticket.request is not None and not ticket.done:
                self.engine.abort(ticket.request)
                self._finish(ticket, "abort")
        scheduler = self.engine.scheduler
        queued = len(scheduler.waiting) + len(scheduler.running)
        with self._cond:
            self._pending_adds -= adds
            self._engine_queued = queued

    def _add(self, ticket: Ticket) -> None:
        try:
            request = self.engine.add_request(
                prompt_token_ids=ticket.prompt_token_ids, params=ticket.params, index=ticket.choice
            )
        except LLMRTError as exc:
            ticket.done = True
            _post(ticket.loop, _reject, ticket.accepted, exc)
            return
        ticket.request = request
        self._live[request.request_id] = ticket
        _post(ticket.loop, _accept, ticket.accepted)

    def _after_step(self, events: Sequence[TokenEvent], *, running_before: int) -> None:
        now = time.perf_counter()
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Item], Item]]] = {}
        running = max(running_before, len(self.engine.scheduler.running))
        self.peak_running = max(self.peak_running, running)
        for event in events:
            ticket = self._live.get(event.request_id)
            if ticket is None:
                continue
            item: Item = self._delta(ticket, event)
            if event.error is not None:
                item = Failure(choice=ticket.choice, error=event.error, own=True)
                LOGGER.warning(
                    "llmrt serve: %s failed: %s", ticket.label or "a request", event.error
                )
            batches.setdefault(ticket.loop, []).append((ticket.sink, item))
            if self.metrics is not None:
                start = ticket.last_token_time
                if start is None:
                    self.metrics.ttft.observe(now - ticket.submitted)
                    self.metrics.prompt_tokens.inc(len(ticket.prompt_token_ids))
                else:
                    self.metrics.itl.observe(now - start)
                self.metrics.generation_tokens.inc()
            ticket.last_token_time = now
            if event.finished:
                self._live.pop(event.request_id, None)
                ticket.done = True
                if self.metrics is not None:
                    self.metrics.finished(event.finish_reason or "abort")
                    self.metrics.e2e.observe(now - ticket.submitted)
        for loop, items in batches.items():
            _post(loop, _deliver, items)
        if self.metrics is not None:
            self.metrics.steps.inc()
            if running:
                self.metrics.running_per_step.observe(running)

    def _delta(self, ticket: Ticket, event: TokenEvent) -> Delta:
        request = ticket.request
        if request is None:
            raise AssertionError("event for a request never accepted")
        wants = request.params.logprobs is not None
        return Delta(
            choice=ticket.choice,
            token_id=event.token_id,
            text=event.text,
            logprob=request.logprobs[-1] if wants and request.logprobs else None,
            top_logprobs=(request.top_logprobs[-1] if wants and request.top_logprobs else None),
            finish_reason=event.finish_reason if event.finished else None,
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=len(request.output_token_ids),
        )

    def _finish(self, ticket: Ticket, reason: str) -> None:
        """End a ticket without a token (aborted): its connection gets a last empty delta."""
        ticket.done = True
        request = ticket.request
        if request is not None:
            self._live.pop(request.request_id, None)
        if self.metrics is not None:
            self.metrics.finished(reason)
        final = Delta(
            choice=ticket.choice,
            token_id=-1,
            text="",
            logprob=None,
            top_logprobs=None,
            finish_reason=reason,
            prompt_tokens=len(ticket.prompt_token_ids),
            completion_tokens=0 if request is None else len(request.output_token_ids),
        )
        _post(ticket.loop, _deliver, [(ticket.sink, final)])

    def _cut_live(self, reason: str) -> None:
        for ticket in list(self._live.values()):
            request = ticket.request
            made = 0 if request is None else len(request.output_token_ids)
            LOGGER.warning(
                "llmrt serve: cut %s after %d generated tokens (%s)",
                ticket.label or "a request",
                made,
                reason,
            )
            if request is not None:
                self.engine.abort(request)
            self._finish(ticket, "abort")

    def _abort_live(self) -> None:
        for ticket in list(self._live.values()):
            if ticket.request is not None:
                self.engine.abort(ticket.request)
            self._finish(ticket, "abort")
        self.engine.abort_all()
        self._observe()

    def _observe(self) -> None:
        scheduler = self.engine.scheduler
        queued = len(scheduler.waiting) + len(scheduler.running)
        with self._cond:
            self._engine_queued = queued
            pending = self._pending_adds
        if self.metrics is not None:
            self.metrics.observe_engine(self.engine, pending=pending)

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self._failed = exc
            inbox, self._inbox = self._inbox, []
        for kind, ticket in inbox:
            if kind == "add":
                _post(ticket.loop, _reject, ticket.accepted, EngineUnavailable(str(exc)))
        for ticket in list(self._live.values()):
            ticket.done = True
            _post(ticket.loop, _deliver, [(ticket.sink, Failure(choice=ticket.choice, error=exc))])
        self._live.clear()
        # The engine already failed; that failure is the one reported, carrying this one.
        try:
            self.engine.abort_all()
        except Exception as abort_error:
            exc.add_note(f"aborting the engine's requests also failed: {abort_error!r}")
            LOGGER.warning(
                "engine loop: abort_all failed after the engine failed (%r); requests may "
                "still hold KV blocks until the engine is closed",
                abort_error,
                exc_info=abort_error,
            )
        if self._on_failure is not None:
            self._on_failure(exc)


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn`` on the connection's event loop; a closed loop has nobody left to tell."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _deliver(items: Sequence[tuple[asyncio.Queue[Item], Item]]) -> None:
    for sink, item in items:
        sink.put_nowait(item)


def _accept(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _reject(future: asyncio.Future[None], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
