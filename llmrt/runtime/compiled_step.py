"""Compiled model steps: the model's decode and prefill forwards under ``torch.compile``.

With ``device.compile: inductor`` a lane's :class:`StepCompiler` wraps the model's
``decode_forward`` and ``prefill_forward`` once per operation with ``torch.compile``
(inductor, ``fullgraph=True``, ``dynamic=False``). A program signature is one static
input geometry, so each compiles once: when ``ProgramCompiler.compile`` first runs it
during warmup. Programs return logits; argmax and sampling run after them, uncompiled.

On CPU the page table is trimmed on the host to the blocks the step reads (what the
eager model does inside ``plan_decode``/``plan_prefill``) and its width is the only
dimension marked dynamic, so a long context neither recompiles nor pays for the full
width. Elsewhere (CUDA graphs) every shape stays the signature's.

On the CPU (``precompiled``, the default, and no ``freezing``) each geometry's first run
loads its precompiled step from ``<cache>/steps`` (:mod:`llmrt.runtime.step_artifacts`: graph,
guards and kernels, no Dynamo trace; ``program.artifact_loaded``), or traces and compiles
it with ``aot_compile`` and saves it (``program.artifact_saved``). A file that is damaged,
saved for another key or whose guards reject the inputs is reported
(``program.artifact_rejected``), recompiled and replaced, never run. The model is the
traced function's first argument, so a file holds no process's model and its weights stay
graph inputs. Elsewhere (CUDA, ``freezing``, ``precompiled: false``) one ``torch.compile``
function serves every geometry and Dynamo re-traces each in every process.

A compile for a geometry this step already compiled is a recompilation (Dynamo retraces
on a stride, dtype or global-state change as well as a shape; a precompiled step's guards
reject the same changes): a bug, counted and emitted as ``program.recompiled``. Each step
traces a private copy of a trampoline's code object, so Dynamo's per-code cache and
recompile limit belong to that step alone and are freed with it. Inductor's caches live
under ``<LLMRT_CACHE_DIR>/inductor`` (torch reads the directory from
``TORCHINDUCTOR_CACHE_DIR``, process-wide), so another process reuses them.
"""

from __future__ import annotations

import os
import time
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

import attrs
import torch

from llmrt.errors import ConfigError, KVCacheStateError
from llmrt.families.base import CausalLM
from llmrt.lifecycle.events import component_logger, emit
from llmrt.paths import default_cache_dir
from llmrt.runtime.step_artifacts import (
    ArtifactStore,
    PrecompiledStep,
    StepArtifactError,
    artifact_key,
    guard_failure,
)

#: Torch reads the inductor (FX graph, AOTAutograd, kernel) cache root from this variable.
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
CompileMode = Literal["eager", "inductor"]
InductorMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
CompiledOperation = Literal["decode", "prefill"]

#: Smallest trimmed page-table width: Dynamo specializes sizes 0 and 1, never a dynamic dim.
MIN_DYNAMIC_WIDTH = 2
#: Dynamo's per-code recompile limit while a step runs; past it Dynamo would silently run
#: eagerly, so it is raised above any warmup coverage and hitting it raises instead.
RECOMPILE_LIMIT = 1024

_COMPILE_MODES: tuple[str, ...] = get_args(CompileMode)
_INDUCTOR_MODES: tuple[str, ...] = get_args(InductorMode)


Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _choice(field: str, allowed: tuple[str, ...]) -> Validator:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and value not in allowed:
            raise ConfigError(field, value, f"must be one of {', '.join(allowed)}")

    return check


def _flag(field: str) -> Validator:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, bool):
            raise ConfigError(field, value, "must be a boolean")

    return check


