"""``TorchDevice``: the device port on a torch CPU or CUDA device.

CPU: a trace keeps the captured program and its output tensors; a replay re-runs the
program and copies the results into those same output tensors, so only tensors refreshed in
place change what a replay sees (re-binding a Python name to a new tensor does not reach a
captured closure). A non-blocking read fills its host tensor with a poison value and copies a
snapshot in only when a later event is synchronized, so a read consumed too early is visibly
wrong in tests.

CUDA: a trace is a ``torch.cuda.CUDAGraph`` captured on a per-device side stream into a
per-device memory pool after eager warm-up runs; events are ``torch.cuda.Event``; non-blocking
reads copy into pinned host memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import attrs
import torch

from llmrt.device.base import (
    Device,
    DeviceKind,
    DeviceStats,
    Event,
    Trace,
    checked_dim_order,
)
from llmrt.device.book import DeviceBook, describe_tensor, poison, require_host
from llmrt.device.huge_pages import advised_mapping
from llmrt.device.identity import IdentitySet
from llmrt.errors import ConfigError, DeviceError, TraceStateError

T = TypeVar("T")


@attrs.frozen(kw_only=True)
class TorchEvent:
    """A queue position of one ``TorchDevice``; ``seq`` orders it against queued reads."""

    device_id: str
    seq: int
    origin: object = attrs.field(eq=False, repr=False)
    cuda_event: Any = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen(kw_only=True)
class TorchTrace(Generic[T]):
    """Handle of a captured trace; the device owns ``outputs`` until the trace is released."""

    trace_id: int
    device_id: str
    outputs: T = attrs.field(eq=False, repr=False)


@attrs.define
class _TraceRecord:
    program: Callable[[], Any]
    handle: TorchTrace[Any]
    graph: Any = None


@attrs.define
class _PendingRead:
    seq: int
    host: torch.Tensor
    source: torch.Tensor


@attrs.define
class _Hardware:
    """State shared by a root device and its lanes: the devices and what was deallocated."""

    torch_device: torch.device
    huge_pages: bool = False
    devices: list[TorchDevice] = attrs.Factory(list)
    deallocated: IdentitySet = attrs.Factory(IdentitySet)


class TorchDevice:
    """The device port on ``torch.device(spec)``; ``spec`` is ``"cpu"`` or ``"cuda[:N]"``.

    ``cuda_warmup_runs`` eager runs precede each CUDA graph capture (torch requires warm-up
    on a side stream), so a CUDA program must tolerate running more than once per capture.
    ``huge_pages`` advises the large CPU tensors it allocates (KV pools) onto transparent
    huge pages (``zeroed_host_tensor``); its lanes share the setting.
    """

    def __init__(
        self, spec: str = "cpu", *, cuda_warmup_runs: int = 1, huge_pages: bool = False
    ) -> None:
        device = _parse_spec(spec)
        if cuda_warmup_runs < 1:
            raise ConfigError("cuda_warmup_runs", cuda_warmup_runs, "must be >= 1")
        kind: DeviceKind = "cuda" if device.type == "cuda" else "cpu"
        index = 0 if device.index is None else device.index
        self._setup(
            device_id=f"{kind}:{index}",
            kind=kind,
            hardware=_Hardware(torch_device=device, huge_pages=huge_pages),
            parent=None,
            cuda_warmup_runs=cuda_warmup_runs,
        )

    def _setup(
        self,
        *,
        device_id: str,
        kind: DeviceKind,
        hardware: _Hardware,
        parent: TorchDevice | None,
        cuda_warmup_runs: int,
    ) -> None:
        self._id = device_id
        self._kind = kind
        self._hw = hardware
        self._parent = parent
        self._warmup_runs = cuda_warmup_runs
        self._lanes: tuple[TorchDevice, ...] | None = None
        self._busy: str | None = None
        self._owned = IdentitySet()
        self._book: DeviceBook[_TraceRecord] = DeviceBook(device_id)
        self._seq = 0
        self._pending: list[_PendingRead] = []
        self._pool: Any = None
        self._side_stream: Any = None
        hardware.devices.append(self)

    def __repr__(self) -> str:
        return f"TorchDevice({self._id!r})"

    # identity

    @property
    def id(self) -> str:
        return self._id

    @property
    def kind(self) -> DeviceKind:
        return self._kind

    @property
    def torch_device(self) -> torch.device:
        return self._hw.torch_device

    @property
    def parent(self) -> Device | None:
        return self._parent

    @property
    def capturing(self) -> bool:
        return self._busy == "capture"

    def lanes(self, n: int) -> tuple[Device, ...]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError("lanes", n, "must be a positive integer")
        if self._parent is not None:
            raise DeviceError(f"lanes: {self._id} is a lane sub-device and cannot be split again")
        if self._lanes is None:
            self._lanes = tuple(self._make_lane(i) for i in range(n))
        elif len(self._lanes) != n:
            raise DeviceError(
                f"lanes: {self._id} is already split into {len(self._lanes)} lanes, asked for {n}"
            )
        return self._lanes

    def _make_lane(self, index: int) -> TorchDevice:
        lane = TorchDevice.__new__(TorchDevice)
        lane._setup(
            device_id=f"{self._id}/lane{index}",
            kind=self._kind,
            hardware=self._hw,
            parent=self,
            cuda_warmup_runs=self._warmup_runs,
        )
        return lane

    # tensors

    def allocate(
        self, *, shape: Sequence[int], dtype: torch.dtype, dim_order: Sequence[int] | None = None
    ) -> torch.Tensor:
        self._require_idle("allocate")
        order = checked_dim_order(shape, dim_order)
        stored = [shape[d] for d in order]
        if self._kind == "cpu":
            storage = zeroed_host_tensor(stored, dtype=dtype, huge_pages=self._hw.huge_pages)
        else:
            storage = torch.zeros(stored, dtype=dtype, device=self.torch_device)
        # The logical view of the storage: dimension d sits at position order.index(d).
        tensor = storage.permute([order.index(d) for d in range(len(order))])
        return self._own(tensor)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        self._require_idle("upload")
        require_host("upload", host)
        tensor = torch.empty(host.shape, dtype=host.dtype, device=self.torch_device)
        tensor.copy_(host.detach())
        return self._own(tensor)

    def refresh(self, dst: torch.Tensor, host: torch.Tensor) -> None:
        self._require_idle("refresh")
        self._require_device_tensor("refresh", dst)
        require_host("refresh", host)
        if dst not in self._owned:
            raise DeviceError(f"refresh: dst {describe_tensor(dst)} {self._owner_of(dst)}")
        if dst.shape != host.shape or dst.dtype != host.dtype:
            raise DeviceError(
                f"refresh: host tensor {describe_tensor(host)} does not match "
                f"device tensor {describe_tensor(dst)}"
            )
        with torch.no_grad():
            dst.copy_(host)

    def deallocate(self, tensor: torch.Tensor) -> None:
        self._require_device_tensor("deallocate", tensor)
        if tensor in self._owned:
            self._owned.discard(tensor)
            self._book.deallocations += 1
        elif any(tensor in other._owned for other in self._hw.devices):
            raise DeviceError(f"deallocate: {describe_tensor(tensor)} {self._owner_of(tensor)}")
        self._hw.deallocated.add(tensor)

    def _owner_of(self, tensor: torch.Tensor) -> str:
        """Why ``tensor`` is not this device's: who owns it instead, if anyone."""
        for other in self._hw.devices:
            if tensor in other._owned:
                return f"is owned by {other.id}, not {self._id}"
        return f"was not allocated by {self._id} (allocate or upload persistent tensors)"

    def _own(self, tensor: torch.Tensor) -> torch.Tensor:
        self._owned.add(tensor)
        self._book.allocations += 1
        return tensor

    # reads and events

    def read(self, tensor: torch.Tensor, *, blocking: bool) -> torch.Tensor:
        self._require_idle("read")
        self._require_device_tensor("read", tensor)
        if blocking:
            return tensor.detach().to("cpu", copy=True)
        self._seq += 1
        if self._kind == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            with torch.cuda.device(self.torch_device):
                host.copy_(tensor.detach(), non_blocking=True)
            self._pending.append(_PendingRead(seq=self._seq, host=host, source=tensor))
            return host
        host = torch.full(tensor.shape, poison(tensor.dtype), dtype=tensor.dtype)
        snapshot = tensor.detach().clone()
        self._pending.append(_PendingRead(seq=self._seq, host=host, source=snapshot))
        return host

    def record_event(self) -> TorchEvent:
        self._require_idle("record_event")
        self._seq += 1
        cuda_event = None
        if self._kind == "cuda":
            cuda_event = torch.cuda.Event()
            cuda_event.record(torch.cuda.current_stream(self.torch_device))
        return TorchEvent(device_id=self._id, seq=self._seq, origin=self, cuda_event=cuda_event)

    def event_synchronize(self, event: Event) -> None:
        self._require_idle("event_synchronize")
        if not isinstance(event, TorchEvent) or event.origin is not self:
            raise DeviceError(f"event_synchronize: event {event!r} was not recorded on {self._id}")
        if event.cuda_event is not None:
            event.cuda_event.synchronize()
        self._complete_reads(before=event.seq)

    def synchronize(self) -> None:
        self._require_idle("synchronize")
        if self._kind == "cuda":
            torch.cuda.synchronize(self.torch_device)
        self._complete_reads(before=self._seq + 1)

    def _complete_reads(self, *, before: int) -> None:
        done = [r for r in self._pending if r.seq < before]
        self._pending = [r for r in self._pending if r.seq >= before]
        if self._kind == "cpu":
            for read in done:
                read.host.copy_(read.source)

    # traces

    def capture_trace(self, program: Callable[[], T]) -> TorchTrace[T]:
        if self._busy is not None:
            raise TraceStateError(
                f"capture_trace: {self._id} is already in trace {self._busy}; "
                f"nested trace capture is not allowed"
            )
        self._busy = "capture"
        try:
            if self._kind == "cuda":
                graph, outputs = self._capture_cuda(program)
                # A CUDA graph records without running: one replay makes the outputs hold the
                # program's result on return, as on the CPU (the port's contract).
                try:
                    with torch.cuda.device(self.torch_device):
                        graph.replay()
                except BaseException:
                    with contextlib.suppress(Exception):
                        graph.reset()  # a failed first replay frees the graph, as a failed capture
                    raise
            else:
                graph, outputs = None, program()
        finally:
            self._busy = None
        handle = TorchTrace(
            trace_id=self._book.next_trace_id(), device_id=self._id, outputs=outputs
        )
        self._book.add_trace(_TraceRecord(program=program, handle=handle, graph=graph))
        return handle

    def execute_trace(self, trace: Trace[Any], *, blocking: bool = False) -> None:
        record = self._trace_record("execute_trace", trace)
        if record is None:
            raise TraceStateError(
                f"execute_trace: trace {trace.trace_id} on {self._id} was released"
            )
        self._busy = "replay"
        try:
            if record.graph is not None:
                with torch.cuda.device(self.torch_device):
                    record.graph.replay()
                    if blocking:
                        torch.cuda.current_stream(self.torch_device).synchronize()
            else:
                _copy_outputs(
                    dst=record.handle.outputs,
                    src=record.program(),
                    where=f"trace {trace.trace_id} outputs",
                )
        finally:
            self._busy = None
        self._book.replays += 1

    def release_trace(self, trace: Trace[Any]) -> None:
        record = self._trace_record("release_trace", trace)
        if record is None:
            return
        if record.graph is not None:
            record.graph.reset()
        self._book.forget_trace(trace.trace_id)

    def _trace_record(self, op: str, trace: Trace[Any]) -> _TraceRecord | None:
        return self._book.trace_record(op, trace, busy=self._busy)

    def _capture_cuda(self, program: Callable[[], T]) -> tuple[Any, T]:
        device = self.torch_device
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._side_stream = torch.cuda.Stream(device=device)
        side = self._side_stream
        graph = torch.cuda.CUDAGraph()
        failure: BaseException | None = None
        # The outer stream context restores the current stream even if capture_end raises.
        with torch.cuda.device(device), torch.cuda.stream(torch.cuda.current_stream(device)):
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(self._warmup_runs):
                    program()
            torch.cuda.current_stream(device).wait_stream(side)
            try:
                with torch.cuda.graph(graph, pool=self._pool, stream=side):
                    try:
                        outputs = program()
                    except BaseException as exc:
                        failure = exc
            except BaseException:
                if failure is None:
                    with contextlib.suppress(Exception):
                        graph.reset()
                    raise
        if failure is not None:
            with contextlib.suppress(Exception):
                graph.reset()
            raise failure
        return graph, outputs

    # accounting and guards

    def stats(self) -> DeviceStats:
        return self._book.stats(pending_reads=len(self._pending))

    @property
    def live_tensor_count(self) -> int:
        """Tensors from ``allocate``/``upload`` not yet deallocated."""
        return self._book.live_tensors

    @property
    def live_trace_count(self) -> int:
        """Captured traces not yet released."""
        return len(self._book.traces)

    def _require_idle(self, op: str) -> None:
        if self._busy is not None:
            raise DeviceError(f"{op}: not allowed on {self._id} during trace {self._busy}")

    def _require_device_tensor(self, op: str, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise DeviceError(f"{op}: expected a device tensor, got {type(tensor).__name__}")
        if tensor.device != self.torch_device:
            raise DeviceError(f"{op}: {describe_tensor(tensor)} is not on {self._id}")
        if tensor in self._hw.deallocated:
            raise DeviceError(f"{op}: {describe_tensor(tensor)} was already deallocated")


#: Host tensors at least this large come from their own anonymous mapping (see below).
LAZY_ZERO_BYTES = 1 << 20


def zeroed_host_tensor(
    shape: Sequence[int], *, dtype: torch.dtype, huge_pages: bool = False
) -> torch.Tensor:
    """A zero-filled CPU tensor whose memory is committed page by page as it is written.

    ``torch.zeros`` writes every byte up front, so a KV pool sized for its ceiling costs its
    full size in time and resident memory before the first token. A private anonymous
    mapping is zero-filled by the kernel on first touch instead: a pool grows in RSS with
    the blocks actually written (and read), and costs nothing to create. Small tensors keep
    ``torch.zeros`` (a mapping per tensor would waste pages). The mapping lives as long as
    the tensor (``torch.frombuffer`` holds a reference) and is unmapped when it is freed.

    ``huge_pages`` advises the mapping onto transparent huge pages: it then commits 2 MiB at a
    time, and a decode step's attention, which reads a few KiB per page and head, crosses far
    fewer TLB entries (SmolLM2 at 1,024 tokens of context: batch-1 step 5.92 -> 5.57 ms,
    in-process A/B; no change at 128).
    """
    numel = 1
    for size in shape:
        numel *= int(size)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    if nbytes < LAZY_ZERO_BYTES:
        return torch.zeros(list(shape), dtype=dtype)
    pages = advised_mapping(nbytes, huge=huge_pages)
    return torch.frombuffer(pages, dtype=dtype, count=numel).view(list(shape))


def _parse_spec(spec: str) -> torch.device:
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError("device", spec, f"is not a torch device spec ({exc})") from exc
    if device.type == "cpu":
        if device.index not in (None, 0):
            raise ConfigError("device", spec, "the cpu backend has one device, cpu:0")
        return torch.device("cpu")
    if device.type != "cuda":
        raise ConfigError("device", spec, "must be 'cpu' or 'cuda[:N]'")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {spec!r}: CUDA is not available on this machine")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise DeviceError(
            f"device {spec!r}: only {torch.cuda.device_count()} CUDA device(s) are visible"
        )
    return torch.device("cuda", index)


def _copy_outputs(*, dst: Any, src: Any, where: str) -> None:
    """Copy a replay's results into the captured outputs in place; non-tensor values stay baked."""
    if isinstance(dst, torch.Tensor):
        if not isinstance(src, torch.Tensor) or src.shape != dst.shape or src.dtype != dst.dtype:
            shown = describe_tensor(src) if isinstance(src, torch.Tensor) else type(src).__name__
            raise DeviceError(f"{where}: replay produced {shown}, capture {describe_tensor(dst)}")
        if src is not dst:
            with torch.no_grad():
                dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        if type(src) is not type(dst) or len(src) != len(dst):
            raise DeviceError(f"{where}: replay produced a different structure than capture")
        for i, (d, s) in enumerate(zip(dst, src, strict=True)):
            _copy_outputs(dst=d, src=s, where=f"{where}[{i}]")
    elif isinstance(dst, Mapping):
        if not isinstance(src, Mapping) or set(src) != set(dst):
            raise DeviceError(f"{where}: replay produced a different structure than capture")
        for key, d in dst.items():
            _copy_outputs(dst=d, src=src[key], where=f"{where}[{key!r}]")
