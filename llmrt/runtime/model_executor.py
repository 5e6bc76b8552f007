"""The model-layer executor of one lane: execution selection and the cleanup root.

It composes the lane's runtime objects (it owns none of their internals), checks
the bound KV handle and sampling capability before delegating, selects eager or
traced execution per call, resolves late physical KV capacity, and tears the
lane down in the spec's order after making itself terminal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from llmrt.errors import CleanupError, IdentityError, KVCacheStateError, RequestError
from llmrt.lifecycle.events import component_logger, emit
from llmrt.runtime.config import PageTableLayout
from llmrt.runtime.decode import DecodeOutput, DecodeOutputLease, DecodeRuntime
from llmrt.runtime.execution import EagerExecutor, ParamsArg, TracedExecutor
from llmrt.runtime.output_reader import OutputReader
from llmrt.runtime.paged_kv_cache import PagedKVCacheContext, PagedKVCacheManager
from llmrt.runtime.prefill.plan import PrefillRow
from llmrt.runtime.prefill.result_collector import PrefillOutput
from llmrt.runtime.prefill.runtime import PrefillRuntime, TokenHistory
from llmrt.runtime.prefill.signatures import PreparedPrefill
from llmrt.runtime.warmup import CoverageManifest, WarmupCoordinator
from llmrt.sampling.params import SamplingParams

#: The spec's lane cleanup order.
CLEANUP_STEPS: tuple[str, ...] = (
    "external_decode_leases",
    "pending_output_reads",
    "prefill_transients",
    "decode_transients",
    "traces",
    "program_registry",
    "device_sampling_buffers",
    "paged_kv_cache",
)


class ModelExecutor:
    """One lane's execution target; borrows every collaborator and is their cleanup root."""

    def __init__(
        self,
        *,
        kv_cache: PagedKVCacheManager,
        output_reader: OutputReader,
        eager: EagerExecutor,
        traced: TracedExecutor | None,
        warmup: WarmupCoordinator,
        lane: int = 0,
    ) -> None:
        if traced is not None and traced.eager_executor is not eager:
            raise IdentityError(
                "traced executor composes the lane's eager executor", traced.eager_executor, eager
            )
        if warmup.execution is not (traced if traced is not None else eager):
            raise IdentityError(
                "warmup drives the lane's execution target",
                warmup.execution,
                traced if traced is not None else eager,
            )
        if eager.prefill.config.output_reader is not output_reader:
            raise IdentityError(
                "runtimes read through the lane's output reader",
                eager.prefill.config.output_reader,
                output_reader,
            )
        if eager.program_compiler.borrowed_kv_cache is not kv_cache:
            raise IdentityError(
                "program compiler checks the lane's KV cache",
                eager.program_compiler.borrowed_kv_cache,
                kv_cache,
            )
        self.kv_cache = kv_cache
        self.output_reader = output_reader
        self.eager = eager
        self.traced = traced
        self.warmup = warmup
        self.lane = lane
        self._terminal = False
        self._cleaned: set[str] = set()
        self._kv_orphaned = False
        self._log = component_logger("model_executor", lane=lane, object_id=f"{id(self):#x}")

    # -- properties ----------------------------------------------------------------------

    @property
    def prefill(self) -> PrefillRuntime:
        return self.eager.prefill

    @property
    def decode(self) -> DecodeRuntime:
        return self.eager.decode

    @property
    def lane_capacity(self) -> int:
        return self.decode.config.lane_capacity

    @property
    def layout(self) -> PageTableLayout:
        return self.decode.config.layout

    @property
    def terminal(self) -> bool:
        return self._terminal

    def _target(self, enable_trace: bool | None) -> EagerExecutor | TracedExecutor:
        if self._terminal:
            raise KVCacheStateError(f"lane {self.lane} executor was cleaned up")
        if enable_trace is False or self.traced is None:
            if enable_trace and self.traced is None:
                raise RequestError("enable_trace", "trace.mode is none for this lane")
            return self.eager
        return self.traced

    def _check_handle(self, kv_cache: object | None) -> PagedKVCacheContext:
        if kv_cache is None:
            return self.kv_cache.context
        return self.kv_cache.validate_handle(kv_cache)

    # -- KV capacity and allocation ------------------------------------------------------

    def configure_kv_capacity(self, num_blocks: int | None = None) -> None:
        """Resolve physical KV capacity (shrink only) and replace the layouts, before allocation."""
        config = self.kv_cache.config
        new = config.with_num_blocks(num_blocks) if num_blocks is not None else None
        resolved = self.kv_cache.configure(new)
        physical = resolved.num_blocks
        if physical is not None and physical != self.layout.num_blocks:
            layout = self.layout.with_physical_blocks(physical)
            self.prefill.configure_page_table_layout(layout)
            self.decode.configure_page_table_layout(layout)
            self.warmup.configure_page_table_layout(layout)
        emit(
            self._log,
            "kv.layout_resolved",
            num_blocks=self.layout.num_blocks,
            block_size=self.layout.block_size,
            width=self.layout.width,
        )

    def allocate_kv_cache(self) -> PagedKVCacheContext:
        """Seal the runtime configuration (capacity and layouts are final), then allocate.

        Idempotent: a lane already bound returns its handle (a start-up retried after another
        lane failed to allocate)."""
        if self.kv_cache.is_bound:
            return self.kv_cache.context
        emit(
            self._log,
            "config.sealed",
            num_blocks=self.layout.num_blocks,
            lane_capacity=self.lane_capacity,
            trace=self.traced is not None,
        )
        return self.kv_cache.allocate()

    # -- warmup --------------------------------------------------------------------------

    def warmup_prefill(self) -> None:
        self._check_handle(None)
        self.warmup.warmup_prefill()

    def warmup_decode(self) -> None:
        self._check_handle(None)
        self.warmup.warmup_decode()

    def activate(self) -> None:
        """Commit this lane's trace capture (through the barrier) once both warmups ran."""
        self._check_handle(None)
        self.warmup.activate()

    def manifest(self) -> CoverageManifest:
        return self.warmup.manifest()

    # -- execution -----------------------------------------------------------------------

    def prepare_prefill(
        self,
        *,
        rows: Sequence[PrefillRow],
        sampling_params: ParamsArg = None,
        step_offsets: Sequence[int] | None = None,
        enable_trace: bool | None = None,
        kv_cache: object | None = None,
    ) -> tuple[EagerExecutor | TracedExecutor, PreparedPrefill]:
        """Validate the handle, choose the target, plan the call (no device work)."""
        self._check_handle(kv_cache)
        target = self._target(enable_trace)
        prepared = target.prepare_prefill(
            rows=rows, sampling_params=sampling_params, step_offsets=step_offsets
        )
        return target, prepared

    def prefill_forward(
        self,
        *,
        rows: Sequence[PrefillRow],
        sampling_params: ParamsArg = None,
        step_offsets: Sequence[int] | None = None,
        history: TokenHistory | None = None,
        enable_trace: bool | None = None,
        kv_cache: object | None = None,
    ) -> PrefillOutput:
        target, prepared = self.prepare_prefill(
            rows=rows,
            sampling_params=sampling_params,
            step_offsets=step_offsets,
            enable_trace=enable_trace,
            kv_cache=kv_cache,
        )
        target.preflight_prefill(prepared)
        return target.run_prefill(prepared, history=history)

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
        enable_trace: bool | None = None,
        kv_cache: object | None = None,
        tokens_from_device: bool = False,
    ) -> DecodeOutput | DecodeOutputLease:
        self._check_handle(kv_cache)
        return self._target(enable_trace).decode_forward(
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

    def read_decode_output(
        self, lease: DecodeOutputLease, *, async_read: bool
    ) -> tuple[object, tuple[object, ...]]:
        return self.decode.read_decode_output(lease, async_read=async_read)

    def process_decode_output_host(
        self, host_value: object, *, is_tokens: bool | None = None
    ) -> DecodeOutput:
        return self.decode.process_decode_output_host(host_value, is_tokens=is_tokens)

    # -- cleanup -------------------------------------------------------------------------

    def cleanup(self, *, primary: BaseException | None = None) -> None:
        """Become terminal, then run the spec's eight cleanup steps; idempotent, keeps going.

        Each step runs once: a step that succeeded is never repeated, a failed one is retried
        by the next call. KV whose release is deferred (a trace failed to release and may
        still read it) is reported as an orphan and released by the retry that frees the trace.
        """
        if not self._terminal:
            self._terminal = True
            emit(self._log, "executor.terminal")
        remaining = [name for name in CLEANUP_STEPS if name not in self._cleaned]
        if not remaining:
            return
        emit(self._log, "cleanup.started", steps=remaining)
        steps: dict[str, Callable[[], object]] = {
            "external_decode_leases": self.decode.drain_external_outputs,
            "pending_output_reads": self.output_reader.drain,
            "prefill_transients": self.prefill.cleanup,
            "decode_transients": self.decode.cleanup_transients,
            "traces": self.release_traces,
            "program_registry": self.eager.program_compiler.cleanup,
            "device_sampling_buffers": self.release_sampling_buffers,
            "paged_kv_cache": self.kv_cache.release,
        }
        failures: list[tuple[str, BaseException]] = []
        for name in remaining:
            try:
                if name == "paged_kv_cache" and "traces" not in self._cleaned:
                    self._defer_kv()
                steps[name]()
            except Exception as exc:
                failures.append((f"lane{self.lane}/{name}", exc))
                emit(self._log, "cleanup.failed", step=name, error=f"{type(exc).__name__}: {exc}")
            except BaseException as exc:
                # An interrupt: the step stays to do (the next call retries it), then stop.
                emit(
                    self._log,
                    "cleanup.failed",
                    step=name,
                    error=f"{type(exc).__name__}: {exc}",
                    interrupted=True,
                )
                for step, failure in failures:
                    exc.add_note(f"also failed before it: {step}: {failure!r}")
                raise
            else:
                self._cleaned.add(name)
                emit(self._log, "cleanup.step", step=name)
                if name == "paged_kv_cache" and self._kv_orphaned:
                    self._kv_orphaned = False
                    emit(self._log, "resource.recovered", path=self._kv_path, kind="kv_cache")
        if failures:
            raise CleanupError(failures, primary=primary)
        emit(self._log, "cleanup.completed", steps=len(CLEANUP_STEPS))

    def release_traces(self) -> None:
        """Step 5: release every trace, then its persistent inputs (nothing on an eager lane)."""
        if self.traced is not None:
            self.traced.trace_compiler.cleanup()

    def release_sampling_buffers(self) -> None:
        """Step 7: nothing persists: sampling tensors are per call (sampling runs outside
        programs). Kept as a step so the order, and a fault injected here, stay the spec's."""

    @property
    def _kv_path(self) -> str:
        return f"lane{self.lane}/paged_kv_cache"

    def _defer_kv(self) -> None:
        """A trace that failed to release still reads and writes the KV: keep it, as an orphan."""
        if not self._kv_orphaned:
            self._kv_orphaned = True
            emit(
                self._log,
                "resource.orphaned",
                path=self._kv_path,
                kind="kv_cache",
                error="release deferred: a trace that failed to release still uses it",
            )
        raise KVCacheStateError(
            f"lane {self.lane}: KV release deferred while a trace is still live "
            "(its release failed); call cleanup() again to retry both"
        )
