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
from llmrt.errors import CleanupError
from llmrt.families.base import CausalLM
from llmrt.tensor_resources import iter_tensors
from llmrt.testing import FaultyDevice, InjectedFault
from llmrt.trace_compiler import ArtifactState, TraceArtifact
from llmrt.warmup import CaptureBarrier

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


# -- capture failure -------------------------------------------------------------------

# (fault plan, index of the failing artifact in capture order, expected error)
CAPTURE_FAILURES = {
    "capture_trace#1": ({"capture_trace": 1}, 0, InjectedFault),
    "capture_trace#3": ({"capture_trace": 3}, 2, InjectedFault),
    "capture_trace#5": ({"capture_trace": 5}, 4, InjectedFault),
    "prime_refresh": ({"refresh": DECODE_INPUTS + 2}, 1, InjectedFault),
    "program_raises": ({}, 3, RuntimeError),
}


@pytest.mark.parametrize("case", list(CAPTURE_FAILURES))
def test_a_failed_capture_rolls_back_and_releases_its_inputs_once(
    model: CausalLM, case: str
) -> None:
    fail, index, error = CAPTURE_FAILURES[case]
    setup = _setup(model, fail)
    if case == "program_raises":
        _raise_in_program(setup, index)
    with capture_logs() as logs, pytest.raises(error):
        setup.traces.capture_all()
    calls = [c.op for c in setup.device.calls[setup.start :]]
    assert "allocate" not in calls[calls.index("capture_trace") :], "inputs first, then captures"
    assert calls.count("allocate") == DECODE_INPUTS + (len(setup.order) - 1) * PREFILL_INPUTS
    failed = setup.order[index]
    assert failed.state is ArtifactState.FAILED
    assert failed.inputs is None and failed.trace is None
    assert not setup.traces.active and not setup.traces.has_trace(failed.plan.program_key)
    setup.released_once([failed.trace_key])
    before, after = setup.order[:index], setup.order[index + 1 :]
    assert all(a.state is ArtifactState.CAPTURED for a in before)
    assert all(a.state is ArtifactState.INPUTS_READY for a in after)
    setup.untouched([a.trace_key for a in (*before, *after)])
    (event,) = [e for e in logs if e["event"] == "trace.capture_failed"]
    assert event["signature"] == failed.plan.description and event["log_level"] == "warning"
    setup.cleanup()
    assert len(setup.device.calls_of("release_trace")) == index, "each captured trace once"


def test_a_failed_rollback_release_is_retried_by_cleanup(model: CausalLM) -> None:
    probe = _setup(model, {})
    deallocs_before_capture = len(probe.device.calls_of("deallocate"))
    probe.cleanup()
    failing = deallocs_before_capture + 1  # the first input the rollback releases
    setup = _setup(model, {"capture_trace": 1, "deallocate": failing})
    with pytest.raises(InjectedFault):
        setup.traces.capture_all()
    failed = setup.order[0]
    assert failed.state is ArtifactState.FAILED and failed.inputs is None
    first, *rest = setup.inputs[failed.trace_key]
    assert setup.calls("deallocate", first) == [True]
    for tensor in rest:
        assert setup.calls("deallocate", tensor) == [False]
    setup.cleanup()
    assert setup.calls("deallocate", first) == [True, False]


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


def test_a_failed_input_allocation_captures_nothing(model: CausalLM) -> None:
    probe = _setup(model, {})
    allocations = len(probe.device.calls_of("allocate"))
    probe.cleanup()
    # Fail the third input of the first prefill artifact (after decode's three).
    setup = _setup(model, {"allocate": allocations + DECODE_INPUTS + 3})
    with pytest.raises(InjectedFault):
        setup.traces.capture_all()
    assert setup.device.calls_of("capture_trace") == ()
    assert setup.order[0].state is ArtifactState.INPUTS_READY
    assert all(a.state is ArtifactState.REGISTERED for a in setup.order[1:])
    assert not setup.traces.active
    setup.cleanup()
