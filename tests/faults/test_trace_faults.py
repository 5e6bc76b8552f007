"""Trace capture and trace cleanup over a ``FaultyDevice``: a failed capture (injected
``capture_trace`` fault, a refresh fault while priming, or a program that raises) rolls back
its artifact and releases its inputs exactly once; cleanup releases every trace before any of
their inputs; a failing ``release_trace`` is retried by the next cleanup without double frees;
a failed input allocation captures nothing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import pytest
import torch
from lane_fixtures import (  # noqa: F401 (single_torch_thread: autouse)
    Lane,
    add_tracing,
    build_lane,
    page_table,
    single_torch_thread,
    tiny_llama,
)
from structlog.testing import capture_logs

from llmrt.device.torch import TorchDevice
from llmrt.errors import CleanupError, TraceStateError
from llmrt.families.base import CausalLM
from llmrt.runtime.tensor_resources import iter_tensors
from llmrt.runtime.trace_compiler import ArtifactState, TraceArtifact
from llmrt.runtime.warmup import CaptureBarrier
from llmrt.testing import FaultyDevice, InjectedFault

DECODE_INPUTS = 3  # tokens, positions, page_table
PREFILL_INPUTS = 5  # tokens, start_pos, seq_lens, page_table, last_token_index


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return tiny_llama()


@attrs.define
class Setup:
    lane: Lane
    device: FaultyDevice
    order: list[TraceArtifact]  # capture order
    inputs: dict[str, list[torch.Tensor]]  # trace key -> its persistent inputs, once allocated
    start: int  # index into device.calls where capture began
    retired: list[Any] = attrs.Factory(list)  # inputs of earlier passes, kept so ids stay unique

    def restart(self) -> None:
        """Check only a new capture pass from here on (older inputs kept alive, not reused)."""
        self.retired.append(dict(self.inputs))
        self.inputs.clear()
        self.start = len(self.device.calls)

    @property
    def traces(self) -> Any:
        assert self.lane.tracing is not None
        return self.lane.tracing.traces

    def calls(self, op: str, subject: object) -> list[bool]:
        """``injected`` of each ``op`` call on ``subject`` since capture began."""
        return [
            c.injected
            for c in self.device.calls[self.start :]
            if c.op == op and c.subject_id == id(subject)
        ]

    def released_once(self, keys: Sequence[str]) -> None:
        for key in keys:
            for tensor in self.inputs[key]:
                done = [i for i in self.calls("deallocate", tensor) if not i]
                assert len(done) == 1, f"an input of {key[:8]} released {len(done)} times"

    def untouched(self, keys: Sequence[str]) -> None:
        for key in keys:
            for tensor in self.inputs.get(key, ()):
                assert self.calls("deallocate", tensor) == []

    def cleanup(self) -> None:
        """Clean the lane (retrying spent faults); nothing may leak or be freed twice."""
        for _ in range(3):
            try:
                self.lane.cleanup()
                break
            except CleanupError:
                continue
        else:
            pytest.fail("cleanup never succeeded")
        self.lane.cleanup()
        self.released_once(list(self.inputs))
        stats = self.lane.inner.stats()
        assert stats.live_tensors == self.lane.baseline_live, "device tensors leaked"
        assert stats.live_traces == 0, "traces leaked"


def _setup(model: CausalLM, fail: Mapping[str, Any]) -> Setup:
    """A warmed 'all' lane whose capture is deferred (a two-lane barrier only this lane
    reports to), with each plan's inputs recorded when ``capture_all`` allocates them."""
    device = FaultyDevice(TorchDevice("cpu"), fail=fail)
    lane = build_lane(model=model, device=device, block_size=4, num_blocks=64, max_chunk=16)
    tracing = add_tracing(
        lane, mode="all", seq_lens=(8,), batch_sizes=(1,), barrier=CaptureBarrier(lanes=2)
    )
    tracing.warm()
    assert not tracing.warmup.captured
    inputs: dict[str, list[torch.Tensor]] = {}
    for key, artifact in tracing.traces.artifacts.items():

        def allocate(plan: Any = artifact.plan, key: str = key) -> Any:
            made = plan.allocate_inputs()
            inputs[key] = [t for _, t in iter_tensors(made)]
            return made

        artifact.plan = attrs.evolve(artifact.plan, allocate_inputs=allocate)
    order = tracing.traces.capture_order()
    assert len(order) >= 5 and order[0].plan.operation == "decode"
    assert all(a.plan.operation == "prefill" for a in order[1:])
    return Setup(lane=lane, device=device, order=order, inputs=inputs, start=len(device.calls))


def _raise_in_program(setup: Setup, index: int) -> None:
    artifact = setup.order[index]

    def boom(inputs: Any) -> Any:
        raise RuntimeError("kernel failed during capture")

    artifact.plan = attrs.evolve(artifact.plan, program=boom)


