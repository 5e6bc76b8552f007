"""Data-parallel fanout over already-built lane executors.

``LaneGroupExecutor`` presents the same execution surface as one lane. Prefill
rows are routed to lanes by global slot (lane = slot // lane_capacity) with
lane-local slots and row-scoped sampling parameters; every participating lane is
prepared and preflighted before any executes; results come back in the caller's
source-row order. Decode splits the global fixed-capacity batch into contiguous
lane batches. Data-parallel log-probabilities are rejected explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from llmrt.errors import CleanupError, IdentityError, RequestError, UnsupportedError
from llmrt.runtime.checks import INTEGER_KINDS, host_array
from llmrt.runtime.decode import DecodeOutput, DecodeOutputLease
from llmrt.runtime.model_executor import ModelExecutor
from llmrt.runtime.prefill.plan import PrefillRow
from llmrt.runtime.prefill.result_collector import PrefillOutput
from llmrt.runtime.prefill.runtime import TokenHistory
from llmrt.runtime.warmup import CaptureBarrier
from llmrt.sampling.params import SamplingParams

ParamsArg = SamplingParams | Sequence[SamplingParams | None] | None


@attrs.frozen(kw_only=True, eq=False)
class LaneGroupLease:
    """One combined external contract over per-lane decode leases.

    ``rows`` is the global batch size of the decode call (lane rows scatter back to it).
    """

    leases: tuple[DecodeOutputLease, ...]
    rows: int


@attrs.frozen(kw_only=True, eq=False)
class LaneGroupHost:
    """Per-lane host values of a combined asynchronous read (``rows``: the global batch)."""

    values: tuple[tuple[int, object], ...]  # (lane index, that lane's host value)
    rows: int


class LaneGroupExecutor:
    """Several lanes as one execution target (one lane is the degenerate group)."""

    def __init__(
        self, *, lanes: Sequence[ModelExecutor], barrier: CaptureBarrier | None = None
    ) -> None:
        if not lanes:
            raise RequestError("lanes", "a lane group needs at least one lane")
        first = lanes[0]
        for lane in lanes[1:]:
            if lane.lane_capacity != first.lane_capacity:
                raise IdentityError("lanes share one lane capacity", first, lane)
            if lane.layout.block_size != first.layout.block_size:
                raise IdentityError("lanes share one KV block size", first, lane)
        devices = [lane.decode.config.device for lane in lanes]
        if len({id(d) for d in devices}) != len(devices):
            raise IdentityError("each lane has its own device", devices[0], devices[1])
        self.lanes = tuple(lanes)
        self.barrier = barrier

    @property
    def lane_capacity(self) -> int:
        return self.lanes[0].lane_capacity

    @property
    def capacity(self) -> int:
        """Decode slots over all lanes (global slot = lane * lane_capacity + local slot)."""
        return self.lane_capacity * len(self.lanes)

    # -- KV and warmup -------------------------------------------------------------------

    def configure_kv_capacity(self, num_blocks: int | None = None) -> None:
        for lane in self.lanes:
            lane.configure_kv_capacity(num_blocks)

    def allocate_kv_cache(self) -> list[object]:
        return [lane.allocate_kv_cache() for lane in self.lanes]

    def warmup_prefill(self) -> None:
        for lane in self.lanes:
            lane.warmup_prefill()

    def warmup_decode(self) -> None:
        for lane in self.lanes:
            lane.warmup_decode()

    def activate(self) -> None:
        """Commit trace capture on every lane through the shared barrier (all lanes or none)."""
        for lane in self.lanes:
            lane.activate()

    # -- prefill -------------------------------------------------------------------------

    def prefill_forward(
        self,
        *,
        rows: Sequence[PrefillRow],
        sampling_params: ParamsArg = None,
        step_offsets: Sequence[int] | None = None,
        history: TokenHistory | None = None,
        enable_trace: bool | None = None,
    ) -> PrefillOutput:
        """Route rows to lanes by slot, preflight every lane, run, restore source order."""
        n = len(rows)
        params = _per_row(sampling_params, n)
        if (
            len(self.lanes) > 1
            and params is not None
            and any(p is not None and p.logprobs is not None for p in params)
        ):
            raise UnsupportedError(
                "log-probabilities are not aggregated across data-parallel lanes; "
                "use a single-lane recipe (lanes: 1) to request logprobs"
            )
        routed: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            lane = row.slot // self.lane_capacity
            if not 0 <= row.slot < self.capacity:
                raise RequestError(
                    "slots", f"slot out of range [0, {self.capacity})", row=i, value=row.slot
                )
            routed.setdefault(lane, []).append(i)
        calls = []
        for lane_index, members in sorted(routed.items()):
            local_rows = [
                attrs.evolve(rows[i], source_row=j, slot=rows[i].slot % self.lane_capacity)
                for j, i in enumerate(members)
            ]
            target, prepared = self.lanes[lane_index].prepare_prefill(
                rows=local_rows,
                sampling_params=None if params is None else [params[i] for i in members],
                step_offsets=None if step_offsets is None else [step_offsets[i] for i in members],
                enable_trace=enable_trace,
            )
            calls.append((members, target, prepared))
        for _, target, prepared in calls:
            target.preflight_prefill(prepared)
        pieces: list[tuple[list[int], PrefillOutput]] = []
        for members, target, prepared in calls:
            lane_history = None if history is None else [history[i] for i in members]
            pieces.append((members, target.run_prefill(prepared, history=lane_history)))
        return _merge_prefill(pieces, n)

    # -- decode --------------------------------------------------------------------------

    def _split(self, values: torch.Tensor) -> list[torch.Tensor]:
        if values.shape[0] > self.capacity:
            raise RequestError(
                "tokens",
                f"batch of {values.shape[0]} exceeds the group capacity {self.capacity}",
                value=int(values.shape[0]),
            )
        return [
            values[i * self.lane_capacity : (i + 1) * self.lane_capacity]
            for i in range(len(self.lanes))
        ]

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
        tokens_from_device: bool = False,
    ) -> DecodeOutput | LaneGroupLease:
        """Contiguous lane batches of the global slot batch, each cut after its last live row
        (a row whose page table maps a block); lanes with no live row are skipped.

        ``tokens_from_device``: every lane takes its tokens from its previous step's samples
        (see ``DecodeRuntime.prepare``)."""
        tok = torch.as_tensor(tokens).reshape(-1)
        pos = torch.as_tensor(start_pos).reshape(-1)
        table = torch.as_tensor(page_table)
        cap = self.lane_capacity
        if (
            sampling_params is not None
            and len(self.lanes) > 1
            and any(p is not None and p.logprobs is not None for p in sampling_params)
        ):
            raise UnsupportedError(
                "log-probabilities are not aggregated across data-parallel lanes"
            )
        outputs: list[tuple[int, DecodeOutput | DecodeOutputLease]] = []
        # Which rows are live, read on the host (``host_array``, on every step); a table not
        # 2-D or not integers is left to the lane's checks, which name the problem.
        host_table = host_array(table)
        mapped: np.ndarray | None = None
        if host_table.ndim == 2 and host_table.dtype.kind in INTEGER_KINDS:
            mapped = np.asarray((host_table >= 0).any(axis=1))
        for lane_index, (lane, t) in enumerate(zip(self.lanes, self._split(tok), strict=True)):
            lo, hi = lane_index * cap, lane_index * cap + t.numel()
            live = np.flatnonzero(mapped[lo:hi]) if mapped is not None else np.arange(hi - lo)
            if live.size == 0:
                continue  # no live row on this lane: nothing to run there
            # Trailing padding rows are cut so the lane runs its smallest decode batch
            # holding the live ones; their outputs come back as zeros.
            hi = lo + int(live[-1]) + 1
            t = t[: hi - lo]
            outputs.append(
                (
                    lane_index,
                    lane.decode_forward(
                        tokens=t,
                        start_pos=pos[lo:hi],
                        page_table=table[lo:hi],
                        sampling_params=None
                        if sampling_params is None
                        else list(sampling_params[lo:hi]),
                        step_offsets=None if step_offsets is None else list(step_offsets[lo:hi]),
                        reset_batch=reset_batch,
                        read_from_device=read_from_device,
                        history=None if history is None else list(history[lo:hi]),
                        enable_trace=enable_trace,
                        tokens_from_device=tokens_from_device,
                    ),
                )
            )
        if not read_from_device:
            return LaneGroupLease(
                leases=tuple(o for _, o in outputs if isinstance(o, DecodeOutputLease)),
                rows=int(tok.numel()),
            )
        return _scatter_lanes(
            [(i, o) for i, o in outputs if isinstance(o, DecodeOutput)],
            rows=int(tok.numel()),
            cap=cap,
        )

    def read_decode_output(
        self, lease: LaneGroupLease | DecodeOutputLease, *, async_read: bool
    ) -> tuple[Any, tuple[Any, ...]]:
        """Start every lane's read at once; one combined ``(host_value, events)`` contract."""
        if isinstance(lease, DecodeOutputLease):
            lane_index = self._owner(lease)
            lease = LaneGroupLease(
                leases=(lease,), rows=lane_index * self.lane_capacity + lease.active_rows
            )
        values: list[tuple[int, object]] = []
        events: list[object] = []
        for lane_lease in lease.leases:
            index = self._owner(lane_lease)
            host, lane_events = self.lanes[index].read_decode_output(
                lane_lease, async_read=async_read
            )
            values.append((index, host))
            events.extend(lane_events)
        return LaneGroupHost(values=tuple(values), rows=lease.rows), tuple(events)

    def process_decode_output_host(
        self, host_value: Any, *, is_tokens: bool | None = None
    ) -> DecodeOutput:
        if not isinstance(host_value, LaneGroupHost):
            raise RequestError(
                "host_value", "was not produced by LaneGroupExecutor.read_decode_output"
            )
        return _scatter_lanes(
            [
                (index, self.lanes[index].process_decode_output_host(value, is_tokens=is_tokens))
                for index, value in host_value.values
            ],
            rows=host_value.rows,
            cap=self.lane_capacity,
        )

    def _owner(self, lease: DecodeOutputLease) -> int:
        for index, lane in enumerate(self.lanes):
            if lane.decode.owns_lease(lease):
                return index
        raise RequestError("lease", "is not an outstanding lease of any lane in this group")

    def drain_external_outputs(self) -> int:
        return sum(lane.decode.drain_external_outputs() for lane in self.lanes)

    # -- cleanup -------------------------------------------------------------------------

    def cleanup(self, *, primary: BaseException | None = None) -> None:
        """Clean every lane (each in the spec's order), last lane first, as the containers'
        scopes do: a lane whose cleanup failed stops it (the lanes before it stay open until
        a retry gets past it). Idempotent: a lane already clean does nothing again."""
        for lane in reversed(self.lanes):
            try:
                lane.cleanup()
            except CleanupError as exc:
                raise CleanupError(exc.failures, primary=primary) from exc


