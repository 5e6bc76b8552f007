"""Warmup coverage and the prefill/decode trace-capture barrier.

``WarmupCoordinator.warmup_prefill`` and ``warmup_decode`` may run in either
order. Each resolves representative inputs through the real planner, compiles
every required program signature, registers trace capture plans for the traced
operations, and records coverage idempotently. Capture starts only when both
are complete; with several lanes a shared :class:`CaptureBarrier` waits until
every lane reports identical readiness and then captures them as one step.
Warmup inputs carry ``-1`` page tables, so warmup never writes KV.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import attrs
import torch

from llmrt.errors import ConfigError, IdentityError, TraceStateError
from llmrt.lifecycle.events import component_logger, emit
from llmrt.lifecycle.progress import progress
from llmrt.runtime.config import PageTableLayout, TraceConfig, WarmupConfig
from llmrt.runtime.decode import PreparedDecode
from llmrt.runtime.execution import EagerExecutor, TracedExecutor
from llmrt.runtime.prefill.plan import PrefillPlanPolicy, PrefillRow
from llmrt.runtime.prefill.signatures import PreparedPrefill

MANIFEST_SCHEMA = 1


@attrs.frozen(kw_only=True)
class PrefillCoverage:
    """One representative prefill geometry: padded length, physical batch, variant."""

    seq_len: int
    batch_size: int
    variant: str  # "regular" | "chunked"


@attrs.frozen(kw_only=True)
class WarmupCoordinatorConfig:
    """Resolved warmup coverage for one lane."""

    warmup: WarmupConfig
    trace: TraceConfig
    prefill_coverage: tuple[PrefillCoverage, ...]
    layout: PageTableLayout
    lane_capacity: int
    lane: int = 0

    @classmethod
    def resolve(
        cls,
        *,
        warmup: WarmupConfig,
        trace: TraceConfig,
        execution: EagerExecutor | TracedExecutor,
        lane: int = 0,
    ) -> WarmupCoordinatorConfig:
        prefill = execution.prefill.config
        policy = prefill.policy
        # What the recipe asked for (the policy's chunk is that, or narrower: the table's).
        requested = prefill.layout.requested_prefill_chunk_size or policy.max_chunk_size
        for i, n in enumerate(warmup.prefill_seq_lens):
            if n > requested:
                raise ConfigError(
                    f"warmup.prefill_seq_lens[{i}]",
                    n,
                    f"exceeds prefill.max_chunk_size={requested}",
                )
        warmup = _within_chunk(warmup, policy.buckets.lengths(), policy.max_chunk_size)
        for i, n in enumerate(warmup.prefill_seq_lens):
            if policy.buckets.pad(n) != n:
                raise ConfigError(
                    f"warmup.prefill_seq_lens[{i}]",
                    n,
                    f"is not a padded length of the {policy.buckets.kind} buckets "
                    f"(would pad to {policy.buckets.pad(n)})",
                )
        for i, b in enumerate(warmup.prefill_batch_sizes):
            if b > policy.max_batch_size or b > policy.lane_capacity:
                raise ConfigError(
                    f"warmup.prefill_batch_sizes[{i}]",
                    b,
                    f"exceeds prefill.max_batch_size={policy.max_batch_size} or the lane "
                    f"capacity {policy.lane_capacity}",
                )
        shortest = min(warmup.prefill_seq_lens)
        coverage: list[PrefillCoverage] = []
        for n in warmup.prefill_seq_lens:
            # The Q128 rule: configured batch sizes denote physical waves at the shortest
            # length; other lengths use single-row coverage.
            for b in warmup.prefill_batch_sizes if n == shortest else (1,):
                coverage.append(PrefillCoverage(seq_len=n, batch_size=b, variant="regular"))
        if trace.enabled:
            # Once traces are active the compile gate is closed, so every geometry the planner
            # can produce must be compiled now, whether that operation replays a trace or runs
            # eagerly: each bucket length single-row, with and without a cached prefix, and
            # every warmed wave size at each bucket length up to the planner's wave limit
            # (also with cached rows where they join waves).
            limit = prefill.layout.max_sequence_length - prefill.layout.block_size
            for n in policy.buckets.lengths():
                # A cached row holds at least one prefix block and the fewest new tokens
                # that still pad to ``n``.
                cached_fits = _shortest_new_tokens(n, policy=policy) <= limit
                coverage.append(PrefillCoverage(seq_len=n, batch_size=1, variant="regular"))
                if cached_fits:
                    coverage.append(PrefillCoverage(seq_len=n, batch_size=1, variant="chunked"))
                if policy.max_wave_seq_len is None or n <= policy.max_wave_seq_len:
                    variants = ["regular"]
                    if policy.wave_rules != "spec" and cached_fits:
                        variants.append("chunked")
                    coverage.extend(
                        PrefillCoverage(seq_len=n, batch_size=b, variant=variant)
                        for b in policy.wave_sizes_at(n)
                        for variant in variants
                    )
        coverage = sorted(set(coverage), key=lambda c: (c.variant, c.seq_len, c.batch_size))
        return cls(
            warmup=warmup,
            trace=trace,
            prefill_coverage=_that_fit(coverage, layout=prefill.layout, policy=policy),
            layout=prefill.layout,
            lane_capacity=prefill.lane_capacity,
            lane=lane,
        )


@attrs.frozen(kw_only=True)
class CoverageManifest:
    """Immutable record of what a lane compiled and captured (sorted: order-independent)."""

    eager_programs: tuple[tuple[str, str], ...]
    traced_programs: tuple[str, ...]
    trace_signatures: tuple[str, ...]
    aliases: tuple[tuple[str, str], ...]
    schema_fingerprint: str
    workspace_fingerprint: str

    def to_dict(self) -> dict[str, object]:
        return attrs.asdict(self)


def _fingerprint(material: object) -> str:
    blob = json.dumps(material, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class CaptureBarrier:
    """Defers capture until every lane is ready, then captures all lanes together.

    The commit is all or none: if lane k fails to capture, the lanes before it are rolled
    back (their traces released, then their inputs; their gates restored) and the error is
    raised; reporting again retries the whole commit.
    """

    def __init__(self, *, lanes: int) -> None:
        self.lanes = lanes
        self._ready: dict[int, WarmupCoordinator] = {}
        self.captured = False

    def report(self, coordinator: WarmupCoordinator) -> bool:
        """Record one lane's readiness; capture everything once all lanes agree."""
        lane_id = coordinator.config.lane
        known = self._ready.get(lane_id)
        if known is not None and known is not coordinator:
            raise IdentityError(f"one warmup coordinator per lane ({lane_id})", known, coordinator)
        self._ready[lane_id] = coordinator
        if self.captured or len(self._ready) < self.lanes:
            return self.captured
        ready = sorted(self._ready.items())
        first_lane, first = ready[0]
        expected = first.readiness()
        for lane, other in ready[1:]:
            if other.readiness() != expected:
                raise IdentityError(
                    f"every lane reports identical warmup readiness (lane {first_lane} vs {lane})",
                    first,
                    other,
                )
        committed: list[WarmupCoordinator] = []
        try:
            for _, coordinator_ in ready:
                coordinator_.capture_now()
                committed.append(coordinator_)
        except BaseException as exc:
            for done in reversed(committed):
                try:
                    done.rollback_capture()
                except Exception as rollback_error:  # keep rolling back the others
                    exc.add_note(
                        f"lane {done.config.lane}: rolling back its capture also failed: "
                        f"{type(rollback_error).__name__}: {rollback_error}"
                    )
            raise
        self.captured = True
        return True


