"""The device port: the narrow surface the runtime uses to talk to hardware.

The runtime never imports a backend; it receives a ``Device`` (``TorchDevice`` for CPU and
CUDA, ``TtnnDevice`` for Tenstorrent) and uses only what is listed here.

Traces take the program as a callable: ttnn's ``begin_trace_capture``/ops/``end_trace_capture``
and ``torch.cuda.graph`` both wrap "run the program once", so a callable keeps the port narrow
and lets the CPU backend replay it. While a device is capturing, it rejects uploads,
allocations, refreshes and reads, as real hardware does.

Ownership: a tensor returned by ``allocate``/``upload`` is owned by the caller, who must
``deallocate`` it; a trace's ``outputs`` are owned by the trace until ``release_trace``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

import attrs
import torch

from llmrt.errors import DeviceError

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

DeviceKind = Literal["cpu", "cuda", "ttnn"]
DeviceTensor = torch.Tensor
"""The backend's device tensor (``torch.Tensor`` for ``TorchDevice``)."""


@runtime_checkable
class BackendTensor(Protocol):
    """A device tensor of a backend whose tensors are not torch tensors (a ``ttnn.Tensor``).

    Torch functions and methods do not run on it: the runtime only hands it to the device
    port (``read``, ``refresh``, ``deallocate``) and to the model.
    """

    @property
    def shape(self) -> Any: ...

    @property
    def dtype(self) -> Any: ...

    def storage_type(self) -> Any: ...

    def is_allocated(self) -> bool: ...


def checked_dim_order(shape: Sequence[int], dim_order: Sequence[int] | None) -> tuple[int, ...]:
    """``dim_order`` as a tuple (None: row-major); raises unless it permutes ``shape``'s dims."""
    if dim_order is None:
        return tuple(range(len(shape)))
    order = tuple(dim_order)
    if sorted(order) != list(range(len(shape))):
        raise DeviceError(
            f"allocate: dim_order {order} is not a permutation of the {len(shape)} dimensions "
            f"of shape {tuple(shape)}"
        )
    return order


#: Values that are never a backend's tensor: checked before the ``BackendTensor`` protocol,
#: whose ``isinstance`` costs ~17 us (output walks meet a dict on every decode step).
_PLAIN_VALUES = (type(None), bool, int, float, str, bytes, tuple, list, dict)


def is_device_tensor(value: object) -> bool:
    """Whether ``value`` is a device tensor of any backend (what reads and releases visit)."""
    if isinstance(value, torch.Tensor):
        return True
    return not isinstance(value, _PLAIN_VALUES) and isinstance(value, BackendTensor)


class Event(Protocol):
    """A point in a device queue; reads queued before it are valid once it is synchronized."""

    @property
    def device_id(self) -> str: ...


class Trace(Protocol[T_co]):
    """A captured program; ``outputs`` are persistent tensors rewritten by each replay."""

    @property
    def trace_id(self) -> int: ...

    @property
    def device_id(self) -> str: ...

    @property
    def outputs(self) -> T_co: ...


@attrs.frozen(kw_only=True)
class DeviceStats:
    """Counters for leak checks: tensors allocated and not deallocated, traces not released."""

    live_tensors: int
    live_traces: int
    pending_reads: int
    allocations: int
    deallocations: int
    captures: int
    replays: int


@runtime_checkable
class Device(Protocol):
    """One device or lane sub-device; every method documents one port operation."""

    @property
    def id(self) -> str:
        """Stable identity, e.g. ``cpu:0``, ``cuda:0``, ``cpu:0/lane1``."""
        ...

    @property
    def kind(self) -> DeviceKind:
        """Backend family."""
        ...

    @property
    def torch_device(self) -> torch.device:
        """Where a family's torch ops run."""
        ...

    @property
    def parent(self) -> Device | None:
        """The device this lane was split from; None for a root device."""
        ...

    @property
    def capturing(self) -> bool:
        """True while ``capture_trace`` is running the program."""
        ...

    def lanes(self, n: int) -> tuple[Device, ...]:
        """Split into ``n`` lane sub-devices with distinct ids and their own traces and events."""
        ...

    def allocate(
        self, *, shape: Sequence[int], dtype: torch.dtype, dim_order: Sequence[int] | None = None
    ) -> DeviceTensor:
        """A zero-filled device tensor of ``shape`` owned by the caller.

        A backend may commit the memory as it is written (``TorchDevice`` on CPU maps fresh
        zero pages), so a KV pool sized for its ceiling costs what its used blocks hold.

        ``dim_order`` lists the dimensions from outermost to innermost in memory (None:
        row-major); a backend with fixed layouts rejects any other order.
        """
        ...

    def upload(self, host: torch.Tensor) -> DeviceTensor:
        """A new device tensor holding a copy of ``host``, owned by the caller."""
        ...

    def refresh(self, dst: DeviceTensor, host: torch.Tensor) -> None:
        """Overwrite ``dst`` in place from ``host`` (ttnn ``copy_host_to_device_tensor``)."""
        ...

    def deallocate(self, tensor: DeviceTensor) -> None:
        """Free a device tensor; a second deallocation of the same tensor raises."""
        ...

    def read(self, tensor: DeviceTensor, *, blocking: bool) -> torch.Tensor:
        """Host copy; non-blocking: valid only after a later ``record_event`` is synchronized."""
        ...

    def record_event(self) -> Event:
        """Mark the current end of the device queue."""
        ...

    def event_synchronize(self, event: Event) -> None:
        """Wait until everything queued before ``event`` (non-blocking reads included) is done."""
        ...

    def synchronize(self) -> None:
        """Wait until all queued work, including pending reads, is done."""
        ...

    def capture_trace(self, program: Callable[[], T]) -> Trace[T]:
        """Run ``program`` once in capture mode and keep it as a replayable trace.

        On return ``trace.outputs`` hold one run's result on the torch backends (CUDA replays
        the recorded graph once, so in stream order: ``read`` waits for it); ttnn records
        without running, so replay before reading."""
        ...

    def execute_trace(self, trace: Trace[Any], *, blocking: bool = False) -> None:
        """Replay ``trace``, rewriting ``trace.outputs`` in place."""
        ...

    def release_trace(self, trace: Trace[Any]) -> None:
        """Free ``trace``; idempotent; replaying it afterwards raises ``TraceStateError``."""
        ...

    def stats(self) -> DeviceStats:
        """Live-resource counters of this device (lanes count their own)."""
        ...
