"""``FaultyDevice``: a device-port wrapper that fails chosen calls, for cleanup and fault tests."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import attrs
import torch

from llmrt.device.base import Device, DeviceKind, DeviceStats, Event, Trace
from llmrt.errors import ConfigError, DeviceError

T = TypeVar("T")

OPERATIONS = frozenset(
    {
        "lanes",
        "allocate",
        "upload",
        "refresh",
        "deallocate",
        "read",
        "record_event",
        "event_synchronize",
        "synchronize",
        "capture_trace",
        "execute_trace",
        "release_trace",
        "close",
    }
)
"""The port operations a ``FaultyDevice`` counts and can fail."""


class InjectedFault(DeviceError):
    """The failure a ``FaultyDevice`` was told to inject; nothing was delegated."""

    def __init__(self, *, op: str, call_number: int, device_id: str) -> None:
        self.op = op
        self.call_number = call_number
        self.device_id = device_id
        super().__init__(f"injected fault: {op} call #{call_number} on {device_id}")


class DeviceCall(NamedTuple):
    """One recorded port call; ``subject_id`` is ``id()`` of the tensor/trace/event it acted on."""

    op: str
    summary: str
    subject_id: int | None
    device_id: str
    injected: bool


@attrs.define
class _FaultPlan:
    """Call counters and the call log, shared by a wrapper and its lane wrappers."""

    failing: dict[str, frozenset[int]]
    interrupting: dict[str, frozenset[int]] = attrs.Factory(dict)
    counts: dict[str, int] = attrs.Factory(dict)
    calls: list[DeviceCall] = attrs.Factory(list)


class FaultyDevice:
    """Implements the port over a borrowed ``inner`` device, failing the Nth call of an op.

    ``fail`` maps an operation name to the 1-based call number(s) that raise ``InjectedFault``
    instead of delegating, e.g. ``{"deallocate": 2, "release_trace": [1, 3]}``; ``interrupt``
    does the same with ``KeyboardInterrupt`` (a Ctrl-C arriving inside the call). Calls are
    counted per operation across this wrapper and its lanes; every call is logged in ``calls``.
    Lane wrappers are of the wrapper's own class (a subclass keeps its behaviour on lanes).
    ``close`` closes the inner device where it has a ``close`` (a ttnn mesh it opened).
    """

    def __init__(
        self,
        inner: Device,
        *,
        fail: Mapping[str, int | Iterable[int]],
        interrupt: Mapping[str, int | Iterable[int]] | None = None,
    ) -> None:
        self._inner = inner
        self._plan = _FaultPlan(
            failing=_resolve_fail(fail), interrupting=_resolve_fail(interrupt or {})
        )
        self._parent: FaultyDevice | None = None
        self._lanes: tuple[FaultyDevice, ...] | None = None

    def _lane(self, inner: Device) -> FaultyDevice:
        """A lane wrapper of this wrapper's class, sharing its plan (no ``__init__`` call, so
        a subclass with its own signature works too)."""
        lane = object.__new__(type(self))
        lane.__dict__.update(self.__dict__)
        lane._inner = inner
        lane._parent = self
        lane._lanes = None
        return lane

    def __repr__(self) -> str:
        return f"FaultyDevice({self._inner!r})"

    @property
    def inner(self) -> Device:
        """The wrapped device (borrowed)."""
        return self._inner

    @property
    def calls(self) -> tuple[DeviceCall, ...]:
        """Every port call so far, in order, including injected failures."""
        return tuple(self._plan.calls)

    def calls_of(self, op: str, *, subject: object | None = None) -> tuple[DeviceCall, ...]:
        """Calls of ``op``, optionally only those acting on ``subject`` (by identity)."""
        return tuple(
            c
            for c in self._plan.calls
            if c.op == op and (subject is None or c.subject_id == id(subject))
        )

    def _call(self, op: str, subject: object | None, fn: Callable[[], T]) -> T:
        number = self._plan.counts.get(op, 0) + 1
        self._plan.counts[op] = number
        injected = number in self._plan.failing.get(op, frozenset())
        interrupted = number in self._plan.interrupting.get(op, frozenset())
        self._plan.calls.append(
            DeviceCall(
                op=op,
                summary=_summarize(subject),
                subject_id=None if subject is None else id(subject),
                device_id=self._inner.id,
                injected=injected or interrupted,
            )
        )
        if interrupted:
            raise KeyboardInterrupt(f"injected interrupt: {op} call #{number} on {self._inner.id}")
        if injected:
            raise InjectedFault(op=op, call_number=number, device_id=self._inner.id)
        return fn()

    @property
    def id(self) -> str:
        return self._inner.id

    @property
    def kind(self) -> DeviceKind:
        return self._inner.kind

    @property
    def torch_device(self) -> torch.device:
        return self._inner.torch_device

    @property
    def parent(self) -> Device | None:
        return self._parent

    @property
    def capturing(self) -> bool:
        return self._inner.capturing

    def lanes(self, n: int) -> tuple[Device, ...]:
        inner_lanes = self._call("lanes", None, lambda: self._inner.lanes(n))
        lanes = self._lanes
        if (
            lanes is None
            or len(lanes) != len(inner_lanes)
            or any(w.inner is not i for w, i in zip(lanes, inner_lanes, strict=True))
        ):
            lanes = tuple(self._lane(lane) for lane in inner_lanes)
            self._lanes = lanes
        return lanes

    def allocate(
        self, *, shape: Sequence[int], dtype: torch.dtype, dim_order: Sequence[int] | None = None
    ) -> torch.Tensor:
        return self._call(
            "allocate",
            None,
            lambda: self._inner.allocate(shape=shape, dtype=dtype, dim_order=dim_order),
        )

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        return self._call("upload", host, lambda: self._inner.upload(host))

    def refresh(self, dst: torch.Tensor, host: torch.Tensor) -> None:
        self._call("refresh", dst, lambda: self._inner.refresh(dst=dst, host=host))

    def deallocate(self, tensor: torch.Tensor) -> None:
        self._call("deallocate", tensor, lambda: self._inner.deallocate(tensor))

    def read(self, tensor: torch.Tensor, *, blocking: bool) -> torch.Tensor:
        return self._call("read", tensor, lambda: self._inner.read(tensor, blocking=blocking))

    def record_event(self) -> Event:
        return self._call("record_event", None, self._inner.record_event)

    def event_synchronize(self, event: Event) -> None:
        self._call("event_synchronize", event, lambda: self._inner.event_synchronize(event))

    def synchronize(self) -> None:
        self._call("synchronize", None, self._inner.synchronize)

    def capture_trace(self, program: Callable[[], T]) -> Trace[T]:
        return self._call("capture_trace", None, lambda: self._inner.capture_trace(program))

    def execute_trace(self, trace: Trace[Any], *, blocking: bool = False) -> None:
        self._call(
            "execute_trace", trace, lambda: self._inner.execute_trace(trace, blocking=blocking)
        )

    def release_trace(self, trace: Trace[Any]) -> None:
        self._call("release_trace", trace, lambda: self._inner.release_trace(trace))

    def close(self) -> None:
        """Close the inner device where it can be closed (idempotent there)."""
        closer = getattr(self._inner, "close", None)
        self._call("close", None, closer if callable(closer) else _nothing)

    def stats(self) -> DeviceStats:
        return self._inner.stats()


def _nothing() -> None:
    return None


def _resolve_fail(fail: Mapping[str, int | Iterable[int]]) -> dict[str, frozenset[int]]:
    resolved: dict[str, frozenset[int]] = {}
    for op, numbers in fail.items():
        if op not in OPERATIONS:
            raise ConfigError(f"fail.{op}", op, f"is not a port operation ({sorted(OPERATIONS)})")
        wanted = (numbers,) if isinstance(numbers, int) else tuple(numbers)
        for n in wanted:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError(f"fail.{op}", n, "call numbers are integers >= 1")
        resolved[op] = frozenset(wanted)
    return resolved


def _summarize(subject: object | None) -> str:
    if subject is None:
        return ""
    if isinstance(subject, torch.Tensor):
        dtype = str(subject.dtype).removeprefix("torch.")
        return f"tensor(shape={tuple(subject.shape)}, dtype={dtype})@{id(subject):#x}"
    trace_id = getattr(subject, "trace_id", None)
    if trace_id is not None:
        return f"trace {trace_id}"
    return repr(subject)
