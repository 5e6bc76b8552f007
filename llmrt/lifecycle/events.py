"""The lifecycle log: structlog setup and the catalogue of lifecycle event names.

Every runtime transition is one event from ``LifecycleEvent``, emitted through ``emit`` on a
``component_logger`` that binds ``component``, ``lane`` and ``object_id``. An event's level is
fixed by the catalogue: per-step events (replays, reads, leases) are ``debug`` so a hot path
logs nothing at the default levels; failures are ``warning``.

Library use configures nothing: ``import llmrt`` leaves structlog and :mod:`logging` as they
were. Until structlog is configured (by ``configure_logging``, which the CLI calls from
``--log-level``/``--audit-log``, or by the application), events go to the standard-library
logger ``llmrt.lifecycle.events`` at their levels, so an application that never configures logging
sees only warnings (Python's last-resort handler writes them to stderr) and nothing on
stdout; ``logging.getLogger("llmrt").setLevel(...)`` plus a handler shows more.

``configure_logging`` keeps its state in structlog's configuration only (the audit file lives
in the final processor), and it edits the processor list in place, so loggers bound earlier
and ``structlog.testing.capture_logs`` both see the current processors. The level filter is
fixed when a logger is bound: call ``configure_logging`` before building components.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
from collections.abc import MutableMapping
from types import MappingProxyType
from typing import IO, Any, cast

import structlog
from structlog.typing import FilteringBoundLogger

from llmrt.errors import ConfigError


class LifecycleEvent(str, enum.Enum):
    """Every lifecycle event name the runtime may emit."""

    SCOPE_ENTERED = "scope.entered"
    SCOPE_EXITED = "scope.exited"
    SCOPE_OWNED = "scope.owned"
    DEVICE_OPENED = "device.opened"
    DEVICE_CLOSED = "device.closed"
    WEIGHTS_PLACED = "weights.placed"
    WEIGHTS_DEQUANTIZED = "weights.dequantized"
    LANE_READY = "lane.ready"
    CONFIG_SEALED = "config.sealed"
    KV_CONFIGURED = "kv.configured"
    KV_LAYOUT_RESOLVED = "kv.layout_resolved"
    KV_ALLOCATED = "kv.allocated"
    KV_BOUND = "kv.bound"
    KV_UNBOUND = "kv.unbound"
    KV_RELEASED = "kv.released"
    PROGRAM_COMPILED = "program.compiled"
    PROGRAM_RECOMPILED = "program.recompiled"
    PROGRAM_REJECTED = "program.rejected"
    PROGRAM_ARTIFACT_LOADED = "program.artifact_loaded"
    PROGRAM_ARTIFACT_SAVED = "program.artifact_saved"
    PROGRAM_ARTIFACT_REJECTED = "program.artifact_rejected"
    PROGRAM_ARTIFACT_SAVE_FAILED = "program.artifact_save_failed"
    PROGRAMS_RELEASED = "programs.released"
    TRACE_REGISTERED = "trace.registered"
    TRACE_CAPTURED = "trace.captured"
    TRACE_CAPTURE_FAILED = "trace.capture_failed"
    TRACE_CAPTURE_ROLLED_BACK = "trace.capture_rolled_back"
    TRACE_ACTIVATED = "trace.activated"
    TRACE_REPLAYED = "trace.replayed"
    TRACE_RELEASED = "trace.released"
    TRACE_COVERAGE_MISSED = "trace.coverage_missed"
    COMPILE_GATE_CLOSED = "compile_gate.closed"
    COMPILE_GATE_OPENED = "compile_gate.opened"
    WARMUP_STARTED = "warmup.started"
    WARMUP_COMPLETED = "warmup.completed"
    OUTPUT_READ = "output.read"
    OUTPUT_READ_FAILED = "output.read_failed"
    OUTPUT_SUBMITTED = "output.submitted"
    OUTPUT_COMPLETED = "output.completed"
    OUTPUT_DRAINED = "output.drained"
    LEASE_CREATED = "lease.created"
    LEASE_RELEASED = "lease.released"
    EXECUTOR_TERMINAL = "executor.terminal"
    CLEANUP_STARTED = "cleanup.started"
    CLEANUP_STEP = "cleanup.step"
    CLEANUP_FAILED = "cleanup.failed"
    CLEANUP_COMPLETED = "cleanup.completed"
    RESOURCE_ORPHANED = "resource.orphaned"
    RESOURCE_RECOVERED = "resource.recovered"


_DEBUG_EVENTS = frozenset(
    {
        LifecycleEvent.TRACE_REPLAYED,
        LifecycleEvent.OUTPUT_READ,
        LifecycleEvent.OUTPUT_SUBMITTED,
        LifecycleEvent.OUTPUT_COMPLETED,
        LifecycleEvent.LEASE_CREATED,
        LifecycleEvent.LEASE_RELEASED,
    }
)
_WARNING_EVENTS = frozenset(
    {
        LifecycleEvent.TRACE_CAPTURE_ROLLED_BACK,
        LifecycleEvent.OUTPUT_READ_FAILED,
        LifecycleEvent.PROGRAM_REJECTED,
        LifecycleEvent.PROGRAM_ARTIFACT_REJECTED,
        LifecycleEvent.PROGRAM_ARTIFACT_SAVE_FAILED,
        LifecycleEvent.TRACE_CAPTURE_FAILED,
        LifecycleEvent.TRACE_COVERAGE_MISSED,
        LifecycleEvent.CLEANUP_FAILED,
        LifecycleEvent.RESOURCE_ORPHANED,
    }
)

EVENT_LEVELS: MappingProxyType[str, int] = MappingProxyType(
    {
        e.value: logging.DEBUG
        if e in _DEBUG_EVENTS
        else logging.WARNING
        if e in _WARNING_EVENTS
        else logging.INFO
        for e in LifecycleEvent
    }
)
"""Event name -> the level it is logged at."""

CATALOGUE = frozenset(EVENT_LEVELS)
"""Every valid lifecycle event name."""

LEVELS = MappingProxyType(
    {
        "debug": logging.DEBUG,
        "info": logging.INFO,
        "warning": logging.WARNING,
        "error": logging.ERROR,
        "critical": logging.CRITICAL,
    }
)


def configure_logging(
    *,
    level: str = "warning",
    audit_path: str | os.PathLike[str] | None = None,
    console: bool = True,
    audit_level: str = "info",
) -> None:
    """Log to stderr (human-readable, from ``level``) and optionally to an audit file.

    The audit file gets one JSON object per line from ``audit_level`` up; it is truncated when
    first opened and kept open when called again with the same path (idempotent).
    """
    console_level = _resolve_level("logging.level", level)
    audit_floor = _resolve_level("logging.audit_level", audit_level)
    processors = structlog.get_config()["processors"]
    previous = next((p for p in processors if isinstance(p, _Sinks)), None)
    wanted = os.path.abspath(audit_path) if audit_path is not None else None
    audit_file: IO[str] | None = None
    if wanted is not None:
        if previous is not None and previous.audit_path == wanted:
            audit_file = previous.detach_audit()
        else:
            audit_file = open(wanted, "w", buffering=1, encoding="utf-8")  # noqa: SIM115
    if previous is not None:
        previous.close()
    sinks = _Sinks(
        console_level=console_level if console else None,
        audit=audit_file,
        audit_path=wanted,
        audit_level=audit_floor,
    )
    floors = [console_level] if console or audit_file is None else []
    floors += [audit_floor] if audit_file is not None else []
    chain = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        sinks,
    ]
    if isinstance(processors, list):
        processors[:] = chain
    else:
        processors = chain
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(min(floors)),
        logger_factory=structlog.ReturnLoggerFactory(),
        cache_logger_on_first_use=False,
    )


def reset_logging() -> None:
    """Close the audit file and restore structlog's defaults."""
    for processor in structlog.get_config()["processors"]:
        if isinstance(processor, _Sinks):
            processor.close()
    structlog.reset_defaults()


