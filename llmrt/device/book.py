"""Bookkeeping every backend device keeps the same way: its traces, counters and host checks.

A device owns one :class:`DeviceBook`; the backend decides what a trace record holds
(a CUDA graph, a ttnn trace id) and the book keeps the registry, the released ids and
the tensor/trace counters that ``Device.stats()`` reports.
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar

import torch

from llmrt.device.base import DeviceStats, Trace
from llmrt.errors import DeviceError, TraceStateError


class TraceRecord(Protocol):
    """What a backend records per captured trace: at least the handle it gave out."""

    @property
    def handle(self) -> Trace[Any]: ...


R = TypeVar("R", bound=TraceRecord)


class DeviceBook(Generic[R]):
    """One device's live trace records, released trace ids and counters (owned by the device)."""

    def __init__(self, device_id: str) -> None:
        self.device_id = device_id
        self.traces: dict[int, R] = {}
        self._released_trace_ids: set[int] = set()
        self._next_trace_id = 0
        self.allocations = 0
        self.deallocations = 0
        self.captures = 0
        self.replays = 0

    def next_trace_id(self) -> int:
        trace_id = self._next_trace_id
        self._next_trace_id += 1
        return trace_id

    def add_trace(self, record: R) -> None:
        """Register a finished capture."""
        self.traces[record.handle.trace_id] = record
        self.captures += 1

    def trace_record(self, op: str, trace: Trace[Any], *, busy: str | None) -> R | None:
        """The live record of ``trace``, or None if it was released; raises if it is foreign.

        ``busy`` is the device's current trace activity (capture/replay), if any.
        """
        if busy is not None:
            raise TraceStateError(f"{op}: not allowed during trace {busy} on {self.device_id}")
        if trace.device_id != self.device_id:
            raise TraceStateError(
                f"{op}: trace {trace.trace_id} belongs to {trace.device_id}, not {self.device_id}"
            )
        if trace.trace_id in self._released_trace_ids:
            return None
        record = self.traces.get(trace.trace_id)
        if record is None or record.handle is not trace:
            raise TraceStateError(f"{op}: {trace!r} was not captured by {self.device_id}")
        return record

    def forget_trace(self, trace_id: int) -> None:
        """Mark a trace released (its backend resources are already gone)."""
        del self.traces[trace_id]
        self._released_trace_ids.add(trace_id)

    @property
    def live_tensors(self) -> int:
        """Tensors from ``allocate``/``upload`` not yet deallocated."""
        return self.allocations - self.deallocations

    def stats(self, *, pending_reads: int) -> DeviceStats:
        return DeviceStats(
            live_tensors=self.live_tensors,
            live_traces=len(self.traces),
            pending_reads=pending_reads,
            allocations=self.allocations,
            deallocations=self.deallocations,
            captures=self.captures,
            replays=self.replays,
        )


def require_host(op: str, host: torch.Tensor) -> None:
    """Raise unless ``host`` is a cpu tensor."""
    if not isinstance(host, torch.Tensor) or host.device.type != "cpu":
        shown = describe_tensor(host) if isinstance(host, torch.Tensor) else type(host).__name__
        raise DeviceError(f"{op}: expected a host (cpu) tensor, got {shown}")


def describe_tensor(tensor: torch.Tensor) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"tensor(shape={tuple(tensor.shape)}, dtype={dtype}, device={tensor.device})"


def poison(dtype: torch.dtype) -> float | int | bool:
    """A value no correct read returns by accident (fills a non-blocking read until its event)."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).max