def _per_row(params: ParamsArg, n: int) -> list[SamplingParams | None] | None:
    if params is None:
        return None
    if isinstance(params, SamplingParams):
        return [params] * n
    rows = list(params)
    # Singleton sampling fields broadcast within each participating lane.
    if len(rows) == 1 and n > 1:
        return rows * n
    if len(rows) != n:
        raise RequestError("sampling_params", f"has {len(rows)} entries for {n} rows")
    return rows


def _merge_prefill(pieces: list[tuple[list[int], PrefillOutput]], n: int) -> PrefillOutput:
    """Each lane's rows back at their source rows (fields every lane left None stay None)."""

    def merged(values: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
        if any(v is None for v in values):
            return None
        present = [v for v in values if v is not None]
        result = present[0].new_zeros((n, *present[0].shape[1:]))
        for (members, _), value in zip(pieces, present, strict=True):
            result[torch.tensor(members)] = value
        return result

    tops = [out.top_logprobs for _, out in pieces]
    top_logprobs = None
    if all(t is not None for t in tops):
        values = merged([t[0] for t in tops if t is not None])
        ids = merged([t[1] for t in tops if t is not None])
        top_logprobs = None if values is None or ids is None else (values, ids)
    return PrefillOutput(
        tokens=merged([out.tokens for _, out in pieces]),
        logits=merged([out.logits for _, out in pieces]),
        logprobs=merged([out.logprobs for _, out in pieces]),
        top_logprobs=top_logprobs,
    )


def _scatter_lanes(
    outs: Sequence[tuple[int, DecodeOutput]], *, rows: int, cap: int
) -> DecodeOutput:
    """Place each lane's rows at its global slots; rows of skipped lanes are zero."""
    if len(outs) == 1 and outs[0][0] == 0 and _rows_of(outs[0][1]) == rows:
        return outs[0][1]

    def place(values: Sequence[tuple[int, torch.Tensor | None]]) -> torch.Tensor | None:
        if not values or any(v is None for _, v in values):
            return None
        present = [(i, v) for i, v in values if v is not None]
        result = present[0][1].new_zeros((rows, *present[0][1].shape[1:]))
        for lane_index, value in present:
            result[lane_index * cap : lane_index * cap + value.shape[0]] = value
        return result

    tops = None
    if outs and all(o.top_logprobs is not None for _, o in outs):
        values = place([(i, o.top_logprobs[0]) for i, o in outs if o.top_logprobs is not None])
        ids = place([(i, o.top_logprobs[1]) for i, o in outs if o.top_logprobs is not None])
        tops = None if values is None or ids is None else (values, ids)
    return DecodeOutput(
        tokens=place([(i, o.tokens) for i, o in outs]),
        logits=place([(i, o.logits) for i, o in outs]),
        logprobs=place([(i, o.logprobs) for i, o in outs]),
        top_logprobs=tops,
    )


def _rows_of(out: DecodeOutput) -> int | None:
    for value in (out.tokens, out.logits, out.logprobs):
        if value is not None:
            return int(value.shape[0])
    return None
