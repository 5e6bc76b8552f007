"""``TtnnDevice``: the device port on a Tenstorrent mesh through ``ttnn``.

Tensors: ``allocate``/``upload`` stage a host torch tensor (see ``staging_plan``) and call
``ttnn.from_torch(..., device=mesh, mesh_mapper=...)``; ``refresh`` builds a host ttnn tensor
with the same mapper and writes it in place with ``ttnn.copy_host_to_device_tensor``.
Floats go in tile layout (bfloat8_b/bfloat4_b only there), integers in row-major. llmrt holds
token ids as int64 and page tables, positions and update indices as int32, so int64 is staged
as UINT32 (what ``ttnn.embedding`` requires of its ids, and ttnn's own pick for int64; it
travels as an int32 host copy, so values must lie in 0..2**31-1) and int32 as INT32 (page
tables hold -1, which UINT32 would wrap).

Reads: ``Tensor.cpu(blocking=...)`` then ``ttnn.to_torch`` with a concat mesh composer
(replicated tensors keep the first device's copy). A non-blocking read returns a host torch
tensor filled with a poison value; the device's host copy is converted into it when a later
``record_event`` is synchronized (``ttnn.event_synchronize``) or the device is synchronized.

Traces: ``ttnn.begin_trace_capture`` / program / ``ttnn.end_trace_capture``; the program's
outputs are device tensors that ``ttnn.execute_trace`` rewrites in place. A failed capture is
ended and released before the error propagates; a failed ``release_trace`` keeps the trace
live so cleanup can retry it before deallocating the trace's inputs. ttnn needs every op
compiled before capture: the runtime's program compiler runs each program eagerly first
(``capture_warmup_runs`` adds eager runs here for direct use).

Lanes are submeshes (``mesh.create_submeshes``), each with its own traces and events.
``torch_device`` is the host (cpu): it is where staged inputs and read values live.
The ``ttnn`` module is injected (``ttnn_module``) so ``llmrt.testing.fake_ttnn`` can stand in.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Literal, TypeVar, get_args

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
from llmrt.errors import (
    CleanupError,
    ConfigError,
    DeviceError,
    TraceStateError,
    UnsupportedError,
)

T = TypeVar("T")

MeshMapper = Literal["replicate", "shard"]
FloatLayout = Literal["tile", "row_major"]

TTNN_CALLS: Mapping[str, tuple[str, ...]] = {
    "from_torch": ("dtype", "layout", "device", "mesh_mapper", "cq_id"),
    "to_torch": ("mesh_composer",),
    "copy_host_to_device_tensor": ("cq_id",),
    "deallocate": (),
    "record_event": ("cq_id",),
    "event_synchronize": (),
    "synchronize_device": ("cq_id",),
    "begin_trace_capture": ("cq_id",),
    "end_trace_capture": ("cq_id",),
    "execute_trace": ("cq_id", "blocking"),
    "release_trace": (),
    "replicate_tensor_to_mesh_mapper": (),
    "shard_tensor_to_mesh_mapper": (),
    "concat_mesh_to_tensor_composer": (),
    "open_mesh_device": (
        "mesh_shape",
        "l1_small_size",
        "trace_region_size",
        "num_command_queues",
        "dispatch_core_config",
    ),
    "close_mesh_device": (),
    "set_fabric_config": (),
    "DispatchCoreConfig": ("type",),
}
"""Every ``ttnn`` function this backend calls, with the keyword arguments it passes."""

TTNN_METHODS: Mapping[str, tuple[str, ...]] = {
    "Tensor.cpu": ("blocking", "cq_id"),
    "Tensor.is_allocated": (),
    "Tensor.storage_type": (),
    "Tensor.device": (),
    "MeshDevice.create_submeshes": (),
    "MeshDevice.get_num_devices": (),
    "MeshDevice.id": (),
}
"""Tensor and mesh methods this backend calls, with the keyword arguments it passes."""

TTNN_NAMES: tuple[str, ...] = (
    "Tensor",
    "MeshDevice",
    "MeshShape",
    "DataType",
    "Layout",
    "StorageType",
    "FabricConfig",
    "DispatchCoreType",
)
"""Types and enums this backend reads from the ``ttnn`` module."""

DEFAULT_TRACE_REGION_SIZE = 30_000_000
"""Bytes reserved for traces when ``open_ttnn_device`` opens a mesh (ttnn's default is 0)."""

DispatchCoreType = Literal["worker", "eth"]
"""``dispatch_core_type`` values: ttnn ``DispatchCoreType`` members, lower-cased."""
DISPATCH_CORE_TYPES: tuple[str, ...] = get_args(DispatchCoreType)

FabricConfigName = Literal[
    "disabled",
    "fabric_1d",
    "fabric_1d_ring",
    "fabric_1d_neighbor_exchange",
    "fabric_2d",
    "fabric_2d_torus_x",
    "fabric_2d_torus_y",
    "fabric_2d_torus_xy",
]
"""``fabric_config`` values: ttnn ``FabricConfig`` members, lower-cased."""
FABRIC_CONFIGS: tuple[str, ...] = get_args(FabricConfigName)

BLOCK_FLOATS = frozenset({"BFLOAT8_B", "BFLOAT4_B"})
_FLOAT_NAMES = frozenset({"FLOAT32", "BFLOAT16", *BLOCK_FLOATS})
_STAGED_RANGE: dict[str, tuple[int, int]] = {
    "INT32": (-(2**31), 2**31 - 1),
    "UINT32": (0, 2**31 - 1),  # staged from an int32 host copy
}
_STAGED: dict[torch.dtype, tuple[torch.dtype, str]] = {
    torch.float32: (torch.float32, "FLOAT32"),
    torch.bfloat16: (torch.bfloat16, "BFLOAT16"),
    torch.float16: (torch.float32, "FLOAT32"),
    torch.int64: (torch.int32, "UINT32"),
    torch.int32: (torch.int32, "INT32"),
    torch.int16: (torch.int32, "INT32"),
    torch.int8: (torch.int32, "INT32"),
    torch.uint8: (torch.uint8, "UINT8"),
    torch.bool: (torch.uint8, "UINT8"),
}
_HOST_OF_TT: dict[str, torch.dtype] = {
    "FLOAT32": torch.float32,
    "BFLOAT16": torch.bfloat16,
    "BFLOAT8_B": torch.float32,
    "BFLOAT4_B": torch.float32,
    "INT32": torch.int32,
    "UINT32": torch.int64,
    "UINT16": torch.int32,
    "UINT8": torch.uint8,
    "INT8": torch.int8,
}


@attrs.frozen(kw_only=True)
class StagingPlan:
    """How one host torch dtype travels to the device and back.

    ``staged_dtype`` is what ``from_torch`` receives, ``tt_dtype``/``layout`` the ttnn
    ``DataType``/``Layout`` member names, ``host_dtype`` what reads return.
    """

    host_dtype: torch.dtype
    staged_dtype: torch.dtype
    tt_dtype: str
    layout: Literal["ROW_MAJOR", "TILE"]

    def ttnn_dtype(self, tt: Any) -> Any:
        """The ``ttnn.DataType`` member in module ``tt``."""
        return getattr(tt.DataType, self.tt_dtype)

    def ttnn_layout(self, tt: Any) -> Any:
        """The ``ttnn.Layout`` member in module ``tt``."""
        return getattr(tt.Layout, self.layout)


def staging_plan(
    dtype: torch.dtype,
    *,
    float_layout: FloatLayout = "tile",
    float_dtypes: Mapping[torch.dtype, str] | None = None,
) -> StagingPlan:
    """The staging of ``dtype``; ``float_dtypes`` maps float dtypes to a ttnn float dtype name."""
    override = (float_dtypes or {}).get(dtype)
    if override is not None:
        if not dtype.is_floating_point or override.upper() not in _FLOAT_NAMES:
            raise ConfigError(
                f"float_dtypes[{dtype}]",
                override,
                f"must map a float dtype to {sorted(_FLOAT_NAMES)}",
            )
        name = override.upper()
        staged = torch.float32 if name in BLOCK_FLOATS else _STAGED.get(dtype, (dtype, ""))[0]
        layout: Literal["ROW_MAJOR", "TILE"] = (
            "TILE" if float_layout == "tile" or name in BLOCK_FLOATS else "ROW_MAJOR"
        )
        return StagingPlan(host_dtype=dtype, staged_dtype=staged, tt_dtype=name, layout=layout)
    entry = _STAGED.get(dtype)
    if entry is None:
        raise DeviceError(f"no ttnn staging for torch dtype {dtype} (supported: {_supported()})")
    staged, name = entry
    layout = "TILE" if dtype.is_floating_point and float_layout == "tile" else "ROW_MAJOR"
    return StagingPlan(host_dtype=dtype, staged_dtype=staged, tt_dtype=name, layout=layout)


def stage(host: torch.Tensor, plan: StagingPlan) -> torch.Tensor:
    """``host`` converted to ``plan.staged_dtype``; values outside the ttnn dtype raise."""
    bounds = _STAGED_RANGE.get(plan.tt_dtype)
    if bounds is not None and host.dtype == torch.int64 and host.numel():
        low, high = int(host.min()), int(host.max())
        if low < bounds[0] or high > bounds[1]:
            raise DeviceError(
                f"int64 tensor {describe_tensor(host)} holds {low}..{high}, outside "
                f"{bounds[0]}..{bounds[1]}; ttnn stages int64 (token ids) as uint32 and int32 "
                f"(page tables, positions) as int32"
            )
    return host.detach().to(plan.staged_dtype).contiguous()


def unstage(value: torch.Tensor, plan: StagingPlan) -> torch.Tensor:
    """A value read back from the device, in ``plan.host_dtype``."""
    if value.dtype in (torch.uint32, torch.uint16):
        value = value.to(torch.int64)
    return value.to(plan.host_dtype)


@attrs.frozen(kw_only=True)
class TtnnEvent:
    """A queue position of one ``TtnnDevice``; ``seq`` orders it against queued reads."""

    device_id: str
    seq: int
    origin: object = attrs.field(eq=False, repr=False)
    mesh_event: Any = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class TtnnTrace(Generic[T]):
    """Handle of a captured trace; the device owns ``outputs`` until the trace is released."""

    trace_id: int
    device_id: str
    outputs: T = attrs.field(eq=False, repr=False)


@attrs.define
class _TraceRecord:
    handle: TtnnTrace[Any]
    tt_trace_id: Any


@attrs.define
class _Owned:
    tensor: Any
    plan: StagingPlan
    shape: tuple[int, ...]


@attrs.define
class _PendingRead:
    seq: int
    host: torch.Tensor
    source: Any
    plan: StagingPlan
    shape: tuple[int, ...]


@attrs.define
class _Hardware:
    """State shared by a root device and its lanes."""

    devices: list[TtnnDevice] = attrs.Factory(list)


class TtnnDevice:
    """The device port on a borrowed ttnn ``mesh_device`` (owned when ``open_ttnn_device`` made it).

    ``mesh_mapper`` places uploads: ``"replicate"`` copies each tensor to every device of the
    mesh, ``"shard"`` splits it along ``shard_dim``. ``float_layout`` and ``float_dtypes``
    choose how float tensors are stored (e.g. ``{torch.bfloat16: "bfloat8_b"}``).
    """

    def __init__(
        self,
        mesh_device: Any,
        *,
        ttnn_module: Any | None = None,
        mesh_mapper: MeshMapper = "replicate",
        shard_dim: int = 0,
        float_layout: FloatLayout = "tile",
        float_dtypes: Mapping[torch.dtype, str] | None = None,
        cq_id: int = 0,
        capture_warmup_runs: int = 0,
        device_id: str | None = None,
        owns_mesh: bool = False,
        owns_fabric: bool = False,
    ) -> None:
        tt = import_ttnn() if ttnn_module is None else ttnn_module
        if mesh_mapper not in ("replicate", "shard"):
            raise ConfigError("device.mesh_mapper", mesh_mapper, "must be 'replicate' or 'shard'")
        if float_layout not in ("tile", "row_major"):
            raise ConfigError("device.float_layout", float_layout, "must be 'tile' or 'row_major'")
        for name, value in (("cq_id", cq_id), ("capture_warmup_runs", capture_warmup_runs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"device.{name}", value, "must be an integer >= 0")
        if isinstance(shard_dim, bool) or not isinstance(shard_dim, int):
            raise ConfigError("device.shard_dim", shard_dim, "must be an integer")
        for dtype in float_dtypes or {}:
            staging_plan(dtype, float_layout=float_layout, float_dtypes=float_dtypes)
        self._setup(
            tt=tt,
            mesh=mesh_device,
            device_id=f"ttnn:{mesh_device.id()}" if device_id is None else device_id,
            hardware=_Hardware(),
            parent=None,
            options=_Options(
                mesh_mapper=mesh_mapper,
                shard_dim=shard_dim,
                float_layout=float_layout,
                float_dtypes=dict(float_dtypes or {}),
                cq_id=cq_id,
                capture_warmup_runs=capture_warmup_runs,
            ),
            owns_mesh=owns_mesh,
        )
        self._owns_fabric = owns_fabric

    def _setup(
        self,
        *,
        tt: Any,
        mesh: Any,
        device_id: str,
        hardware: _Hardware,
        parent: TtnnDevice | None,
        options: _Options,
        owns_mesh: bool,
    ) -> None:
        self._tt = tt
        self._mesh = mesh
        self._id = device_id
        self._hw = hardware
        self._parent = parent
        self._options = options
        self._owns_mesh = owns_mesh
        self._owns_fabric = False
        self._closed = False
        self._num_devices = int(mesh.get_num_devices())
        self._lanes: tuple[TtnnDevice, ...] | None = None
        self._busy: str | None = None
        self._owned: dict[int, _Owned] = {}
        self._book: DeviceBook[_TraceRecord] = DeviceBook(device_id)
        self._seq = 0
        self._pending: list[_PendingRead] = []
        self._mapper: Any = None
        self._composer: Any = None
        hardware.devices.append(self)

    def __repr__(self) -> str:
        return f"TtnnDevice({self._id!r})"

    # identity

    @property
    def id(self) -> str:
        return self._id

    @property
    def kind(self) -> DeviceKind:
        return "ttnn"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def parent(self) -> Device | None:
        return self._parent

    @property
    def capturing(self) -> bool:
        return self._busy == "capture"

    @property
    def mesh_device(self) -> Any:
        """The ttnn mesh (or submesh) this device drives (borrowed unless opened here)."""
        return self._mesh

    @property
    def ttnn_module(self) -> Any:
        """The ``ttnn`` module (or a stand-in) this device calls; a TT family builds with it."""
        return self._tt

    @property
    def num_devices(self) -> int:
        """Chips in this device's mesh."""
        return self._num_devices

    def lanes(self, n: int) -> tuple[Device, ...]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError("lanes", n, "must be a positive integer")
        if self._parent is not None:
            raise DeviceError(f"lanes: {self._id} is a lane sub-device and cannot be split again")
        if self._lanes is not None:
            if len(self._lanes) != n:
                raise DeviceError(
                    f"lanes: {self._id} is already split into {len(self._lanes)} lanes, "
                    f"asked for {n}"
                )
            return self._lanes
        shape = _submesh_shape(tuple(int(d) for d in self._mesh.shape), n)
        submeshes = self._call(
            "lanes",
            "MeshDevice.create_submeshes",
            lambda: self._mesh.create_submeshes(self._tt.MeshShape(*shape)),
        )
        if len(submeshes) != n:
            raise DeviceError(f"lanes: create_submeshes gave {len(submeshes)} submeshes, not {n}")
        self._lanes = tuple(self._make_lane(i, mesh) for i, mesh in enumerate(submeshes))
        return self._lanes

    def _make_lane(self, index: int, mesh: Any) -> TtnnDevice:
        lane = TtnnDevice.__new__(TtnnDevice)
        lane._setup(
            tt=self._tt,
            mesh=mesh,
            device_id=f"{self._id}/lane{index}",
            hardware=self._hw,
            parent=self,
            options=self._options,
            owns_mesh=False,
        )
        return lane

    # tensors

    def allocate(
        self, *, shape: Sequence[int], dtype: torch.dtype, dim_order: Sequence[int] | None = None
    ) -> Any:
        self._require_idle("allocate")
        if checked_dim_order(shape, dim_order) != tuple(range(len(shape))):
            raise UnsupportedError(
                f"allocate: dim_order {tuple(dim_order or ())}: ttnn tensors are row-major "
                "(their tile layout is ttnn's)"
            )
        return self._put("allocate", torch.zeros(tuple(shape), dtype=dtype))

    def upload(self, host: torch.Tensor) -> Any:
        self._require_idle("upload")
        require_host("upload", host)
        return self._put("upload", host)

    def _put(self, op: str, host: torch.Tensor) -> Any:
        plan = self._plan(op, host.dtype)
        staged = self._stage(op, host, plan)
        tensor = self._call(
            op,
            "from_torch",
            lambda: self._tt.from_torch(
                staged,
                dtype=plan.ttnn_dtype(self._tt),
                layout=plan.ttnn_layout(self._tt),
                device=self._mesh,
                mesh_mapper=self._mesh_mapper(),
                cq_id=self._options.cq_id,
            ),
        )
        self._owned[id(tensor)] = _Owned(tensor=tensor, plan=plan, shape=tuple(host.shape))
        self._book.allocations += 1
        return tensor

    def refresh(self, dst: Any, host: torch.Tensor) -> None:
        self._require_idle("refresh")
        self._require_device_tensor("refresh", dst)
        require_host("refresh", host)
        owned = self._owned_record(dst)
        if owned is None:
            raise DeviceError(f"refresh: dst {self._describe(dst)} {self._owner_of(dst)}")
        if tuple(host.shape) != owned.shape or host.dtype != owned.plan.host_dtype:
            raise DeviceError(
                f"refresh: host tensor {describe_tensor(host)} does not match "
                f"device tensor {self._describe(dst)}"
            )
        staged = self._stage("refresh", host, owned.plan)
        source = self._call(
            "refresh",
            "from_torch",
            lambda: self._tt.from_torch(
                staged,
                dtype=owned.plan.ttnn_dtype(self._tt),
                layout=owned.plan.ttnn_layout(self._tt),
                mesh_mapper=self._mesh_mapper(),
            ),
        )
        self._call(
            "refresh",
            "copy_host_to_device_tensor",
            lambda: self._tt.copy_host_to_device_tensor(source, dst, cq_id=self._options.cq_id),
        )

    def deallocate(self, tensor: Any) -> None:
        self._require_device_tensor("deallocate", tensor)
        owned = self._owned_record(tensor)
        if owned is None and self._owner(tensor) is not None:
            raise DeviceError(f"deallocate: {self._describe(tensor)} {self._owner_of(tensor)}")
        if owned is not None and self.capturing:
            raise DeviceError(
                f"deallocate: {self._describe(tensor)} is a persistent tensor; "
                f"not allowed on {self._id} during trace capture"
            )
        self._call("deallocate", "deallocate", lambda: self._tt.deallocate(tensor))
        if owned is not None:
            del self._owned[id(tensor)]
            self._book.deallocations += 1

    # reads and events

    def read(self, tensor: Any, *, blocking: bool) -> torch.Tensor:
        self._require_idle("read")
        self._require_device_tensor("read", tensor)
        plan, shape = self._read_plan(tensor)
        source = self._call(
            "read",
            "Tensor.cpu",
            lambda: tensor.cpu(blocking=blocking, cq_id=self._options.cq_id),
        )
        if blocking:
            return self._host_value(source, plan=plan, shape=shape)
        self._seq += 1
        host = torch.full(shape, poison(plan.host_dtype), dtype=plan.host_dtype)
        self._pending.append(
            _PendingRead(seq=self._seq, host=host, source=source, plan=plan, shape=shape)
        )
        return host

    def record_event(self) -> TtnnEvent:
        self._require_idle("record_event")
        mesh_event = self._call(
            "record_event",
            "record_event",
            lambda: self._tt.record_event(self._mesh, cq_id=self._options.cq_id),
        )
        self._seq += 1
        return TtnnEvent(device_id=self._id, seq=self._seq, origin=self, mesh_event=mesh_event)

    def event_synchronize(self, event: Event) -> None:
        self._require_idle("event_synchronize")
        if not isinstance(event, TtnnEvent) or event.origin is not self:
            raise DeviceError(f"event_synchronize: event {event!r} was not recorded on {self._id}")
        self._call(
            "event_synchronize",
            "event_synchronize",
            lambda: self._tt.event_synchronize(event.mesh_event),
        )
        self._complete_reads(before=event.seq)

    def synchronize(self) -> None:
        self._require_idle("synchronize")
        self._call(
            "synchronize",
            "synchronize_device",
            lambda: self._tt.synchronize_device(self._mesh, cq_id=self._options.cq_id),
        )
        self._complete_reads(before=self._seq + 1)

    def _complete_reads(self, *, before: int) -> None:
        while self._pending and self._pending[0].seq < before:
            read = self._pending[0]
            value = self._host_value(read.source, plan=read.plan, shape=read.shape)
            read.host.copy_(value)
            self._pending.pop(0)

    def _host_value(
        self, source: Any, *, plan: StagingPlan, shape: tuple[int, ...]
    ) -> torch.Tensor:
        value = self._call(
            "read",
            "to_torch",
            lambda: self._tt.to_torch(source, mesh_composer=self._mesh_composer()),
        )
        if self._options.mesh_mapper == "replicate" and self._num_devices > 1:
            value = value.reshape(self._num_devices, *shape)[0]
        if tuple(value.shape) != shape:
            raise DeviceError(
                f"read: ttnn returned shape {tuple(value.shape)} for a tensor of shape {shape} "
                f"on {self._id}"
            )
        return unstage(value, plan)

    # traces

    def capture_trace(self, program: Callable[[], T]) -> TtnnTrace[T]:
        if self._busy is not None:
            raise TraceStateError(
                f"capture_trace: {self._id} is already in trace {self._busy}; "
                f"nested trace capture is not allowed"
            )
        for _ in range(self._options.capture_warmup_runs):
            program()
        cq = self._options.cq_id
        self._busy = "capture"
        try:
            tt_trace_id = self._call(
                "capture_trace",
                "begin_trace_capture",
                lambda: self._tt.begin_trace_capture(self._mesh, cq_id=cq),
            )
            try:
                outputs = program()
            except BaseException as exc:
                self._abort_capture(tt_trace_id, primary=exc)
                raise
            try:
                self._tt.end_trace_capture(self._mesh, tt_trace_id, cq_id=cq)
            except Exception as exc:
                error = DeviceError(
                    f"capture_trace: ttnn.end_trace_capture failed on {self._id}: "
                    f"{type(exc).__name__}: {_first_line(exc)}"
                )
                self._abort_capture(tt_trace_id, primary=error)
                raise error from exc
        finally:
            self._busy = None
        handle = TtnnTrace(trace_id=self._book.next_trace_id(), device_id=self._id, outputs=outputs)
        self._book.add_trace(_TraceRecord(handle=handle, tt_trace_id=tt_trace_id))
        return handle

    def _abort_capture(self, tt_trace_id: Any, *, primary: BaseException) -> None:
        """End and release a failed capture; cleanup failures join ``primary``.

        ``end_trace_capture`` is (re)tried first: ttnn cannot release a trace still capturing.
        """
        failures: list[tuple[str, BaseException]] = []
        ended: BaseException | None = None
        try:
            self._tt.end_trace_capture(self._mesh, tt_trace_id, cq_id=self._options.cq_id)
        except Exception as exc:
            ended = exc
        try:
            self._tt.release_trace(self._mesh, tt_trace_id)
        except Exception as exc:
            # The retried end only matters when the trace could not be released either (a
            # failed end_trace_capture may have ended the capture before it threw).
            if ended is not None:
                failures.append(("end_trace_capture", ended))
            failures.append(("release_trace", exc))
        if failures:
            raise CleanupError(failures, primary=primary) from primary

    def execute_trace(self, trace: Trace[Any], *, blocking: bool = False) -> None:
        record = self._trace_record("execute_trace", trace)
        if record is None:
            raise TraceStateError(
                f"execute_trace: trace {trace.trace_id} on {self._id} was released"
            )
        self._call(
            "execute_trace",
            "execute_trace",
            lambda: self._tt.execute_trace(
                self._mesh, record.tt_trace_id, cq_id=self._options.cq_id, blocking=blocking
            ),
        )
        self._book.replays += 1

    def release_trace(self, trace: Trace[Any]) -> None:
        record = self._trace_record("release_trace", trace)
        if record is None:
            return
        self._call(
            "release_trace",
            "release_trace",
            lambda: self._tt.release_trace(self._mesh, record.tt_trace_id),
        )
        self._book.forget_trace(trace.trace_id)

    def _trace_record(self, op: str, trace: Trace[Any]) -> _TraceRecord | None:
        return self._book.trace_record(op, trace, busy=self._busy)

    # accounting, lifetime and guards

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

    def close(self) -> None:
        """Release live traces (lanes first) and close the mesh if this device opened it.

        Idempotent; every failure is kept in one ``CleanupError``.
        """
        if self._closed:
            return
        failures: list[tuple[str, BaseException]] = []
        for lane in self._lanes or ():
            try:
                lane.close()
            except CleanupError as exc:
                failures.extend(exc.failures)
        for record in list(self._book.traces.values()):
            try:
                self.release_trace(record.handle)
            except Exception as exc:
                failures.append((f"release_trace {record.handle.trace_id} on {self._id}", exc))
        if self._owns_mesh and not failures:
            try:
                self._tt.close_mesh_device(self._mesh)
            except Exception as exc:
                failures.append((f"close_mesh_device {self._id}", exc))
        if self._owns_fabric and not failures:
            try:
                self._tt.set_fabric_config(self._tt.FabricConfig.DISABLED)
            except Exception as exc:
                failures.append((f"set_fabric_config DISABLED after {self._id}", exc))
        if failures:
            raise CleanupError(failures)
        self._closed = True

    def _call(self, op: str, name: str, fn: Callable[[], T]) -> T:
        """Run one ttnn call; its failure becomes a ``DeviceError`` naming op, call and device."""
        try:
            return fn()
        except DeviceError:
            raise
        except Exception as exc:
            raise DeviceError(
                f"{op}: ttnn.{name} failed on {self._id}: {type(exc).__name__}: {_first_line(exc)}"
            ) from exc

    def _plan(self, op: str, dtype: torch.dtype) -> StagingPlan:
        try:
            return staging_plan(
                dtype,
                float_layout=self._options.float_layout,
                float_dtypes=self._options.float_dtypes,
            )
        except DeviceError as exc:
            raise DeviceError(f"{op}: {exc}") from None

    def _stage(self, op: str, host: torch.Tensor, plan: StagingPlan) -> torch.Tensor:
        try:
            return stage(host, plan)
        except DeviceError as exc:
            raise DeviceError(f"{op}: {exc}") from None

    def _mesh_mapper(self) -> Any:
        if self._mapper is None:
            if self._options.mesh_mapper == "shard":
                self._mapper = self._tt.shard_tensor_to_mesh_mapper(
                    self._mesh, self._options.shard_dim
                )
            else:
                self._mapper = self._tt.replicate_tensor_to_mesh_mapper(self._mesh)
        return self._mapper

    def _mesh_composer(self) -> Any:
        if self._num_devices == 1:
            return None
        if self._composer is None:
            dim = self._options.shard_dim if self._options.mesh_mapper == "shard" else 0
            self._composer = self._tt.concat_mesh_to_tensor_composer(self._mesh, dim)
        return self._composer

    def _read_plan(self, tensor: Any) -> tuple[StagingPlan, tuple[int, ...]]:
        """How to read ``tensor``: its upload plan, or one derived from its ttnn dtype."""
        owned = self._owned_record(tensor)
        if owned is not None:
            return owned.plan, owned.shape
        name = _enum_name(tensor.dtype)
        host_dtype = _HOST_OF_TT.get(name)
        if host_dtype is None:
            raise DeviceError(f"read: no host dtype for ttnn {name} ({self._describe(tensor)})")
        shape = [int(d) for d in tensor.shape]
        if self._options.mesh_mapper == "shard" and shape:
            shape[self._options.shard_dim] *= self._num_devices
        plan = StagingPlan(
            host_dtype=host_dtype,
            staged_dtype=host_dtype,
            tt_dtype=name,
            layout="TILE" if _enum_name(tensor.layout) == "TILE" else "ROW_MAJOR",
        )
        return plan, tuple(shape)

    def _owned_record(self, tensor: Any) -> _Owned | None:
        record = self._owned.get(id(tensor))
        return record if record is not None and record.tensor is tensor else None

    def _owner(self, tensor: Any) -> TtnnDevice | None:
        for device in self._hw.devices:
            if device._owned_record(tensor) is not None:
                return device
        return None

    def _owner_of(self, tensor: Any) -> str:
        """Why ``tensor`` is not this device's: who owns it instead, if anyone."""
        owner = self._owner(tensor)
        if owner is not None:
            return f"is owned by {owner.id}, not {self._id}"
        return f"was not allocated by {self._id} (allocate or upload persistent tensors)"

    def _require_idle(self, op: str) -> None:
        if self._busy is not None:
            raise DeviceError(f"{op}: not allowed on {self._id} during trace {self._busy}")

    def _require_device_tensor(self, op: str, tensor: Any) -> None:
        tt = self._tt
        if not isinstance(tensor, tt.Tensor):
            raise DeviceError(f"{op}: expected a ttnn device tensor, got {type(tensor).__name__}")
        if tensor.storage_type() != tt.StorageType.DEVICE:
            raise DeviceError(f"{op}: {self._describe(tensor)} is a host tensor, not on {self._id}")
        if not tensor.is_allocated():
            raise DeviceError(f"{op}: {self._describe(tensor)} was already deallocated")
        mesh = tensor.device()
        if mesh is None or mesh.id() != self._mesh.id():
            owner = self._owner(tensor)
            where = f"is owned by {owner.id}, not {self._id}" if owner else f"is not on {self._id}"
            raise DeviceError(f"{op}: {self._describe(tensor)} {where}")

    def _describe(self, tensor: Any) -> str:
        owned = self._owned_record(tensor)
        if owned is not None:
            dtype = str(owned.plan.host_dtype).removeprefix("torch.")
            return f"tensor(shape={owned.shape}, dtype={dtype}, device={self._id})"
        try:
            shape = tuple(int(d) for d in tensor.shape)
            return f"tensor(shape={shape}, dtype=ttnn.{_enum_name(tensor.dtype)})"
        except Exception:
            return type(tensor).__name__


@attrs.frozen(kw_only=True)
class _Options:
    mesh_mapper: MeshMapper
    shard_dim: int
    float_layout: FloatLayout
    float_dtypes: dict[torch.dtype, str]
    cq_id: int
    capture_warmup_runs: int


def missing_ttnn_message() -> str:
    """The one line shown when ``device.backend=ttnn`` is selected without ttnn."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return (
        "device.backend=ttnn needs the ttnn package (pip install 'llmrt[tt]') on CPython 3.10 "
        f"or 3.12 with a Tenstorrent device; this interpreter is {version}"
    )


def import_ttnn() -> Any:
    """The ``ttnn`` module, or a ``DeviceError`` with one line saying what to install."""
    try:
        import ttnn
    except ModuleNotFoundError as exc:
        if exc.name != "ttnn":
            raise DeviceError(f"device.backend=ttnn: importing ttnn failed: {exc}") from exc
        raise DeviceError(missing_ttnn_message()) from None
    except ImportError as exc:
        raise DeviceError(
            f"device.backend=ttnn: importing ttnn failed: {_first_line(exc)}"
        ) from exc
    return ttnn


def open_ttnn_device(
    mesh_shape: Sequence[int],
    *,
    ttnn_module: Any | None = None,
    l1_small_size: int = 0,
    trace_region_size: int = DEFAULT_TRACE_REGION_SIZE,
    num_command_queues: int = 1,
    dispatch_core_type: str | None = None,
    fabric_config: str = "disabled",
    mesh_mapper: MeshMapper = "replicate",
    shard_dim: int = 0,
    float_layout: FloatLayout = "tile",
    float_dtypes: Mapping[torch.dtype, str] | None = None,
    capture_warmup_runs: int = 0,
) -> TtnnDevice:
    """Open a ``[rows, cols]`` mesh and return a ``TtnnDevice`` that owns it (see ``close``).

    ``fabric_config`` other than ``disabled`` is set with ``ttnn.set_fabric_config`` before
    the mesh opens (ttnn requires that order) and disabled again when the device closes.
    """
    shape = tuple(mesh_shape)
    if len(shape) != 2 or any(
        isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape
    ):
        raise ConfigError(
            "device.mesh_shape", list(shape), "must be two positive integers [rows, cols]"
        )
    for name, value, low in (
        ("trace_region_size", trace_region_size, 0),
        ("l1_small_size", l1_small_size, 0),
        ("num_command_queues", num_command_queues, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"device.ttnn.{name}", value, f"must be an integer >= {low}")
    if dispatch_core_type is not None and dispatch_core_type not in DISPATCH_CORE_TYPES:
        raise ConfigError(
            "device.ttnn.dispatch_core_type", dispatch_core_type, f"must be {DISPATCH_CORE_TYPES}"
        )
    if fabric_config not in FABRIC_CONFIGS:
        raise ConfigError("device.ttnn.fabric_config", fabric_config, f"must be {FABRIC_CONFIGS}")
    tt = import_ttnn() if ttnn_module is None else ttnn_module
    fabric = fabric_config != "disabled"
    if fabric:
        try:
            tt.set_fabric_config(getattr(tt.FabricConfig, fabric_config.upper()))
        except Exception as exc:
            raise DeviceError(
                f"device.ttnn.fabric_config={fabric_config}: ttnn.set_fabric_config failed: "
                f"{_first_line(exc)}"
            ) from exc
    dispatch = None
    if dispatch_core_type is not None:
        dispatch = tt.DispatchCoreConfig(
            type=getattr(tt.DispatchCoreType, dispatch_core_type.upper())
        )
    try:
        mesh = tt.open_mesh_device(
            mesh_shape=tt.MeshShape(*shape),
            l1_small_size=l1_small_size,
            trace_region_size=trace_region_size,
            num_command_queues=num_command_queues,
            dispatch_core_config=dispatch,
        )
    except Exception as exc:
        error = DeviceError(
            f"device.mesh_shape={list(shape)}: ttnn.open_mesh_device failed: {_first_line(exc)}"
        )
        if fabric:
            try:
                tt.set_fabric_config(tt.FabricConfig.DISABLED)
            except Exception as cleanup:
                failed = [("set_fabric_config DISABLED", cleanup)]
                raise CleanupError(failed, primary=error) from exc
        raise error from exc
    return TtnnDevice(
        mesh,
        ttnn_module=tt,
        mesh_mapper=mesh_mapper,
        shard_dim=shard_dim,
        float_layout=float_layout,
        float_dtypes=float_dtypes,
        capture_warmup_runs=capture_warmup_runs,
        owns_mesh=True,
        owns_fabric=fabric,
    )


def _submesh_shape(dims: tuple[int, ...], n: int) -> tuple[int, int]:
    """The shape of each of ``n`` lanes: chips of one mesh row (``1 x chips``) where a row
    holds whole lanes (a tensor-parallel lane's chips in a row, as tt_transformers lays out
    a Galaxy's 1x8 lanes), else whole rows."""
    if len(dims) != 2:
        raise DeviceError(f"lanes: only 2-D meshes can be split, got mesh shape {list(dims)}")
    rows, cols = dims
    chips, left = divmod(rows * cols, n)
    if not left and cols % chips == 0:
        return 1, chips
    if not left and chips % cols == 0 and rows % (chips // cols) == 0:
        return chips // cols, cols
    raise ConfigError(
        "lanes", n, f"must divide the mesh's rows or columns (mesh shape {list(dims)})"
    )


def _enum_name(value: Any) -> str:
    name = getattr(value, "name", None)
    return name if isinstance(name, str) else str(value).rsplit(".", 1)[-1]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _supported() -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in _STAGED)