def _operations(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    allowed = get_args(CompiledOperation)
    if not isinstance(value, tuple) or not value or any(op not in allowed for op in value):
        raise ConfigError(
            "device.inductor.operations", value, f"must be a non-empty tuple of {allowed}"
        )


def _directory(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not isinstance(value, Path):
        raise ConfigError("compile.cache_dir", value, "must be a pathlib.Path or None")


@attrs.frozen(kw_only=True)
class CompileOptions:
    """How a lane's steps run: the model forwards as is (``eager``) or compiled by inductor.

    ``freezing`` folds the weights into the graphs as constants (faster steps; the FX
    graph cache is bypassed, so a warm start recompiles); ``max_autotune`` benchmarks
    kernel choices at compile time; ``inductor_mode`` is a ``torch.compile`` mode whose
    options are merged first. ``cache_dir`` None means ``<LLMRT_CACHE_DIR>/inductor``.
    ``precompiled`` saves each CPU step geometry's traced graph under ``<cache_dir>/steps``
    and loads it in later processes instead of re-tracing (:mod:`llmrt.runtime.step_artifacts`);
    it does not apply with ``freezing`` (the weights would be baked into the file).
    """

    mode: CompileMode = attrs.field(
        default="eager", validator=_choice("device.compile", _COMPILE_MODES)
    )
    freezing: bool = attrs.field(default=False, validator=_flag("device.inductor.freezing"))
    max_autotune: bool = attrs.field(default=False, validator=_flag("device.inductor.max_autotune"))
    inductor_mode: InductorMode | None = attrs.field(
        default=None, validator=_choice("device.inductor.mode", _INDUCTOR_MODES)
    )
    cache_dir: Path | None = attrs.field(default=None, validator=_directory)
    operations: tuple[str, ...] = attrs.field(default=("decode", "prefill"), validator=_operations)
    precompiled: bool = attrs.field(default=True, validator=_flag("device.inductor.precompiled"))

    def inductor_options(self) -> dict[str, Any]:
        """Inductor config patches: the mode's options, then freezing and max-autotune."""
        options: dict[str, Any] = {}
        if self.inductor_mode is not None:
            options.update(torch._inductor.list_mode_options(self.inductor_mode, dynamic=False))
        options["freezing"] = self.freezing
        if self.max_autotune:
            options["max_autotune"] = True
        return options

    def resolved_cache_dir(self) -> Path:
        return self.cache_dir if self.cache_dir is not None else default_cache_dir() / "inductor"

    def artifact_directory(self) -> Path | None:
        """Where precompiled steps live; None when they are off (or ``freezing`` is on)."""
        if self.mode != "inductor" or not self.precompiled or self.freezing:
            return None
        return self.resolved_cache_dir() / "steps"


class DecodeStep(Protocol):
    """``CausalLM.decode_forward``'s calling convention."""

    def __call__(
        self, *, tokens: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor
    ) -> torch.Tensor: ...


class PrefillStep(Protocol):
    """``CausalLM.prefill_forward``'s calling convention."""

    def __call__(
        self,
        *,
        tokens: torch.Tensor,
        start_pos: torch.Tensor,
        seq_lens: torch.Tensor,
        page_table: torch.Tensor,
        last_token_index: torch.Tensor,
    ) -> torch.Tensor: ...


@attrs.frozen(kw_only=True)
class CompiledGeometry:
    """One input geometry a step ran: graphs built for it (0 when it reused another geometry's,
    e.g. a page table of another width) and the seconds its first run took."""

    operation: str
    description: str
    graphs: int
    seconds: float
    recompilations: int = 0


@attrs.frozen(kw_only=True)
class StepCompileStats:
    """What a lane's steps compiled; any recompilation is a bug."""

    mode: str
    geometries: tuple[CompiledGeometry, ...]
    graphs: int
    recompilations: int


Geometry = tuple[tuple[str, tuple[int, ...]], ...]


def _describe(operation: str, geometry: Geometry) -> str:
    shapes = " ".join(f"{name}{list(shape)}" for name, shape in geometry)
    return f"{operation}({shapes})"


class _CountingInductor:
    """The inductor backend with this step's options, counting the graphs it compiles."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        self._options = dict(options)
        self.graphs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(graph, example_inputs, config_patches=self._options)


def _private_code(fn: types.FunctionType, *, name: str) -> types.FunctionType:
    """``fn`` over its own copy of its code object (Dynamo keys its cache on code objects)."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


class _NotPrecompilable(StepArtifactError):
    """``aot_compile`` could not make a serializable step; the jit path takes over."""


def _decode_step(
    model: CausalLM, tokens: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor
) -> Any:
    """The traced decode function: the model is an argument, never a closure, so a saved
    trace holds no reference to one process's model (its weights are graph inputs)."""
    return model.decode_forward(tokens=tokens, positions=positions, page_table=page_table)


def _prefill_step(
    model: CausalLM,
    tokens: torch.Tensor,
    start_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    last_token_index: torch.Tensor,
) -> Any:
    """The traced prefill function (see ``_decode_step``)."""
    return model.prefill_forward(
        tokens=tokens,
        start_pos=start_pos,
        seq_lens=seq_lens,
        page_table=page_table,
        last_token_index=last_token_index,
    )


class CompiledStep:
    """One operation's compiled forward; tells first compiles from recompilations.

    Borrows the model; owns the compiled functions and the record of every geometry it
    compiled. With an artifact store (CPU inputs, ``precompiled``, no ``freezing``) each
    geometry's first run loads its precompiled step, or traces, compiles and saves it, and
    later runs dispatch on that step's guards; otherwise one ``torch.compile`` function
    serves every geometry and Dynamo re-traces each in every process.
    """

    def __init__(
        self,
        *,
        operation: str,
        model: CausalLM,
        trampoline: types.FunctionType,
        block_size: int,
        options: CompileOptions,
        on_recompile: Callable[[CompiledGeometry], None],
        on_artifact: Callable[..., None],
    ) -> None:
        self.operation = operation
        self._model: CausalLM | None = model
        self._block_size = block_size
        self._options = options.inductor_options()
        self._backend = _CountingInductor(self._options)
        self._trampoline = _private_code(trampoline, name=f"llmrt_{operation}_step")
        self._compiled: Callable[..., torch.Tensor] | None = torch.compile(
            self._trampoline, fullgraph=True, dynamic=False, backend=self._backend
        )
        directory = options.artifact_directory()
        self._store = None if directory is None else ArtifactStore(directory)
        self._precompiled: dict[Geometry, list[PrecompiledStep]] = {}
        self._on_recompile = on_recompile
        self._on_artifact = on_artifact
        self._geometries: dict[Geometry, CompiledGeometry] = {}

    @property
    def geometries(self) -> tuple[CompiledGeometry, ...]:
        return tuple(self._geometries.values())

    @property
    def precompiles(self) -> bool:
        """Whether CPU geometries go through precompiled steps on disk."""
        return self._store is not None

    def run(self, geometry: Geometry, *, last_position: Callable[[], int], **inputs: Any) -> Any:
        """Run the compiled forward over ``inputs`` (``geometry`` = their untrimmed shapes)."""
        compiled, model = self._compiled, self._model
        if compiled is None or model is None:
            raise KVCacheStateError(f"the compiled {self.operation} step was closed")
        cpu = inputs["tokens"].device.type == "cpu"
        if geometry in self._precompiled or (self._store is not None and cpu):
            try:
                return self._run_precompiled(model, geometry, last_position, dict(inputs))
            except _NotPrecompilable as exc:
                # Keep the steps already loaded; every other geometry takes the jit path.
                self._on_artifact(
                    "program.artifact_save_failed",
                    operation=self.operation,
                    path=str(exc.path),
                    reason="cannot precompile, Dynamo traces this step in every process"
                    f" instead ({exc.reason})",
                )
                self._store = None
                self._precompiled.pop(geometry, None)
        table = inputs["page_table"]
        inputs["page_table"] = self._trim(table, last_position)
        if inputs["page_table"] is not table:
            self._mark_width(inputs["page_table"], table.shape[1])
        before = self._backend.graphs
        started = time.perf_counter()
        with (
            torch.no_grad(),
            torch._dynamo.config.patch(
                recompile_limit=RECOMPILE_LIMIT,
                accumulated_recompile_limit=RECOMPILE_LIMIT,
                fail_on_recompile_limit_hit=True,
            ),
        ):
            out = compiled(model, **inputs)
        graphs = self._backend.graphs - before
        if graphs or geometry not in self._geometries:
            self._note_compile(geometry, graphs=graphs, seconds=time.perf_counter() - started)
        return out

    def _run_precompiled(
        self,
        model: CausalLM,
        geometry: Geometry,
        last_position: Callable[[], int],
        inputs: dict[str, Any],
    ) -> Any:
        width = inputs["page_table"].shape[1]
        inputs["page_table"] = self._trim(inputs["page_table"], last_position)
        with torch.no_grad():
            steps = self._precompiled.get(geometry)
            if steps is None:
                started = time.perf_counter()
                step, graphs = self._load_or_compile(model, geometry, width, inputs)
                self._precompiled[geometry] = [step]
                out = step(model, **inputs)
                self._note_compile(geometry, graphs=graphs, seconds=time.perf_counter() - started)
                return out
            for step in steps:
                if step.guard_check(model, **inputs):
                    return step(model, **inputs)
            # A known geometry whose guards all fail (a stride, dtype or global-state
            # change): what Dynamo would retrace, so a recompilation. Kept in memory only.
            started = time.perf_counter()
            before = self._backend.graphs
            step = self._aot_compile(model, width, inputs)
            steps.append(step)
            out = step(model, **inputs)
            self._note_compile(
                geometry,
                graphs=self._backend.graphs - before,
                seconds=time.perf_counter() - started,
            )
            return out

    def _load_or_compile(
        self, model: CausalLM, geometry: Geometry, width: int, inputs: dict[str, Any]
    ) -> tuple[PrecompiledStep, int]:
        """This geometry's step from disk when its file checks out and its guards pass on
        these inputs, else compiled now and saved (replacing any unusable file)."""
        store = self._store
        assert store is not None
        key = artifact_key(
            operation=self.operation,
            geometry=geometry,
            dtypes={name: tensor.dtype for name, tensor in inputs.items()},
            dynamic=self._dynamic(width),
            options={"backend": "inductor", **self._options},
            model=model,  # type: ignore[arg-type]
        )
        path = store.path(key)
        started = time.perf_counter()
        try:
            loaded = store.load(key, f_globals=self._trampoline.__globals__)
        except StepArtifactError as exc:
            self._on_artifact(
                "program.artifact_rejected",
                operation=self.operation,
                path=str(path),
                reason=exc.reason,
            )
            loaded = None
        if loaded is not None:
            if loaded.guard_check(model, **inputs):
                loaded.disable_guard_check()  # checked here, once per call, before calling
                self._on_artifact(
                    "program.artifact_loaded",
                    operation=self.operation,
                    path=str(path),
                    seconds=round(time.perf_counter() - started, 3),
                )
                return loaded, 0
            self._on_artifact(
                "program.artifact_rejected",
                operation=self.operation,
                path=str(path),
                reason=guard_failure(loaded, model, **inputs),
            )
        before = self._backend.graphs
        compiled = self._aot_compile(model, width, inputs)
        try:
            store.save(key, compiled)
        except Exception as exc:  # a full disk or an unpicklable part costs the next start only
            self._on_artifact(
                "program.artifact_save_failed",
                operation=self.operation,
                path=str(path),
                reason=f"{type(exc).__name__}: {exc}",
            )
        else:
            self._on_artifact(
                "program.artifact_saved",
                operation=self.operation,
                path=str(path),
                seconds=round(time.perf_counter() - started, 3),
            )
        return compiled, self._backend.graphs - before

    def _aot_compile(self, model: CausalLM, width: int, inputs: dict[str, Any]) -> PrecompiledStep:
        """Trace and compile these inputs' geometry; the page table's width is traced as
        dynamic on an example copy (a mark on the runtime tensor would fail the guards).
        Raises ``_NotPrecompilable`` when torch cannot make a serializable step of it (e.g.
        a guard on an object it cannot pickle)."""
        example = dict(inputs)
        table = example["page_table"]
        if self._dynamic(width):
            example["page_table"] = table.clone()
            self._mark_width(example["page_table"], width)
        compiled = torch.compile(
            self._trampoline, fullgraph=True, dynamic=False, backend=self._backend
        )
        before = self._backend.graphs
        try:
            step: PrecompiledStep = compiled.aot_compile(((model,), example))  # type: ignore[attr-defined]
        except Exception as exc:  # torch raises anything from tracing to guard pickling
            self._backend.graphs = before  # the graph is dropped with the failed attempt
            directory = self._store.directory if self._store is not None else Path()
            raise _NotPrecompilable(directory, f"{type(exc).__name__}: {exc}") from exc
        step.disable_guard_check()  # run() checks before every call
        return step

    def _dynamic(self, width: int) -> dict[str, Any]:
        """The dimensions traced as dynamic: the page-table width on the CPU (see ``_trim``)."""
        if width <= MIN_DYNAMIC_WIDTH:
            return {}
        return {"page_table": {"dim": 1, "min": MIN_DYNAMIC_WIDTH, "max": width}}

    def _trim(self, table: torch.Tensor, last_position: Callable[[], int]) -> torch.Tensor:
        width = table.shape[1]
        if table.device.type != "cpu" or width <= MIN_DYNAMIC_WIDTH:
            return table
        used = max(MIN_DYNAMIC_WIDTH, last_position() // self._block_size + 1)
        # Contiguous whatever the width: a view's stride would split the graph at full width.
        return table[:, : min(width, used)].contiguous()

    @staticmethod
    def _mark_width(table: torch.Tensor, width: int) -> None:
        torch._dynamo.mark_dynamic(table, 1, min=MIN_DYNAMIC_WIDTH, max=width)

    def _note_compile(self, geometry: Geometry, *, graphs: int, seconds: float) -> None:
        """Record a geometry's first run (``graphs`` 0: it reused another's graph or loaded
        a precompiled step) or, for a known geometry, a recompilation."""
        known = self._geometries.get(geometry)
        if known is None:
            self._geometries[geometry] = CompiledGeometry(
                operation=self.operation,
                description=_describe(self.operation, geometry),
                graphs=graphs,
                seconds=seconds,
            )
            return
        updated = attrs.evolve(
            known, graphs=known.graphs + graphs, recompilations=known.recompilations + 1
        )
        self._geometries[geometry] = updated
        self._on_recompile(updated)

    def close(self) -> None:
        self._compiled = None
        self._model = None
        self._precompiled.clear()


class CompiledDecode:
    """``decode_forward`` compiled; geometry = the tokens, positions and page-table shapes."""

    def __init__(self, step: CompiledStep) -> None:
        self.step = step

    def __call__(
        self, *, tokens: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor
    ) -> torch.Tensor:
        geometry = (
            ("tokens", tuple(tokens.shape)),
            ("positions", tuple(positions.shape)),
            ("page_table", tuple(page_table.shape)),
        )
        out: torch.Tensor = self.step.run(
            geometry,
            last_position=lambda: int(positions.max()) if positions.numel() else 0,
            tokens=tokens,
            positions=positions,
            page_table=page_table,
        )
        return out


class CompiledPrefill:
    """``prefill_forward`` compiled; geometry = the tokens and page-table shapes."""

    def __init__(self, step: CompiledStep) -> None:
        self.step = step

    def __call__(
        self,
        *,
        tokens: torch.Tensor,
        start_pos: torch.Tensor,
        seq_lens: torch.Tensor,
        page_table: torch.Tensor,
        last_token_index: torch.Tensor,
    ) -> torch.Tensor:
        geometry = (("tokens", tuple(tokens.shape)), ("page_table", tuple(page_table.shape)))

        def last_position() -> int:
            if not start_pos.numel():
                return 0
            return int((start_pos.long() + seq_lens.long().clamp(min=1)).max()) - 1

        out: torch.Tensor = self.step.run(
            geometry,
            last_position=last_position,
            tokens=tokens,
            start_pos=start_pos,
            seq_lens=seq_lens,
            page_table=page_table,
            last_token_index=last_token_index,
        )
        return out


class StepCompiler:
    """A lane's source of step callables; owns the compiled steps and their statistics.

    ``eager`` hands out the model's own forwards (no wrapper, no cost); ``inductor``
    hands out one :class:`CompiledStep` per operation and model, and points torch's
    inductor cache (``TORCHINDUCTOR_CACHE_DIR``, process-wide) at the options' directory.
    """

    def __init__(self, *, options: CompileOptions, lane: int = 0) -> None:
        self.config = options
        self.lane = lane
        self._steps: list[CompiledStep] = []
        self._recompilations = 0
        self._log = component_logger("step_compiler", lane=lane, object_id=f"{id(self):#x}")
        if options.mode == "inductor":
            os.environ[INDUCTOR_CACHE_ENV] = str(options.resolved_cache_dir())

    @property
    def compiled(self) -> bool:
        """Whether steps run under ``torch.compile``."""
        return self.config.mode == "inductor"

    def compiles(self, operation: str) -> bool:
        """Whether ``operation``'s step runs under ``torch.compile``."""
        return self.compiled and operation in self.config.operations

    def decode_step(self, model: CausalLM, *, block_size: int) -> DecodeStep:
        """The decode forward to call; ``block_size`` is the bound KV cache's."""
        if not self.compiles("decode"):
            return model.decode_forward
        return CompiledDecode(self._add("decode", model, _decode_step, block_size))

    def prefill_step(self, model: CausalLM, *, block_size: int) -> PrefillStep:
        """The prefill forward to call; ``block_size`` is the bound KV cache's."""
        if not self.compiles("prefill"):
            return model.prefill_forward
        return CompiledPrefill(self._add("prefill", model, _prefill_step, block_size))

    def _add(
        self,
        operation: str,
        model: CausalLM,
        trampoline: Callable[..., Any],
        block_size: int,
    ) -> CompiledStep:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigError("kv_cache.block_size", block_size, "must be a positive integer")
        step = CompiledStep(
            operation=operation,
            model=model,
            trampoline=trampoline,  # type: ignore[arg-type]
            block_size=block_size,
            options=self.config,
            on_recompile=self._recompiled,
            on_artifact=self._artifact,
        )
        self._steps.append(step)
        return step

    def _artifact(self, event: str, **fields: Any) -> None:
        emit(self._log, event, **fields)

    def _recompiled(self, geometry: CompiledGeometry) -> None:
        self._recompilations += 1
        emit(
            self._log,
            "program.recompiled",
            operation=geometry.operation,
            signature=geometry.description,
            recompilations=geometry.recompilations,
            graphs=geometry.graphs,
        )

    @property
    def recompilations(self) -> int:
        """Compiles of a geometry some step had already compiled (each one is a bug)."""
        return self._recompilations

    def stats(self) -> StepCompileStats:
        geometries = tuple(g for step in self._steps for g in step.geometries)
        return StepCompileStats(
            mode=self.config.mode,
            geometries=geometries,
            graphs=sum(g.graphs for g in geometries),
            recompilations=self._recompilations,
        )

    def close(self) -> None:
        """Drop the compiled functions (and Dynamo's cache with them); idempotent."""
        for step in self._steps:
            step.close()