def component_logger(
    component: str, *, lane: int | None = None, object_id: str | None = None
) -> FilteringBoundLogger:
    """A logger bound to ``component``, ``lane`` and ``object_id`` (None when not applicable)."""
    logger = structlog.get_logger().bind(component=component, lane=lane, object_id=object_id)
    return cast(FilteringBoundLogger, logger)


def object_id(obj: object) -> str:
    """A log-friendly identity, ``TypeName@0x...``, matching the one errors print."""
    return f"{type(obj).__name__}@{id(obj):#x}"


#: Where events go while structlog is unconfigured (library use): the standard logging tree.
STDLIB_LOGGER = logging.getLogger("llmrt.lifecycle.events")


def emit(logger: FilteringBoundLogger, event: str, **fields: Any) -> None:
    """Log catalogued ``event`` at its level; unknown names raise, filtered ones cost a check."""
    name = event.value if isinstance(event, LifecycleEvent) else event
    level = EVENT_LEVELS.get(name)
    if level is None:
        raise ConfigError("event", event, "is not a lifecycle event (see LifecycleEvent)")
    if not structlog.is_configured():
        if STDLIB_LOGGER.isEnabledFor(level):
            record = {**structlog.get_context(logger), **fields}
            text = " ".join(f"{k}={v}" for k, v in record.items() if v is not None)
            STDLIB_LOGGER.log(
                level, "%s %s", name, text, extra={"lifecycle": {"event": name, **record}}
            )
        return
    if logger.is_enabled_for(level):
        logger.log(level, name, **fields)


def _resolve_level(field: str, level: str) -> int:
    resolved = LEVELS.get(level.lower()) if isinstance(level, str) else None
    if resolved is None:
        raise ConfigError(field, level, f"must be one of {', '.join(LEVELS)}")
    return resolved


class _Sinks:
    """Final processor: writes each event to the console and/or audit file, then drops it."""

    def __init__(
        self,
        *,
        console_level: int | None,
        audit: IO[str] | None,
        audit_path: str | None,
        audit_level: int,
    ) -> None:
        self.audit_path = audit_path
        self._audit = audit
        self._console_level = console_level
        self._audit_level = audit_level
        self._console = structlog.dev.ConsoleRenderer(colors=False)
        self._json = structlog.processors.JSONRenderer(sort_keys=False)

    def detach_audit(self) -> IO[str] | None:
        """Hand the open audit file to a new configuration."""
        audit, self._audit = self._audit, None
        return audit

    def close(self) -> None:
        audit, self._audit = self._audit, None
        if audit is not None:
            audit.close()

    def __call__(
        self, logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        level = LEVELS.get(str(event_dict.get("level", "")), logging.INFO)
        if self._audit is not None and level >= self._audit_level:
            record = structlog.processors.dict_tracebacks(logger, method_name, dict(event_dict))
            self._audit.write(str(self._json(logger, method_name, record)) + "\n")
        if self._console_level is not None and level >= self._console_level:
            line = self._console(logger, method_name, dict(event_dict))
            sys.stderr.write(f"{line}\n")
        raise structlog.DropEvent
