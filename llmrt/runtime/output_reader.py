"""Device-to-host output reads: blocking, and retained asynchronous reads with events.

``OutputReader`` is the sole owner of pending host destinations and their
completion events. An asynchronous read is submitted (non-blocking copies plus a
recorded event), handed to an external scheduler as ``(host_value, events)``,
and completed later, which synchronizes the event before the host value is
trusted. ``drain()`` retires whatever the scheduler never completed.

There is no silent fallback: a failed non-blocking read or event record is an error
(``DeviceError`` from the device's), logged as ``output.read_failed``, after the device is
synchronized so no copy still in flight lands in a destination nobody owns.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import attrs
import torch

from llmrt.device.base import Device, is_device_tensor
from llmrt.errors import DeviceError
from llmrt.lifecycle.events import component_logger, emit


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every device tensor (of any backend) nested in tuples, lists and dicts;
    keep everything else."""
    if is_device_tensor(value):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value


@attrs.define(kw_only=True, eq=False)
class PendingRead:
    """One submitted asynchronous read. ``host_value`` is valid only after ``complete``."""

    sequence: int
    host_value: Any
    events: tuple[Any, ...]
    owner_id: int
    completed: bool = False


class OutputReader:
    """Owns pending host destinations and completion events for one lane's device."""

    def __init__(self, *, device: Device, lane: int = 0) -> None:
        self.borrowed_device = device
        self.lane = lane
        self._pending: dict[int, PendingRead] = {}
        self._by_host_id: dict[int, int] = {}
        self._sequence = itertools.count(1)
        self._log = component_logger("output_reader", lane=lane, object_id=f"{id(self):#x}")

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def read(self, value: Any) -> Any:
        """Blocking read of a nested output value to host tensors."""
        host = map_tensors(value, lambda t: self.borrowed_device.read(t, blocking=True))
        emit(self._log, "output.read")
        return host

    def submit(self, value: Any) -> PendingRead:
        """Start non-blocking copies of ``value`` and record one completion event."""
        device = self.borrowed_device
        try:
            host = map_tensors(value, lambda t: device.read(t, blocking=False))
        except Exception as exc:
            raise self._failed("non-blocking read", exc) from exc
        try:
            events: tuple[Any, ...] = (device.record_event(),)
        except Exception as exc:
            raise self._failed("record_event", exc) from exc
        pending = PendingRead(
            sequence=next(self._sequence), host_value=host, events=events, owner_id=id(self)
        )
        self._pending[pending.sequence] = pending
        self._by_host_id[id(host)] = pending.sequence
        emit(self._log, "output.submitted", sequence=pending.sequence, events=len(events))
        return pending

    def _failed(self, operation: str, exc: Exception) -> DeviceError:
        """Log the failure and wait out copies already started; the caller raises the result."""
        error = DeviceError(
            f"lane {self.lane}: asynchronous output read failed at {operation}: "
            f"{type(exc).__name__}: {exc}"
        )
        try:
            self.borrowed_device.synchronize()
        except Exception as sync_error:
            error.add_note(f"synchronizing after the failure also failed: {sync_error}")
        emit(
            self._log,
            "output.read_failed",
            operation=operation,
            error=f"{type(exc).__name__}: {exc}",
        )
        return error

    def _lookup(self, handle: PendingRead | Any) -> PendingRead:
        if isinstance(handle, PendingRead):
            if handle.owner_id != id(self):
                raise DeviceError(
                    f"PendingRead #{handle.sequence} belongs to another OutputReader "
                    f"(@{handle.owner_id:#x}), not this one (@{id(self):#x})"
                )
            pending = self._pending.get(handle.sequence)
            if pending is not handle:
                raise DeviceError(
                    f"PendingRead #{handle.sequence} is not pending (already completed?)"
                )
            return pending
        sequence = self._by_host_id.get(id(handle))
        if sequence is None:
            raise DeviceError(
                f"{type(handle).__name__}@{id(handle):#x} is not a host value this reader submitted"
            )
        return self._pending[sequence]

    def complete(self, handle: PendingRead | Any) -> Any:
        """Synchronize a pending read's event and return its now-valid host value.

        If the wait fails the read stays pending (``drain`` or another ``complete`` retires it).
        """
        pending = self._lookup(handle)
        for event in pending.events:
            self.borrowed_device.event_synchronize(event)
        self._forget(pending)
        emit(self._log, "output.completed", sequence=pending.sequence)
        return pending.host_value

    def _forget(self, pending: PendingRead) -> None:
        pending.completed = True
        self._pending.pop(pending.sequence, None)
        self._by_host_id.pop(id(pending.host_value), None)

    def drain(self) -> int:
        """Retire every pending read (synchronizing the device once); idempotent.

        If the synchronize fails, nothing is retired, so a later ``drain`` retries.
        """
        if not self._pending:
            return 0
        count = len(self._pending)
        self.borrowed_device.synchronize()
        for pending in list(self._pending.values()):
            self._forget(pending)
        emit(self._log, "output.drained", count=count)
        return count
