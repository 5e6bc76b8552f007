"""``EagerExecutor`` and ``TracedExecutor`` composition.

There is one eager execution object per lane (prefill runtime + decode runtime +
program compiler). When tracing is configured, one traced object composes that
exact eager instance and a ``TraceCompiler`` over that exact program compiler.
It does not inherit from the eager executor and never falls back to it for an
operation the trace mode selects: a coverage miss raises ``TraceCoverageError``
during preflight, before any device work or KV write.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from llmrt.errors import ConfigError, IdentityError, TraceCoverageError
from llmrt.runtime.config import TraceConfig
from llmrt.runtime.decode import DecodeOutput, DecodeOutputLease, DecodeRuntime, PreparedDecode
from llmrt.runtime.prefill.plan import PrefillChunk, PrefillRow
from llmrt.runtime.prefill.result_collector import PrefillOutput
from llmrt.runtime.prefill.runtime import PrefillRuntime, TokenHistory
from llmrt.runtime.prefill.signatures import PreparedPrefill
from llmrt.runtime.program_compiler import CompiledProgram, ProgramCompiler
from llmrt.runtime.trace_compiler import TraceArtifact, TraceCompiler
from llmrt.sampling.params import SamplingParams

ParamsArg = SamplingParams | Sequence[SamplingParams | None] | None


def _same(constraint: str, left: object, right: object) -> None:
    if left is not right:
        raise IdentityError(constraint, left, right)


class EagerExecutor:
    """Runs prefill and decode eagerly; compiles each signature on first use."""

    def __init__(
        self, *, prefill: PrefillRuntime, decode: DecodeRuntime, program_compiler: ProgramCompiler
    ) -> None:
        p, d = prefill.config, decode.config
        _same("prefill and decode use the same device", p.device, d.device)
        _same("program compiler uses the lane device", program_compiler.borrowed_device, p.device)
        _same("prefill and decode share the model", p.model, d.model)
        _same("prefill and decode share the output reader", p.output_reader, d.output_reader)
        if p.layout != d.layout:
            raise IdentityError(
                "prefill and decode share the page-table layout", p.layout, d.layout
            )
        if p.lane_capacity != d.lane_capacity:
            raise IdentityError("prefill and decode share the lane capacity", p, d)
        if p.device_sampling != d.device_sampling:
            raise IdentityError("prefill and decode share the sampling policy", p, d)
        self.prefill = prefill
        self.decode = decode
        self.program_compiler = program_compiler

    # -- compilation ---------------------------------------------------------------------

    def compile_prefill(self, prepared: PreparedPrefill) -> list[CompiledProgram]:
        """Compile every step signature of a prepared call (idempotent per signature)."""
        programs = []
        for request in prepared.requests:
            for chunk, signature in request.steps:
                programs.append(
                    self.program_compiler.compile(
                        signature,
                        lambda c=chunk, s=signature: self.prefill.invoke_step(c, s),  # type: ignore[misc]
                    )
                )
        return programs

    def compile_decode(self, prepared: PreparedDecode) -> CompiledProgram:
        def run() -> dict[str, torch.Tensor]:
            return self.decode.body_once(prepared)

        return self.program_compiler.compile(prepared.signature, run)

    # -- execution -----------------------------------------------------------------------

    def prepare_prefill(
        self,
        *,
        rows: Sequence[PrefillRow],
        sampling_params: ParamsArg = None,
        step_offsets: Sequence[int] | None = None,
    ) -> PreparedPrefill:
        return self.prefill.prepare(
            rows=rows, sampling_params=sampling_params, step_offsets=step_offsets
        )

    def preflight_prefill(self, prepared: PreparedPrefill) -> None:
        """Raise ``CompileGateClosed`` before any KV write if a step could not run."""
        for signature in prepared.signatures():
            self.program_compiler.check_runnable(signature)

    def run_prefill(
        self, prepared: PreparedPrefill, *, history: TokenHistory | None = None
    ) -> PrefillOutput:
        raws = []
        for request in prepared.requests:
            raw = self.prefill.invoke(request, on_step=self.program_compiler.admit)
            raws.append(self.prefill.finish(request, raw, history=history))
        return self.prefill.assemble(prepared, raws)

    def prefill_forward(
        self,
        *,
        rows: Sequence[PrefillRow],
        sampling_params: ParamsArg = None,
        step_offsets: Sequence[int] | None = None,
        history: TokenHistory | None = None,
    ) -> PrefillOutput:
        prepared = self.prepare_prefill(
            rows=rows, sampling_params=sampling_params, step_offsets=step_offsets
        )
        self.preflight_prefill(prepared)
        return self.run_prefill(prepared, history=history)

    def decode_forward(
        self,
        *,
        tokens: torch.Tensor | Sequence[int],
        start_pos: torch.Tensor | Sequence[int],
        page_table: torch.Tensor,
        sampling_params: Sequence[SamplingParams | None] | None = None,
        step_offsets: Sequence[int] | None = None,
        reset_batch: bool = False,
        read_from_device: bool = True,
        history: TokenHistory | None = None,
        tokens_from_device: bool = False,
    ) -> DecodeOutput | DecodeOutputLease:
        prepared = self.decode.prepare(
            tokens=tokens,
            start_pos=start_pos,
            page_table=page_table,
            sampling_params=sampling_params,
            step_offsets=step_offsets,
            reset_batch=reset_batch,
            tokens_from_device=tokens_from_device,
        )
        self.program_compiler.check_runnable(prepared.signature)
        raw = self.decode.invoke(prepared)
        self.program_compiler.admit(prepared.signature, raw)
        finished = self.decode.finish(prepared, raw, history=history)
        result = self.decode.consume(finished, prepared, read_from_device=read_from_device)
        self.decode.note_outputs(prepared, result)
        return result


class TracedExecutor:
    """Replays captured traces for the operations ``trace_config`` selects."""

    def __init__(
        self,
        *,
        eager_executor: EagerExecutor,
        trace_compiler: TraceCompiler,
        trace_config: TraceConfig,
    ) -> None:
        _same(
            "trace compiler composes the eager executor's program compiler",
            trace_compiler.program_compiler,
            eager_executor.program_compiler,
        )
        _same(
            "trace compiler uses the lane device",
            trace_compiler.borrowed_device,
            eager_executor.prefill.config.device,
        )
        model = eager_executor.prefill.config.model
        if trace_config.prefill_enabled and getattr(model, "prefill_from_host", False):
            raise ConfigError(
                "trace.mode",
                trace_config.mode,
                f"{type(model).__name__} takes each prefill chunk's start from the host (as "
                "tt_transformers' prefill does), so a captured prefill would replay one start "
                "for every chunk; use decode_only",
            )
        self.eager_executor = eager_executor
        self.trace_compiler = trace_compiler
        self.trace_config = trace_config

    @property
    def prefill(self) -> PrefillRuntime:
        return self.eager_executor.prefill

    @property
    def decode(self) -> DecodeRuntime:
        return self.eager_executor.decode

    # -- compilation and capture ---------------------------------------------------------

    def compile_prefill(self, prepared: PreparedPrefill) -> list[CompiledProgram]:
        programs = self.eager_executor.compile_prefill(prepared)
        if self.trace_config.prefill_enabled:
            for request in prepared.requests:
                for step, (_, signature) in enumerate(request.steps):
                    key = self.trace_compiler.program_compiler.key_for(signature)
                    if not self.trace_compiler.is_registered(key):
                        plan = self.prefill.capture_plan(request, step=step, program_key=key)
                        self.trace_compiler.register_capture_plan(plan)
        return programs

    def compile_decode(self, prepared: PreparedDecode) -> CompiledProgram:
        program = self.eager_executor.compile_decode(prepared)
        if self.trace_config.decode_enabled and not self.trace_compiler.is_registered(program.key):
            plan = self.decode.capture_plan(prepared, program_key=program.key)
            self.trace_compiler.register_capture_plan(plan)
        return program

    def capture_all(self) -> None:
        self.trace_compiler.capture_all()

    # -- execution -----------------------------------------------------------------------

    def _preflight(self, operation: str, signatures: Sequence[object]) -> list[TraceArtifact]:
        artifacts: list[TraceArtifact] = []
        missing: list[str] = []
        compiler = self.trace_compiler.program_compiler
        for signature in signatures:
            key = compiler.key_of(signature)  # type: ignore[arg-type]
            description = signature.describe()  # type: ignore[attr-defined]
            try:
                artifacts.append(
                    self.trace_compiler.artifact_for(
                        key, operation=operation, description=description
                    )
                )
            except TraceCoverageError:
                missing.append(description)
        if missing:
            raise TraceCoverageError(operation, missing)
        return artifacts

    def prepare_prefill(
        self,
        *,
        rows: Sequence[PrefillRow],
        sampling_params: ParamsArg = None,
        step_offsets: Sequence[int] | None = None,
    ) -> PreparedPrefill:
        return self.eager_executor.prepare_prefill(
            rows=rows, sampling_params=sampling_params, step_offsets=step_offsets
        )

    def preflight_prefill(self, prepared: PreparedPrefill) -> None:
        """Every step of the complete call has a captured trace (or eager is selected)."""
        if not self.trace_config.prefill_enabled:
            self.eager_executor.preflight_prefill(prepared)
            return
        self._preflight("prefill", [sig for r in prepared.requests for sig in r.signatures])

    def run_prefill(
        self, prepared: PreparedPrefill, *, history: TokenHistory | None = None
    ) -> PrefillOutput:
        if not self.trace_config.prefill_enabled:
            return self.eager_executor.run_prefill(prepared, history=history)
        raws = []
        for request in prepared.requests:
            steps = self._preflight("prefill", list(request.signatures))
            outputs: dict[str, torch.Tensor] = {}
            for (chunk, _), artifact in zip(request.steps, steps, strict=True):
                outputs = self.trace_compiler.replay(artifact, refresh=self._prefill_refresh(chunk))
            raw = self.prefill.finish_trace(request, outputs)
            raws.append(self.prefill.finish(request, raw, history=history))
        return self.prefill.assemble(prepared, raws)

    def prefill_forward(
        self,
        *,
        rows: Sequence[PrefillRow],
        sampling_params: ParamsArg = None,
        step_offsets: Sequence[int] | None = None,
        history: TokenHistory | None = None,
    ) -> PrefillOutput:
        prepared = self.prepare_prefill(
            rows=rows, sampling_params=sampling_params, step_offsets=step_offsets
        )
        # Preflight the complete public call before the first KV write.
        self.preflight_prefill(prepared)
        return self.run_prefill(prepared, history=history)

    def _prefill_refresh(self, chunk: PrefillChunk) -> Callable[[Any, TraceArtifact], None]:
        def refresh(inputs: Any, _artifact: TraceArtifact) -> None:
            self.prefill.refresh_trace(inputs, chunk)

        return refresh

    def decode_forward(
        self,
        *,
        tokens: torch.Tensor | Sequence[int],
        start_pos: torch.Tensor | Sequence[int],
        page_table: torch.Tensor,
        sampling_params: Sequence[SamplingParams | None] | None = None,
        step_offsets: Sequence[int] | None = None,
        reset_batch: bool = False,
        read_from_device: bool = True,
        history: TokenHistory | None = None,
        tokens_from_device: bool = False,
    ) -> DecodeOutput | DecodeOutputLease:
        if not self.trace_config.decode_enabled:
            return self.eager_executor.decode_forward(
                tokens=tokens,
                start_pos=start_pos,
                page_table=page_table,
                sampling_params=sampling_params,
                step_offsets=step_offsets,
                reset_batch=reset_batch,
                read_from_device=read_from_device,
                history=history,
                tokens_from_device=tokens_from_device,
            )
        prepared = self.decode.prepare(
            tokens=tokens,
            start_pos=start_pos,
            page_table=page_table,
            sampling_params=sampling_params,
            step_offsets=step_offsets,
            reset_batch=reset_batch,
            tokens_from_device=tokens_from_device,
        )
        (artifact,) = self._preflight("decode", [prepared.signature])
        outputs = self.trace_compiler.replay(
            artifact, refresh=lambda inputs, art: self.decode.refresh_trace(prepared, inputs, art)
        )
        self.decode.note_submitted(prepared, artifact=artifact)
        raw = self.decode.finish(prepared, outputs, history=history)
        # Trace outputs are rewritten by the next replay: a lease keeps its own copy.
        result = self.decode.consume(
            raw, prepared, read_from_device=read_from_device, copy_outputs=raw is outputs
        )
        self.decode.note_outputs(prepared, result)
        return result
