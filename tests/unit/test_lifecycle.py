"""The lifecycle log: catalogue, levels, audit file, capture_logs and filtering cost."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from llmrt.errors import ConfigError
from llmrt.lifecycle.events import (
    CATALOGUE,
    EVENT_LEVELS,
    LifecycleEvent,
    component_logger,
    configure_logging,
    emit,
    object_id,
)

BRIEF_EVENTS = {
    "scope.entered", "scope.exited", "kv.configured", "kv.allocated", "kv.bound",
    "kv.released", "program.compiled", "program.recompiled", "trace.registered",
    "trace.captured", "trace.capture_failed", "trace.replayed", "trace.released",
    "compile_gate.closed", "output.submitted", "output.completed", "output.drained",
    "lease.created", "lease.released", "cleanup.step", "cleanup.failed",
    "warmup.completed", "lane.ready",
}


class CountingProcessor:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, logger: Any, method: str, event_dict: Any) -> Any:
        self.calls += 1
        return event_dict


def read_audit(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_catalogue_covers_the_runtime_events() -> None:
    assert BRIEF_EVENTS <= CATALOGUE
    assert EVENT_LEVELS["trace.replayed"] == 10  # per step: debug, never on by default
    assert EVENT_LEVELS["cleanup.failed"] == 30
    assert EVENT_LEVELS["kv.allocated"] == 20


def test_audit_file_lines_are_json_with_bound_identity(tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    configure_logging(level="warning", audit_path=str(audit), console=False)
    log = component_logger("paged_kv_cache", lane=1, object_id="PagedKVCacheManager@0x1")

    emit(log, "kv.allocated", layers=2, shape=[8, 2, 32, 16])
    emit(log, LifecycleEvent.TRACE_REPLAYED, trace="abc")  # debug: below the audit level
    emit(log, "cleanup.failed", step="kv", error="boom")

    records = read_audit(audit)
    assert [r["event"] for r in records] == ["kv.allocated", "cleanup.failed"]
    first = records[0]
    assert first["component"] == "paged_kv_cache"
    assert first["lane"] == 1
    assert first["object_id"] == "PagedKVCacheManager@0x1"
    assert first["layers"] == 2
    assert first["shape"] == [8, 2, 32, 16]
    assert first["level"] == "info"
    assert "timestamp" in first
    assert records[1]["level"] == "warning"


def test_configure_is_idempotent_and_keeps_the_audit_file(tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    configure_logging(audit_path=audit, console=False)
    emit(component_logger("scope"), "scope.entered", scope="device")
    configure_logging(audit_path=audit, console=False)
    emit(component_logger("scope"), "scope.exited", scope="device")

    assert [r["event"] for r in read_audit(audit)] == ["scope.entered", "scope.exited"]
    sinks = [p for p in structlog.get_config()["processors"] if type(p).__name__ == "_Sinks"]
    assert len(sinks) == 1


def test_console_shows_only_events_at_its_level(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(level="warning")
    log = component_logger("trace_compiler", lane=0)
    emit(log, "trace.captured", trace="t1")
    emit(log, "trace.capture_failed", trace="t2", error="oom")
    err = capsys.readouterr().err
    assert "trace.capture_failed" in err
    assert "trace.captured " not in err
    assert "lane=0" in err


def test_unknown_event_is_rejected_even_when_filtered() -> None:
    configure_logging(level="critical", console=False)
    log = component_logger("scope")
    with pytest.raises(ValueError, match=r"event: is not a lifecycle event.*'kv\.alocated'"):
        emit(log, "kv.alocated")
    with pytest.raises(ConfigError):
        emit(log, "scope.entred")


def test_filtered_events_never_reach_a_processor() -> None:
    configure_logging(level="warning", console=False)
    counter = CountingProcessor()
    structlog.get_config()["processors"].insert(0, counter)
    log = component_logger("output_reader", lane=0)

    for _ in range(100):
        emit(log, "output.submitted", sequence=1)
        emit(log, "kv.bound")
    assert counter.calls == 0
    emit(log, "cleanup.failed", step="reads", error="x")
    assert counter.calls == 1


def test_capture_logs_sees_loggers_bound_before_it() -> None:
    configure_logging(level="debug", console=False)
    log = component_logger("decode_runtime", lane=2, object_id="DecodeRuntime@0x2")
    with capture_logs() as logs:
        emit(log, LifecycleEvent.LEASE_CREATED, rows=3)
    assert logs == [
        {
            "event": "lease.created",
            "log_level": "debug",
            "component": "decode_runtime",
            "lane": 2,
            "object_id": "DecodeRuntime@0x2",
            "rows": 3,
        }
    ]
    assert type(logs[0]["event"]) is str


def test_bad_levels_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"logging\.level: must be one of"):
        configure_logging(level="verbose")
    with pytest.raises(ConfigError, match=r"logging\.audit_level: must be one of"):
        configure_logging(audit_level="loud")


def test_object_id_names_type_and_identity() -> None:
    thing = object()
    assert object_id(thing) == f"object@{id(thing):#x}"


def test_every_catalogued_event_is_emitted_somewhere_in_the_product() -> None:
    """A catalogue entry nothing emits is a promise the audit cannot check: remove it."""
    import pathlib

    import llmrt

    package = pathlib.Path(llmrt.__file__).parent
    sources = [p for p in package.rglob("*.py") if p.name != "lifecycle.py"]
    containers = package.parent / "containers"
    if containers.is_dir():
        sources += list(containers.rglob("*.py"))
    else:  # installed: llmrt.containers
        from llmrt import containers as installed

        sources += list(pathlib.Path(installed.__file__).parent.rglob("*.py"))
    text = "\n".join(p.read_text(encoding="utf-8") for p in sources)
    silent = sorted(name for name in CATALOGUE if f'"{name}"' not in text)
    assert silent == []