# -- capture failure: all or nothing ---------------------------------------------------

#: Artifacts of the setup lane in capture order (1 decode + 10 prefill geometries).
ARTIFACTS = 11


def _assert_rolled_back(setup: Setup, logs: list[dict[str, Any]]) -> None:
    """No live trace, every input of the pass freed once (traces first), gate reopened."""
    stats = setup.lane.inner.stats()
    assert stats.live_traces == 0, "a trace captured before the failure is still live"
    assert all(a.state is ArtifactState.REGISTERED for a in setup.order)
    assert all(a.trace is None and a.inputs is None for a in setup.order)
    assert not setup.traces.active
    assert not setup.lane.compiler.gate_closed, "the gate is back to its state before capture"
    setup.released_once(list(setup.inputs))
    calls = setup.device.calls[setup.start :]
    input_ids = {id(t) for ts in setup.inputs.values() for t in ts}
    releases = [i for i, c in enumerate(calls) if c.op == "release_trace"]
    frees = [i for i, c in enumerate(calls) if c.op == "deallocate" and c.subject_id in input_ids]
    if releases:
        assert max(releases) < min(frees), "traces are released before any input"
    names = [e["event"] for e in logs]
    assert names.count("trace.released") == names.count("trace.captured")
    assert "compile_gate.opened" in names and "trace.capture_rolled_back" in names
    assert "trace.activated" not in names


def _assert_full_capture(setup: Setup) -> None:
    """Every registered trace captured, replayable, the manifest complete."""
    assert setup.traces.active and setup.lane.compiler.gate_closed
    assert all(a.state is ArtifactState.CAPTURED for a in setup.order)
    for artifact in setup.order:
        for key in artifact.program_keys:
            assert setup.traces.has_trace(key)
    assert setup.lane.inner.stats().live_traces == ARTIFACTS
    assert setup.lane.tracing is not None
    setup.lane.tracing.executor.decode_forward(
        tokens=[3], start_pos=[5], page_table=page_table([[0, 1]], width=setup.lane.layout.width)
    )


@pytest.mark.parametrize("k", range(1, ARTIFACTS + 1))
def test_the_kth_capture_failing_rolls_back_everything_and_a_retry_captures_all(
    model: CausalLM, k: int
) -> None:
    setup = _setup(model, {"capture_trace": k})
    assert len(setup.order) == ARTIFACTS
    manifest = setup.lane.tracing.warmup.manifest() if setup.lane.tracing else None
    with capture_logs() as logs, pytest.raises(InjectedFault):
        setup.traces.capture_all()
    (failed,) = [e for e in logs if e["event"] == "trace.capture_failed"]
    assert failed["signature"] == setup.order[k - 1].plan.description
    _assert_rolled_back(setup, logs)
    assert len(setup.device.calls_of("release_trace")) == k - 1, "each captured trace once"

    setup.restart()
    setup.traces.capture_all()  # the fault is spent: the retry captures everything
    _assert_full_capture(setup)
    assert setup.lane.tracing is not None and setup.lane.tracing.warmup.manifest() == manifest
    setup.cleanup()


@pytest.mark.parametrize(
    ("fail", "error"),
    [({"refresh": DECODE_INPUTS + 2}, InjectedFault), ({}, RuntimeError)],
    ids=["prime_refresh", "program_raises"],
)
def test_a_failure_priming_or_running_a_capture_rolls_back_too(
    model: CausalLM, fail: Mapping[str, int], error: type[BaseException]
) -> None:
    setup = _setup(model, fail)
    if not fail:
        _raise_in_program(setup, 3)
    with capture_logs() as logs, pytest.raises(error):
        setup.traces.capture_all()
    _assert_rolled_back(setup, logs)
    setup.cleanup()


def test_a_failed_input_allocation_captures_nothing_and_frees_the_inputs_made(
    model: CausalLM,
) -> None:
    probe = _setup(model, {})
    allocations = len(probe.device.calls_of("allocate"))
    probe.cleanup()
    # Fail the third input of the first prefill artifact (after decode's three).
    setup = _setup(model, {"allocate": allocations + DECODE_INPUTS + 3})
    with capture_logs() as logs, pytest.raises(InjectedFault):
        setup.traces.capture_all()
    assert setup.device.calls_of("capture_trace") == ()
    _assert_rolled_back(setup, logs)
    setup.restart()
    setup.traces.capture_all()
    _assert_full_capture(setup)
    setup.cleanup()


def test_a_trace_the_rollback_cannot_release_blocks_the_retry_until_released(
    model: CausalLM,
) -> None:
    setup = _setup(model, {"capture_trace": 3, "release_trace": [1, 3]})
    with pytest.raises(InjectedFault):
        setup.traces.capture_all()
    stuck = setup.order[0]
    assert stuck.state is ArtifactState.FAILED and stuck.trace is not None
    setup.untouched([stuck.trace_key])  # never free an input under a live trace
    assert not setup.lane.compiler.gate_closed
    with pytest.raises(TraceStateError, match="still live"):
        setup.traces.capture_all()  # release_trace fails again: capture nothing over it
    assert setup.lane.inner.stats().live_traces == 1
    setup.restart()
    setup.traces.capture_all()  # the third release succeeds, then everything is captured
    _assert_full_capture(setup)
    setup.cleanup()


