"""A failure at every port operation, in every phase, driven through the container.

``FaultyDevice`` is injected by overriding the device provider (the dependency-injector way),
so the runtime's own startup, serving and teardown code runs: the container's scopes, the
lane executor's eight steps, the trace compiler's rollback. For each fault: the primary error
is preserved, every cleanup failure is reported, nothing is freed twice, whatever was left is
an orphan that a retry frees, and ``llmrt audit`` on the written log fails exactly when
something was left behind.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch
from dependency_injector import providers
from llmrt.containers import RuntimeContainer, close_runtime

from llmrt.device.torch import TorchDevice
from llmrt.errors import CleanupError
from llmrt.lifecycle.audit import check
from llmrt.lifecycle.events import configure_logging, reset_logging
from llmrt.recipe.loader import Recipe, load_recipe
from llmrt.runtime.prefill.plan import PrefillRow
from llmrt.sampling.params import SamplingParams
from llmrt.testing import FaultyDevice, InjectedFault

#: The smallest tiny-llama that still allocates KV, compiles, captures a decode trace,
#: serves a prefill and a traced decode with an asynchronous read, and tears down.
TINY = [
    "kv_cache.num_blocks=16",
    "decode.lane_capacity=2",
    "warmup.prefill_seq_lens=[32]",
    "warmup.prefill_batch_sizes=[1]",
    "decode.batch_sizes=[]",
]
PHASES = ("build", "warmup", "capture", "serving", "teardown")
GREEDY = SamplingParams(temperature=0.0)

#: Every port operation the scenario performs in each phase (guarded below): one case each.
MATRIX: dict[str, tuple[str, ...]] = {
    "build": ("lanes",),
    "warmup": ("allocate",),
    "capture": ("allocate", "refresh", "capture_trace"),
    "serving": (
        "upload",
        "deallocate",
        "read",
        "refresh",
        "execute_trace",
        "record_event",
        "event_synchronize",
    ),
    "teardown": ("release_trace", "deallocate", "synchronize", "close"),
}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def recipe() -> Recipe:
    return load_recipe("tiny-llama", overrides=TINY)


@attrs.define
class Outcome:
    container: RuntimeContainer
    device: FaultyDevice
    marks: dict[str, int]  # phase -> len(device.calls) at its end
    primary: BaseException | None
    cleanup: CleanupError | None
    failed_phase: str | None

    def ops_in(self, phase: str) -> list[str]:
        start = 0 if phase == PHASES[0] else self.marks[PHASES[PHASES.index(phase) - 1]]
        return [c.op for c in self.device.calls[start : self.marks[phase]]]


def _serve(container: RuntimeContainer) -> None:
    """One greedy prefill, one traced decode step read asynchronously."""
    group = container.lane_group()
    row = PrefillRow(source_row=0, tokens=torch.arange(1, 11), slot=0, block_ids=(0,))
    out = group.prefill_forward(rows=[row], sampling_params=[GREEDY])
    assert out.tokens is not None
    table = torch.full((2, group.lanes[0].layout.width), -1, dtype=torch.int32)
    table[0, 0] = 0
    lease = group.decode_forward(
        tokens=torch.tensor([int(out.tokens[0]), 0]),
        start_pos=torch.tensor([10, 0], dtype=torch.int32),
        page_table=table,
        sampling_params=[GREEDY, None],
        read_from_device=False,
    )
    host, _ = group.read_decode_output(lease, async_read=True)
    group.process_decode_output_host(host)


def run(recipe: Recipe, fail: dict[str, int], audit: Path) -> Outcome:
    """The whole lifecycle over a FaultyDevice, with the product's own error handling."""
    configure_logging(level="critical", audit_path=audit, console=False)
    device = FaultyDevice(TorchDevice("cpu"), fail=fail)
    container = RuntimeContainer(recipe=recipe)
    container.device.device.override(providers.Object(device))
    marks: dict[str, int] = {}
    primary: BaseException | None = None
    phase = "build"
    try:
        container.lane_group()
        marks[phase] = len(device.calls)
        phase = "warmup"
        startup = container.startup()
        startup.configure_kv_capacity()
        startup.allocate_kv_cache()
        startup.warmup_decode()
        marks[phase] = len(device.calls)
        phase = "capture"
        startup.warmup_prefill()
        startup.activate()
        marks[phase] = len(device.calls)
        phase = "serving"
        _serve(container)
        marks[phase] = len(device.calls)
        phase = "teardown"
    except Exception as exc:
        primary = exc
    cleanup: CleanupError | None = None
    try:
        close_runtime(container, primary=primary)
    except CleanupError as exc:
        cleanup = exc
    marks["teardown"] = len(device.calls)
    failed = phase if primary is not None or cleanup is not None else None
    return Outcome(container, device, marks, primary, cleanup, failed)


