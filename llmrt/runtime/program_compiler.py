"""Eager program identity, compilation, output contracts and the compile gate.

``ProgramCompiler`` is the sole registry of eager program signatures. A key is a
SHA-256 over the signature's canonical material, never object identity, so two
equal requests map to one program however they were built.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Protocol, cast

import attrs
import torch

from llmrt.device.base import Device
from llmrt.errors import CompileGateClosed, KVCacheStateError
from llmrt.lifecycle.events import component_logger, emit
from llmrt.runtime.compiled_step import StepCompiler
from llmrt.runtime.output_reader import map_tensors
from llmrt.runtime.tensor_resources import (
    ReleaseLedger,
    TensorResourceOrphan,
    release_tensors,
    retry_orphans,
)


class ProgramSignature(Protocol):
    """An operation-specific, hashable description of one eager program's geometry."""

    @property
    def operation(self) -> str: ...

    def material(self) -> Mapping[str, Any]: ...

    def describe(self) -> str: ...


class BoundCacheCheck(Protocol):
    @property
    def is_bound(self) -> bool: ...


@attrs.frozen(kw_only=True)
class TensorContract:
    shape: tuple[int, ...]
    dtype: str


@attrs.frozen(kw_only=True)
class ProgramDiagnostics:
    """The registry at a glance; ``recompilations`` above zero is a bug (unstable program keys
    or inputs: a compiled step rebuilt a graph for a geometry it had already compiled)."""

    programs: int
    gate_closed: bool
    orphans: int
    compile_mode: str
    compiled_graphs: int
    recompilations: int
    recompiled: tuple[str, ...]


@attrs.frozen(kw_only=True)
class CompiledProgram:
    """A compiled signature: its key, its description and the shape of what it returns."""

    key: str
    operation: str
    description: str
    output_contract: Any


#: Every program operation: what ``ProgramCompiler`` materializes by default.
PROGRAM_OPERATIONS: frozenset[str] = frozenset(("decode", "prefill"))