def test_the_barrier_commits_all_lanes_or_none(model: CausalLM) -> None:
    barrier = CaptureBarrier(lanes=2)
    devices = [
        FaultyDevice(TorchDevice("cpu"), fail={}),
        FaultyDevice(TorchDevice("cpu"), fail={"capture_trace": 1}),
    ]
    lanes = []
    for index, device in enumerate(devices):
        lane = build_lane(model=model, device=device, block_size=4, num_blocks=64, max_chunk=16)
        add_tracing(
            lane,
            mode="decode_only",
            seq_lens=(8,),
            batch_sizes=(1,),
            barrier=barrier,
            lane_index=index,
        )
        lanes.append(lane)
    assert lanes[0].tracing is not None and lanes[1].tracing is not None
    lanes[0].tracing.warm()
    with pytest.raises(InjectedFault):
        lanes[1].tracing.warm()  # the last lane's readiness commits the barrier: lane 1 fails
    for lane in lanes:
        assert lane.tracing is not None
        assert not lane.tracing.warmup.captured and not lane.tracing.traces.active
        assert lane.inner.stats().live_traces == 0, "lane 0's committed capture was rolled back"
        assert not lane.compiler.gate_closed
    assert not barrier.captured
    for lane in lanes:
        assert lane.tracing is not None
        lane.tracing.warmup.activate()  # the retry commits both lanes
    for lane in lanes:
        assert lane.tracing is not None
        assert lane.tracing.warmup.captured and lane.tracing.traces.active
        assert lane.inner.stats().live_traces == len(lane.tracing.traces.artifacts)
    for lane in lanes:
        lane.cleanup()


# -- cleanup ---------------------------------------------------------------------------


def _capture_and_replay(setup: Setup) -> None:
    setup.traces.capture_all()
    assert all(a.state is ArtifactState.CAPTURED for a in setup.order)
    assert setup.lane.tracing is not None
    setup.lane.tracing.executor.decode_forward(
        tokens=[3], start_pos=[5], page_table=page_table([[0, 1]], width=setup.lane.layout.width)
    )


def test_cleanup_releases_every_trace_before_its_inputs(model: CausalLM) -> None:
    setup = _setup(model, {})
    _capture_and_replay(setup)
    handles = {a.trace_key: a.trace for a in setup.order}
    calls = setup.device.calls
    mark = len(calls)
    setup.cleanup()
    calls = setup.device.calls[mark:]
    release_at = {
        key: [i for i, c in enumerate(calls) if c.op == "release_trace" and c.subject_id == id(h)]
        for key, h in handles.items()
    }
    assert all(len(v) == 1 for v in release_at.values()), "each trace released once"
    input_ids = {id(t): key for key, ts in setup.inputs.items() for t in ts}
    frees = [
        (i, input_ids[c.subject_id])
        for i, c in enumerate(calls)
        if c.op == "deallocate" and c.subject_id in input_ids
    ]
    assert len(frees) == sum(len(ts) for ts in setup.inputs.values())
    for index, key in frees:
        assert release_at[key][0] < index, "an input was freed while its trace was alive"
    assert max(v[0] for v in release_at.values()) < min(i for i, _ in frees)


def test_a_failing_release_trace_is_retried_without_double_frees(model: CausalLM) -> None:
    setup = _setup(model, {"release_trace": 2})
    _capture_and_replay(setup)
    handles = {a.trace_key: a.trace for a in setup.order}
    with pytest.raises(CleanupError) as exc:
        setup.traces.cleanup()
    (stuck,) = [a for a in setup.order if a.trace is not None]
    handle = handles[stuck.trace_key]
    assert setup.calls("release_trace", handle) == [True]
    ((step, error),) = exc.value.failures
    assert step == f"release_trace {stuck.plan.description}" and isinstance(error, InjectedFault)
    assert stuck.trace is handle and stuck.state is ArtifactState.CAPTURED
    assert setup.lane.inner.stats().live_traces == 1
    setup.untouched([stuck.trace_key])  # never free an input under a live trace
    others = [a.trace_key for a in setup.order if a is not stuck]
    setup.released_once(others)
    setup.traces.cleanup()  # the retry
    assert setup.calls("release_trace", handle) == [True, False]
    assert stuck.state is ArtifactState.RELEASED
    assert setup.lane.inner.stats().live_traces == 0
    setup.released_once([a.trace_key for a in setup.order])
    setup.traces.cleanup()  # idempotent: nothing is released twice
    setup.cleanup()