class WarmupCoordinator:
    """Compiles one lane's coverage and triggers trace capture at the barrier."""

    def __init__(
        self,
        config: WarmupCoordinatorConfig,
        *,
        execution: EagerExecutor | TracedExecutor,
        barrier: CaptureBarrier | None = None,
    ) -> None:
        self.config = config
        self.execution = execution
        self.barrier = barrier if barrier is not None else CaptureBarrier(lanes=1)
        self._prefill_done = False
        self._decode_done = False
        self._captured = False
        self._log = component_logger("warmup", lane=config.lane, object_id=f"{id(self):#x}")

    def configure_page_table_layout(self, layout: PageTableLayout) -> None:
        """Adopt the late physical layout (shrink only) before any warmup ran.

        Geometries whose smallest instance no longer fits the KV pool are dropped: the
        planner can never form them.
        """
        self.config.layout.check_replacement(layout)
        coverage = _that_fit(
            self.config.prefill_coverage,
            layout=layout,
            policy=self._eager.prefill.config.policy,
        )
        self.config = attrs.evolve(self.config, layout=layout, prefill_coverage=coverage)

    @property
    def ready(self) -> bool:
        return self._prefill_done and self._decode_done

    @property
    def captured(self) -> bool:
        return self._captured

    @property
    def _eager(self) -> EagerExecutor:
        ex = self.execution
        return ex.eager_executor if isinstance(ex, TracedExecutor) else ex

    # -- warmup --------------------------------------------------------------------------

    def warmup_prefill(self) -> None:
        if not self._prefill_done:
            emit(
                self._log,
                "warmup.started",
                operation="prefill",
                geometries=len(self.config.prefill_coverage),
            )
            coverage = self.config.prefill_coverage
            for cov in progress(coverage, desc="compiling prefill", unit="program"):
                self.execution.compile_prefill(self._representative_prefill(cov))
            self._prefill_done = True
            emit(
                self._log,
                "warmup.completed",
                operation="prefill",
                geometries=len(self.config.prefill_coverage),
            )
        self._maybe_capture()

    def warmup_decode(self) -> None:
        if not self._decode_done:
            config = self._eager.decode.config
            geometries = [
                (batch, width)
                for batch in sorted(config.batch_sizes, reverse=True)
                for width in reversed(config.widths)
            ]
            emit(self._log, "warmup.started", operation="decode", geometries=len(geometries))
            for batch, width in progress(geometries, desc="compiling decode", unit="program"):
                self.execution.compile_decode(self._representative_decode(batch, width))
            self._decode_done = True
            emit(self._log, "warmup.completed", operation="decode", geometries=len(geometries))
        self._maybe_capture()

    def _maybe_capture(self) -> None:
        if self.ready and self.config.trace.enabled and not self._captured:
            emit(self._log, "lane.ready", lane=self.config.lane, readiness=self.readiness())
            self.barrier.report(self)

    def activate(self) -> None:
        """Serving-ready: both warmups ran and, when tracing, the barrier committed capture.

        Reporting again after a failed capture retries it (the barrier captures all lanes once
        every lane has reported).
        """
        if not self.ready:
            missing = [
                op
                for op, done in (("decode", self._decode_done), ("prefill", self._prefill_done))
                if not done
            ]
            raise TraceStateError(
                f"lane {self.config.lane}: activate needs {' and '.join(missing)} warmup first"
            )
        if self.config.trace.enabled and not self._captured:
            self.barrier.report(self)

    def capture_now(self) -> None:
        """Capture this lane's registered traces (called by the barrier); all or nothing."""
        if self._captured or not isinstance(self.execution, TracedExecutor):
            self._captured = True
            return
        self.execution.capture_all()
        self._captured = True

    def rollback_capture(self) -> None:
        """Undo this lane's committed capture (another lane of the barrier failed)."""
        if isinstance(self.execution, TracedExecutor):
            self.execution.trace_compiler.uncapture()
        self._captured = False

    # -- representative inputs -----------------------------------------------------------

    def _representative_prefill(self, cov: PrefillCoverage) -> PreparedPrefill:
        """The smallest call planned as ``cov``: the fewest rows padding to its batch, each
        of the shortest length padding to its sequence length.

        Cached rows share one read-only prefix block, as prefix-cache hits do.
        """
        runtime = self._eager.prefill
        policy = runtime.config.policy
        bs = self.config.layout.block_size
        new = _shortest_new_tokens(cov.seq_len, policy=policy)
        cached = bs if cov.variant == "chunked" else 0
        prefix = cached // bs
        per_row = -(-new // bs)
        rows = [
            PrefillRow(
                source_row=i,
                tokens=torch.zeros(cached + new, dtype=torch.int64),
                cached_tokens=cached,
                slot=i,
                block_ids=(
                    *range(prefix),
                    *range(prefix + i * per_row, prefix + (i + 1) * per_row),
                ),
            )
            for i in range(_fewest_rows(cov.batch_size, policy=policy))
        ]
        prepared = runtime.prepare(rows=rows)
        return _without_kv_writes(prepared)

    def _representative_decode(self, batch: int, width: int) -> PreparedDecode:
        """A step of ``batch`` rows at page-table ``width`` that reads and writes no KV."""
        runtime = self._eager.decode
        table = torch.zeros((batch, 1), dtype=torch.int32)
        prepared = runtime.prepare(
            tokens=torch.zeros(batch, dtype=torch.int64),
            start_pos=torch.zeros(batch, dtype=torch.int32),
            page_table=table,
            reset_batch=True,
        )
        return attrs.evolve(
            prepared,
            page_table=torch.full((prepared.page_table.shape[0], width), -1, dtype=torch.int32),
            signature=attrs.evolve(prepared.signature, page_table_width=width),
        )

    # -- coverage ------------------------------------------------------------------------

    def readiness(self) -> str:
        """Fingerprint of what this lane compiled and registered (lane-independent)."""
        m = self.manifest()
        return _fingerprint([m.eager_programs, m.traced_programs, m.trace_signatures, m.aliases])

    def manifest(self) -> CoverageManifest:
        """The coverage manifest, read from the authoritative registries."""
        compiler = self._eager.program_compiler
        programs = tuple(sorted((p.description, p.key) for p in compiler.programs.values()))
        traced: list[str] = []
        signatures: list[str] = []
        aliases: list[tuple[str, str]] = []
        if isinstance(self.execution, TracedExecutor):
            for trace_key, artifact in self.execution.trace_compiler.artifacts.items():
                signatures.append(trace_key)
                traced.extend(artifact.program_keys)
                # The first registrant depends on warmup order; the manifest must not.
                aliases.extend((p, trace_key) for p in sorted(artifact.program_keys)[1:])
        layout = self.config.layout
        return CoverageManifest(
            eager_programs=programs,
            traced_programs=tuple(sorted(traced)),
            trace_signatures=tuple(sorted(signatures)),
            aliases=tuple(sorted(aliases)),
            schema_fingerprint=_fingerprint(
                {"schema": MANIFEST_SCHEMA, "programs": [k for _, k in programs]}
            ),
            workspace_fingerprint=_fingerprint(
                {
                    "block_size": layout.block_size,
                    "num_blocks": layout.num_blocks,
                    "width": layout.width,
                    "lane_capacity": self.config.lane_capacity,
                    "trace": self.config.trace.mode,
                }
            ),
        )


def _shortest_new_tokens(seq_len: int, *, policy: PrefillPlanPolicy) -> int:
    """The fewest new tokens per row that still pad to ``seq_len``."""
    shorter = [n for n in policy.buckets.lengths() if n < seq_len]
    return shorter[-1] + 1 if shorter else 1


def _fewest_rows(batch: int, *, policy: PrefillPlanPolicy) -> int:
    """The fewest rows the planner pads to a wave of ``batch`` (a wave has at least two)."""
    if batch == 1:
        return 1
    smaller = [b for b in policy.wave_batch_sizes if b < batch]
    return smaller[-1] + 1 if smaller else 2


def _that_fit(
    coverage: Sequence[PrefillCoverage], *, layout: PageTableLayout, policy: PrefillPlanPolicy
) -> tuple[PrefillCoverage, ...]:
    """The geometries whose smallest instance fits ``layout``'s KV pool (others never form)."""
    bs = layout.block_size

    def blocks(cov: PrefillCoverage) -> int:
        prefix = 1 if cov.variant == "chunked" else 0
        rows = _fewest_rows(cov.batch_size, policy=policy)
        return prefix + rows * -(-_shortest_new_tokens(cov.seq_len, policy=policy) // bs)

    return tuple(c for c in coverage if blocks(c) <= layout.num_blocks)


def _without_kv_writes(prepared: PreparedPrefill) -> PreparedPrefill:
    """The same prepared call with every page table set to ``-1`` (no KV reads or writes)."""
    requests = []
    for req in prepared.requests:
        chunks = tuple(
            attrs.evolve(c, page_table=torch.full_like(c.page_table, -1))
            for c in req.request.chunks
        )
        request = attrs.evolve(
            req.request, chunks=chunks, page_table=torch.full_like(req.request.page_table, -1)
        )
        requests.append(attrs.evolve(req, request=request))
    return attrs.evolve(prepared, requests=tuple(requests))


def _within_chunk(warmup: WarmupConfig, lengths: tuple[int, ...], chunk: int) -> WarmupConfig:
    """The warmup lengths as prefills run them when the page table is narrower than the
    chunk asked for (a model with fewer positions than ``prefill.max_chunk_size``): a length
    past the narrowed chunk runs as its largest padded length, as ``Recipe`` derives them for
    ``serving.max_model_len`` (lengths past the chunk asked for are refused before)."""
    if all(n <= chunk for n in warmup.prefill_seq_lens):
        return warmup
    usable = [n for n in lengths if n <= chunk] or [chunk]
    fitted = sorted({min(n, usable[-1]) for n in warmup.prefill_seq_lens})
    return attrs.evolve(warmup, prefill_seq_lens=tuple(fitted))
