"""Trace registration, capture, replay and cleanup over an exact ProgramCompiler.

Trace artifacts live in their own registry keyed by a trace signature; a
program maps to at most one artifact and several programs may alias one
artifact. Artifacts are never folded back into compiled-program records.

Lifecycle: register capture plans -> ``capture_all`` (closes the compile gate,
allocates every persistent input before the first capture, captures decode
before prefill and larger batches first) -> replay -> ``cleanup`` (release
traces, then their inputs).

Capture is all or nothing: if any allocation or capture of a pass fails, every trace that
pass captured is released, then every input it allocated, the compile gate is restored to
its state before the pass, and the artifacts return to ``registered`` so a retry captures
everything again. ``uncapture`` rolls a committed pass back the same way (a lane group whose
later lane failed to capture).
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from llmrt.device.base import Device
from llmrt.errors import CleanupError, CompileGateClosed, TraceCoverageError, TraceStateError
from llmrt.lifecycle.events import component_logger, emit
from llmrt.runtime.program_compiler import ProgramCompiler
from llmrt.runtime.tensor_resources import (
    ReleaseLedger,
    TensorResourceOrphan,
    release_tensors,
    retry_orphans,
)

_OPERATION_ORDER = {"decode": 0, "prefill": 1}


@attrs.frozen(kw_only=True, eq=False)
class TraceCapturePlan:
    """How to capture one program as a trace.

    ``allocate_inputs`` builds the persistent device inputs (run before any capture),
    ``prime_inputs`` writes capture-time values into them, and ``program`` is the
    device-only body replayed over those exact inputs.
    """

    program_key: str
    operation: str
    batch_size: int
    material: Mapping[str, Any]
    description: str
    allocate_inputs: Callable[[], Any]
    prime_inputs: Callable[[Any], None]
    program: Callable[[Any], Any]

    @property
    def trace_key(self) -> str:
        blob = json.dumps(
            {"operation": self.operation, **dict(self.material)},
            sort_keys=True,
            separators=(",", ":"),
            default=str,
        )
        return hashlib.sha256(blob.encode()).hexdigest()


class ArtifactState(enum.Enum):
    REGISTERED = "registered"
    INPUTS_READY = "inputs_ready"
    CAPTURED = "captured"
    FAILED = "failed"
    RELEASED = "released"


@attrs.define(kw_only=True, eq=False)
class TraceArtifact:
    """One captured trace: owned persistent inputs, the device trace and its outputs."""

    trace_key: str
    plan: TraceCapturePlan
    program_keys: list[str]
    state: ArtifactState = ArtifactState.REGISTERED
    inputs: Any = None
    trace: Any = None
    replays: int = 0
    replay_state: dict[str, Any] = attrs.field(factory=dict)

    @property
    def outputs(self) -> Any:
        if self.trace is None:
            raise TraceStateError(f"trace {self.plan.description} is not captured")
        return self.trace.outputs


class TraceCompiler:
    """Owns trace IDs, persistent trace inputs and trace outputs for one lane."""

    def __init__(self, *, program_compiler: ProgramCompiler, device: Device, lane: int = 0) -> None:
        self.program_compiler = program_compiler
        self.borrowed_device = device
        self.lane = lane
        self._artifacts: dict[str, TraceArtifact] = {}
        self._by_program: dict[str, str] = {}
        self._active = False
        self._ledger = ReleaseLedger()
        self._orphans: list[TensorResourceOrphan] = []
        self._gate_was_closed = False  # the compile gate's state before the last capture pass
        self._orphaned: set[str] = set()  # trace keys a rollback could not release
        self._log = component_logger("trace_compiler", lane=lane, object_id=f"{id(self):#x}")

    @property
    def active(self) -> bool:
        return self._active

    @property
    def artifacts(self) -> Mapping[str, TraceArtifact]:
        return dict(self._artifacts)

    def replay_counts(self) -> dict[str, int]:
        return {a.plan.description: a.replays for a in self._artifacts.values()}

    def has_trace(self, program_key: str) -> bool:
        key = self._by_program.get(program_key)
        return key is not None and self._artifacts[key].state is ArtifactState.CAPTURED

    def is_registered(self, program_key: str) -> bool:
        return program_key in self._by_program

    # -- registration --------------------------------------------------------------------

    def register_capture_plan(self, plan: TraceCapturePlan) -> str:
        """Register ``plan`` for a compiled program; equal trace keys become aliases."""
        if plan.program_key not in self.program_compiler:
            raise TraceStateError(
                f"cannot register a trace for {plan.description}: program {plan.program_key[:12]} "
                "is not compiled by this lane's ProgramCompiler"
            )
        existing = self._by_program.get(plan.program_key)
        if existing is not None:
            return existing
        if self._active or self.program_compiler.gate_closed:
            raise CompileGateClosed(plan.trace_key, f"trace for {plan.description}")
        trace_key = plan.trace_key
        artifact = self._artifacts.get(trace_key)
        if artifact is None:
            artifact = TraceArtifact(
                trace_key=trace_key, plan=plan, program_keys=[plan.program_key]
            )
            self._artifacts[trace_key] = artifact
        else:
            artifact.program_keys.append(plan.program_key)
        self._by_program[plan.program_key] = trace_key
        emit(
            self._log,
            "trace.registered",
            trace=trace_key[:16],
            program=plan.program_key[:16],
            operation=plan.operation,
            signature=plan.description,
            alias=len(artifact.program_keys) > 1,
        )
        return trace_key

    # -- capture -------------------------------------------------------------------------

    def capture_order(self) -> list[TraceArtifact]:
        """Decode before prefill; larger batches, then wider page tables, first (one CUDA graph
        pool fits them all: a width's attention buffers grow with it, and its description
        sorts as text, w128 before w16)."""
        return sorted(
            (a for a in self._artifacts.values() if a.state is not ArtifactState.RELEASED),
            key=lambda a: (
                _OPERATION_ORDER.get(a.plan.operation, 2),
                -a.plan.batch_size,
                -int(a.plan.material.get("page_table_width", 0)),
                a.plan.description,
            ),
        )

    def capture_all(self) -> None:
        """Close the compile gate, allocate all inputs, capture every registered trace.

        All or nothing: a failure rolls the pass back (see the module docstring) and re-raises.
        """
        self._finish_rollback()
        self._gate_was_closed = self.program_compiler.gate_closed
        self.program_compiler.close_gate(reason="trace capture")
        pending = [a for a in self.capture_order() if a.state is ArtifactState.REGISTERED]
        try:
            for artifact in pending:
                artifact.inputs = artifact.plan.allocate_inputs()
                artifact.state = ArtifactState.INPUTS_READY
            for artifact in pending:
                self._capture_one(artifact)
        except BaseException as exc:
            self._roll_back(pending, cause=exc)
            raise
        self._active = True
        emit(self._log, "trace.activated", traces=len(self._artifacts))

    def uncapture(self) -> None:
        """Roll a committed capture back: release its traces, then its inputs, reopen the gate
        if capture closed it; the artifacts are registered again (a later capture redoes them)."""
        captured = [a for a in self.capture_order() if a.state is not ArtifactState.REGISTERED]
        self._roll_back(captured, cause=None)

    def _roll_back(self, artifacts: list[TraceArtifact], *, cause: BaseException | None) -> None:
        """Traces first, then inputs; restore the gate; a release that fails stays an orphan."""
        stuck: list[str] = []
        traces = 0
        for artifact in artifacts:
            if artifact.trace is None:
                continue
            try:
                self.borrowed_device.release_trace(artifact.trace)
            except Exception as exc:
                artifact.state = ArtifactState.FAILED
                stuck.append(artifact.plan.description)
                self._orphaned.add(artifact.trace_key)
                emit(
                    self._log,
                    "resource.orphaned",
                    path=_orphan_path(artifact),
                    error=f"{type(exc).__name__}: {exc}",
                )
                if cause is not None:
                    cause.add_note(f"rollback could not release trace {artifact.plan.description}")
                continue
            artifact.trace = None
            traces += 1
            emit(self._log, "trace.released", trace=artifact.trace_key[:16], rollback=True)
            self._recovered(artifact)
        inputs = 0
        for artifact in artifacts:
            if artifact.trace is not None:
                continue  # its trace still reads these inputs: released with it, later
            if artifact.inputs is not None:
                self._orphans.extend(
                    release_tensors(
                        artifact.inputs, device=self.borrowed_device, ledger=self._ledger
                    )
                )
                artifact.inputs = None
                inputs += 1
            artifact.state = ArtifactState.REGISTERED
        self._active = False
        if not self._gate_was_closed:
            self.program_compiler.open_gate(reason="trace capture rolled back")
        emit(
            self._log,
            "trace.capture_rolled_back",
            traces_released=traces,
            inputs_released=inputs,
            traces_stuck=stuck,
            orphans=len(self._orphans),
            error=f"{type(cause).__name__}: {cause}" if cause is not None else None,
        )

    def _finish_rollback(self) -> None:
        """Before a retry: free what an earlier rollback could not; refuse to capture over it."""
        stuck = [a for a in self._artifacts.values() if a.state is ArtifactState.FAILED]
        if stuck:
            self._roll_back(stuck, cause=None)
        if self._orphans:
            self._orphans = retry_orphans(
                self._orphans, device=self.borrowed_device, ledger=self._ledger
            )
        still = [a.plan.description for a in stuck if a.state is ArtifactState.FAILED]
        if still:
            raise TraceStateError(
                f"lane {self.lane}: cannot capture while trace(s) {still} from a failed capture "
                "are still live (release_trace failed again); cleanup() releases them"
            )

    def _capture_one(self, artifact: TraceArtifact) -> None:
        plan = artifact.plan
        try:
            plan.prime_inputs(artifact.inputs)
            inputs = artifact.inputs
            artifact.trace = self.borrowed_device.capture_trace(lambda: plan.program(inputs))
        except BaseException as exc:
            artifact.trace = None  # the rollback releases its inputs with everyone else's
            emit(
                self._log,
                "trace.capture_failed",
                trace=artifact.trace_key[:16],
                signature=plan.description,
                error=f"{type(exc).__name__}: {exc}",
            )
            raise
        artifact.state = ArtifactState.CAPTURED
        emit(
            self._log,
            "trace.captured",
            trace=artifact.trace_key[:16],
            signature=plan.description,
            programs=len(artifact.program_keys),
        )

    def _recovered(self, artifact: TraceArtifact) -> None:
        """An orphaned trace freed later, by whichever path: say so (``llmrt audit``)."""
        if artifact.trace_key in self._orphaned:
            self._orphaned.discard(artifact.trace_key)
            emit(self._log, "resource.recovered", path=_orphan_path(artifact), kind="trace")

    # -- replay --------------------------------------------------------------------------

    def artifact_for(self, program_key: str, *, operation: str, description: str) -> TraceArtifact:
        """The captured artifact for a program, or ``TraceCoverageError`` (preflight)."""
        trace_key = self._by_program.get(program_key)
        artifact = self._artifacts.get(trace_key) if trace_key is not None else None
        if artifact is None or artifact.state is not ArtifactState.CAPTURED:
            emit(
                self._log,
                "trace.coverage_missed",
                operation=operation,
                signature=description,
                registered=artifact is not None,
            )
            raise TraceCoverageError(operation, [description])
        return artifact

    def replay(
        self, artifact: TraceArtifact, *, refresh: Callable[[Any, TraceArtifact], object]
    ) -> Any:
        """Refresh the persistent inputs, execute the trace without blocking, return its outputs."""
        if artifact.state is not ArtifactState.CAPTURED:
            raise TraceStateError(f"trace {artifact.plan.description} is {artifact.state.value}")
        refresh(artifact.inputs, artifact)
        self.borrowed_device.execute_trace(artifact.trace, blocking=False)
        artifact.replays += 1
        emit(
            self._log,
            "trace.replayed",
            trace=artifact.trace_key[:16],
            signature=artifact.plan.description,
            replays=artifact.replays,
        )
        return artifact.trace.outputs

    # -- cleanup -------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Release every trace, then every persistent input. Idempotent; retries failures."""
        failures: list[tuple[str, BaseException]] = []
        for artifact in self._artifacts.values():
            if artifact.trace is not None:
                try:
                    self.borrowed_device.release_trace(artifact.trace)
                except Exception as exc:
                    failures.append((f"release_trace {artifact.plan.description}", exc))
                    continue
                artifact.trace = None
                emit(self._log, "trace.released", trace=artifact.trace_key[:16])
                self._recovered(artifact)
        for artifact in self._artifacts.values():
            if artifact.trace is None and artifact.inputs is not None:
                self._orphans.extend(
                    release_tensors(
                        artifact.inputs, device=self.borrowed_device, ledger=self._ledger
                    )
                )
                artifact.inputs = None
            if artifact.trace is None:
                artifact.state = ArtifactState.RELEASED
        if self._orphans:
            self._orphans = retry_orphans(
                self._orphans, device=self.borrowed_device, ledger=self._ledger
            )
        failures.extend((f"deallocate {o.path}", o.error) for o in self._orphans)
        self._active = False
        if failures:
            raise CleanupError(failures)


def _orphan_path(artifact: TraceArtifact) -> str:
    return f"trace {artifact.trace_key[:16]}"