def _chain(error: BaseException | None) -> Iterator[BaseException]:
    while error is not None:
        yield error
        if isinstance(error, CleanupError):
            for _, inner in error.failures:
                yield from _chain(inner)
        error = error.__cause__ or error.__context__


def _audit_violations(path: Path) -> list[str]:
    events = [json.loads(line) for line in path.read_text().splitlines()]
    return [str(v) for v in check(enumerate(events, start=1))]


@pytest.fixture(scope="module")
def clean(recipe: Recipe, tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    outcome = run(recipe, {}, tmp_path_factory.mktemp("clean") / "audit.jsonl")
    reset_logging()
    return outcome


def test_the_scenario_exercises_every_operation_of_the_matrix(
    clean: Outcome, tmp_path: Path
) -> None:
    """Guards the matrix: a clean run performs exactly these operations in each phase."""
    assert clean.primary is None and clean.cleanup is None
    for phase in PHASES:
        assert tuple(dict.fromkeys(clean.ops_in(phase))) and set(clean.ops_in(phase)) == set(
            MATRIX[phase]
        ), phase


CASES = [(phase, op) for phase in PHASES for op in MATRIX[phase]]


@pytest.mark.parametrize(("phase", "op"), CASES, ids=[f"{p}-{o}" for p, o in CASES])
def test_a_fault_at_every_operation_is_reported_and_a_retry_frees_what_was_left(
    recipe: Recipe, clean: Outcome, tmp_path: Path, phase: str, op: str
) -> None:
    # The first call of ``op`` in ``phase`` (call numbers are deterministic).
    start = 0 if phase == PHASES[0] else clean.marks[PHASES[PHASES.index(phase) - 1]]
    before = len([c for c in clean.device.calls[:start] if c.op == op])
    audit = tmp_path / "audit.jsonl"
    outcome = run(recipe, {op: before + 1}, audit)
    injected = [c for c in outcome.device.calls if c.injected]
    assert [(c.op, outcome.device.calls.index(c) >= start) for c in injected] == [(op, True)]

    # The primary error is preserved (the fault itself, or an error caused by it).
    if outcome.primary is not None:
        assert any(isinstance(e, InjectedFault) for e in _chain(outcome.primary))
        if outcome.cleanup is not None:
            assert outcome.cleanup.primary is outcome.primary
    # Every failed cleanup step in the log is reported in the CleanupError.
    events = [json.loads(line) for line in audit.read_text().splitlines()]
    failed_steps = {
        f"lane{e['lane']}/{e['step']}"
        for e in events
        if e["event"] == "cleanup.failed" and e["component"] == "model_executor"
    }
    reported = {step for step, _ in outcome.cleanup.failures} if outcome.cleanup else set()
    assert failed_steps <= reported
    scope_failures = [
        e for e in events if e["event"] == "cleanup.failed" and e["component"] == "scope"
    ]
    assert bool(scope_failures) == (outcome.cleanup is not None)

    # The audit fails exactly when something was left behind ...
    left = outcome.container.root_scope().orphans()
    assert bool(left) == (outcome.cleanup is not None)
    violations = _audit_violations(audit)
    assert bool(violations) == bool(left), violations
    # ... and a retry (the fault is spent) frees it, after which the log audits clean.
    if left:
        close_runtime(outcome.container)
        assert outcome.container.root_scope().orphans() == []
        assert _audit_violations(audit) == []
    reset_logging()

    # Nothing leaked, nothing freed twice.
    devices = outcome.container.device.lane_devices() if outcome.marks.get("build") else ()
    for device in devices:
        stats = device.stats()
        assert (stats.live_tensors, stats.live_traces, stats.pending_reads) == (0, 0, 0)
        assert stats.deallocations == stats.allocations, "freed twice or never"
    frees = [c for c in outcome.device.calls if c.op == "deallocate" and not c.injected]
    assert len(frees) == sum(d.stats().deallocations for d in devices)
    releases = [c for c in outcome.device.calls if c.op == "release_trace" and not c.injected]
    assert len(releases) == sum(d.stats().captures for d in devices)