def signature_key(signature: ProgramSignature) -> str:
    """Canonical SHA-256 of a signature's material (operation included)."""
    material = {"operation": signature.operation, **dict(signature.material())}
    blob = json.dumps(material, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def output_contract(value: Any) -> Any:
    return map_tensors(value, lambda t: TensorContract(shape=tuple(t.shape), dtype=str(t.dtype)))


class ProgramCompiler:
    """Owns the eager program registry and any retryable compile-output orphans.

    ``step_compiler`` (borrowed) is the lane's source of the runtimes' steps; with
    ``device.compile: inductor`` the first run of a signature inside ``compile`` is its
    ``torch.compile``, and ``diagnostics`` reports the step compiler's recompilations.
    """

    def __init__(
        self,
        *,
        device: Device,
        kv_cache: BoundCacheCheck,
        lane: int = 0,
        step_compiler: StepCompiler | None = None,
        materialize: frozenset[str] = PROGRAM_OPERATIONS,
    ) -> None:
        self.borrowed_device = device
        self.borrowed_kv_cache = kv_cache
        self.borrowed_step_compiler = step_compiler
        # The operations whose signatures compile() must run once: those where a first run
        # builds something (a TT program, an inductor graph). Plain torch eager steps have
        # nothing to build, so compile() only registers them and the first real run records
        # the output contract.
        self.materialize = materialize
        self.lane = lane
        self._programs: dict[str, CompiledProgram] = {}
        self._keys: dict[tuple[type, Hashable], str] = {}
        self._gate_closed_reason: str | None = None
        self._ledger = ReleaseLedger()
        self._orphans: list[TensorResourceOrphan] = []
        self._terminal = False
        self._log = component_logger("program_compiler", lane=lane, object_id=f"{id(self):#x}")

    # -- registry ------------------------------------------------------------------------

    key_for = staticmethod(signature_key)

    def key_of(self, signature: ProgramSignature) -> str:
        """``key_for``, remembered per distinct hashable signature (the frozen decode and
        prefill ones). Why: a decode step's preflight asks on every step, and the JSON +
        SHA-256 cost ~50-90 us there; an unhashable signature is keyed each time."""
        try:
            cached = (type(signature), cast(Hashable, signature))
            key = self._keys.get(cached)
        except TypeError:
            return signature_key(signature)
        if key is None:
            key = self._keys[cached] = signature_key(signature)
        return key

    def __contains__(self, key: str) -> bool:
        return key in self._programs

    def get(self, key: str) -> CompiledProgram | None:
        return self._programs.get(key)

    @property
    def programs(self) -> Mapping[str, CompiledProgram]:
        return dict(self._programs)

    @property
    def gate_closed(self) -> bool:
        return self._gate_closed_reason is not None

    def close_gate(self, *, reason: str) -> None:
        if self._gate_closed_reason is None:
            self._gate_closed_reason = reason
            emit(
                self._log,
                "compile_gate.closed",
                reason=reason,
                programs=len(self._programs),
                step_compiler=self._step_compiler_id,
            )

    def open_gate(self, *, reason: str) -> None:
        """Reopen the gate: a trace capture that failed restores the state it found."""
        if self._gate_closed_reason is not None:
            self._gate_closed_reason = None
            emit(
                self._log,
                "compile_gate.opened",
                reason=reason,
                programs=len(self._programs),
                step_compiler=self._step_compiler_id,
            )

    @property
    def _step_compiler_id(self) -> str | None:
        """The step compiler's log identity (its ``program.recompiled`` events name it)."""
        steps = self.borrowed_step_compiler
        return f"{id(steps):#x}" if steps is not None else None

    def _require_open(self, key: str, signature: ProgramSignature) -> None:
        if self._terminal:
            raise KVCacheStateError("the program compiler was cleaned up")
        if not self.borrowed_kv_cache.is_bound:
            raise KVCacheStateError(
                f"cannot compile {signature.describe()}: "
                "the paged KV cache is not allocated and bound"
            )
        if self._gate_closed_reason is not None:
            emit(
                self._log,
                "program.rejected",
                key=key[:16],
                signature=signature.describe(),
                reason=self._gate_closed_reason,
            )
            raise CompileGateClosed(key, signature.describe())

    # -- compilation ---------------------------------------------------------------------

    def compile(self, signature: ProgramSignature, invoke: Callable[[], Any]) -> CompiledProgram:
        """Run ``invoke`` once to materialize the program, record its contract, drop its output."""
        key = self.key_for(signature)
        existing = self._programs.get(key)
        if existing is not None:
            return existing
        self._require_open(key, signature)
        if signature.operation not in self.materialize:
            return self._record(key, signature, None)
        output = invoke()
        try:
            self.borrowed_device.synchronize()
            program = self._record(key, signature, output)
        finally:  # a failed synchronize must not leak the compile output
            self._orphans.extend(
                release_tensors(output, device=self.borrowed_device, ledger=self._ledger)
            )
        return program

    def admit(self, signature: ProgramSignature, output: Any) -> CompiledProgram:
        """Record a program whose first real (eager) run just produced ``output``.

        Eager serving compiles on first use: the first run *is* the compile, so its
        output is kept for the caller instead of being discarded.
        """
        key = self.key_for(signature)
        existing = self._programs.get(key)
        if existing is not None:
            if existing.output_contract is None:  # registered unmaterialized: fill it in now
                existing = attrs.evolve(existing, output_contract=output_contract(output))
                self._programs[key] = existing
            return existing
        self._require_open(key, signature)
        return self._record(key, signature, output)

    def check_runnable(self, signature: ProgramSignature) -> str:
        """Raise ``CompileGateClosed`` before device work if this signature could not run."""
        key = self.key_for(signature)
        if key not in self._programs:
            self._require_open(key, signature)
        return key

    def _record(self, key: str, signature: ProgramSignature, output: Any) -> CompiledProgram:
        program = CompiledProgram(
            key=key,
            operation=signature.operation,
            description=signature.describe(),
            output_contract=output_contract(output),
        )
        self._programs[key] = program
        emit(
            self._log,
            "program.compiled",
            key=key[:16],
            operation=signature.operation,
            signature=signature.describe(),
        )
        return program

    def diagnostics(self) -> ProgramDiagnostics:
        steps = self.borrowed_step_compiler
        stats = steps.stats() if steps is not None else None
        return ProgramDiagnostics(
            programs=len(self._programs),
            gate_closed=self.gate_closed,
            orphans=len(self._orphans),
            compile_mode=stats.mode if stats is not None else "eager",
            compiled_graphs=stats.graphs if stats is not None else 0,
            recompilations=stats.recompilations if stats is not None else 0,
            recompiled=tuple(
                g.description for g in (stats.geometries if stats else ()) if g.recompilations
            ),
        )

    # -- cleanup -------------------------------------------------------------------------

    @property
    def orphans(self) -> tuple[TensorResourceOrphan, ...]:
        return tuple(self._orphans)

    def cleanup(self) -> None:
        """Terminalize the registry; retry any compile-output orphans. Idempotent."""
        if not self._terminal:
            emit(self._log, "programs.released", programs=len(self._programs))
        self._terminal = True
        self._programs.clear()
        if self._orphans:
            self._orphans = retry_orphans(
                self._orphans, device=self.borrowed_device, ledger=self._ledger
            )
        if self._orphans:
            raise KVCacheStateError(
                f"{len(self._orphans)} compile output tensor(s) failed to release"
            )


def describe_tensor(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}"
