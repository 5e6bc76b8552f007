"""``FakeTtnn``: a recording stand-in for the ``ttnn`` module, as strict as ttnn 0.81.1.

It mirrors the ttnn 0.81 call signatures llmrt uses (``from_torch``, ``to_torch``,
``copy_host_to_device_tensor``, ``deallocate``, ``Tensor.cpu``, events, traces, mesh mappers,
submeshes, ``open_mesh_device`` options, ``set_fabric_config``), records every call, can fail
the Nth call of a chosen name, and raises ``TtnnRuleViolation`` where a chip would hang,
corrupt memory or return garbage, or where ttnn itself throws (then with ttnn's own message):

- no host write (``from_torch``/``to_device``/``copy_host_to_device_tensor``), allocation,
  read, event or synchronize inside a trace capture; host-write allocations while a trace is
  live raise too (``allocation_while_trace_live="warn"`` only records them, as tt-metal warns);
- a capture may only run programs already in the mesh's program cache (keyed like tt-metal's:
  op, input shapes, dtypes, layouts and memory configs, and the op's non-scalar attributes),
  so a capture whose programs differ from the warm-up run raises ttnn's
  "Cannot load new binaries during trace capture" error;
- a captured trace must fit the mesh's ``trace_region_size`` (``trace_bytes_per_op`` per
  captured op, live traces included), checked at ``end_trace_capture`` with ttnn's message;
- a trace's tensors (what it read or created) are not deallocated before ``release_trace``;
- the host value of a non-blocking ``Tensor.cpu`` is not read before an event recorded after
  it is synchronized (or the device is synchronized);
- nothing is deallocated twice and no deallocated tensor is used; captures do not nest;
- ``cq_id`` must name one of the mesh's ``num_command_queues``; ``set_fabric_config`` must
  precede ``open_mesh_device`` and a fabric needs a mesh of two chips or more.

Device tensors hold a torch payload but, like a real ``ttnn.Tensor``, have no
``__torch_function__`` behaviour and no torch methods: a torch function or method on one
raises unless the fake was made with ``torch_ops="allow"`` (a test's opt-in, for small torch
programs). Their operators are exactly the real tensor's (``+ - * / @``, comparisons,
``[]``) and dispatch to the fake's ttnn ops, which compute their outputs' dtype and layout
the way ttnn documents them (binary ops keep input A's dtype and layout unless ``dtype=`` is
given, ``matmul`` needs tile inputs, ``embedding`` needs UINT32 or BFLOAT16 ids and returns
the weight's dtype in ``layout``, ``typecast``/``to_layout`` convert). ``matmul``, ``linear``
(bias, transposes, fused activation), ``rms_norm`` (weight, bias, residual), ``silu``,
``gelu`` (``GeluVariant`` Accurate or Tanh) and ``softmax`` compute in float32 on the
values the device holds and round to the output dtype: bfloat8_b/bfloat4_b payloads are
block floats (``llmrt.testing.block_float``), as on a chip.
``experimental`` and ``transformer`` hold a tt_transformers decoder's attention ops (paged KV
writes, paged decode and causal prefill SDPA, ``rotary_embedding_llama``:
``llmrt.testing.fake_ttnn_transformer``).
Ops added with ``register_op`` keep the first tensor argument's dtype and layout unless told
otherwise.
Calls of ttnn ops are recorded like API calls (replays are not: a replay records only
``execute_trace``). Ops run inside a capture are recorded on the trace's tape;
``execute_trace`` replays the tape against the tensors' current payloads, so refreshed inputs
change a replay's results and Python values are baked at capture, as on a chip. A
multi-device tensor keeps one payload while every chip holds the same value (replicated) and
a payload stacked per device once they differ (sharded by a mesh mapper, or computed from
such a tensor: each op runs once per chip on its own values); the collective ops
``all_gather``, ``reduce_scatter`` and ``all_reduce`` combine the chips' values
(``llmrt.testing.fake_ttnn_mesh``) and need a fabric (``set_fabric_config`` before the mesh
opens), as on a chip.
"""

from __future__ import annotations

import enum
import functools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import attrs
import torch

from llmrt.errors import ConfigError
from llmrt.testing import fake_ttnn_mesh as per_mesh
from llmrt.testing.block_float import MANTISSA_BITS, round_block_float
from llmrt.testing.fake_ttnn_mesh import Shards
from llmrt.testing.fake_ttnn_transformer import install as install_transformer_ops

TILE_SIZE = 32
TRACE_BYTES_PER_OP = 4096
"""Trace-region bytes one captured op takes (a model of tt-metal's per-program commands)."""

CACHE_MISS_IN_CAPTURE = (
    "Cannot load new binaries during trace capture.This program is not yet in program cache. "
    "Warm up before capturing a trace.See the operation's hash signature for arguments that "
    "must match."
)
"""tt-metal 0.81.1's error text for a program cache miss inside a trace capture."""


class TtnnRuleViolation(RuntimeError):
    """A call that real hardware does not allow; ``rule`` names the rule."""

    def __init__(self, rule: str, detail: str) -> None:
        self.rule = rule
        self.detail = detail
        super().__init__(f"ttnn rule violated: {rule}: {detail}")


class InjectedTtnnFailure(RuntimeError):
    """The failure a ``FakeTtnn`` was told to inject; the call did nothing."""

    def __init__(self, *, name: str, call_number: int) -> None:
        self.name = name
        self.call_number = call_number
        super().__init__(f"injected ttnn failure: {name} call #{call_number}")


class TtnnCall(NamedTuple):
    """One recorded API call; ``mesh_id`` is the mesh it acted on, if any."""

    name: str
    mesh_id: int | None
    detail: str
    injected: bool


class DataType(enum.Enum):
    """ttnn data types (the subset llmrt meets)."""

    FLOAT32 = "FLOAT32"
    BFLOAT16 = "BFLOAT16"
    BFLOAT8_B = "BFLOAT8_B"
    BFLOAT4_B = "BFLOAT4_B"
    INT32 = "INT32"
    UINT32 = "UINT32"
    UINT16 = "UINT16"
    UINT8 = "UINT8"
    INT8 = "INT8"


class Layout(enum.Enum):
    """ttnn tensor layouts."""

    ROW_MAJOR = "ROW_MAJOR"
    TILE = "TILE"


class StorageType(enum.Enum):
    """Where a ttnn tensor lives."""

    HOST = "HOST"
    DEVICE = "DEVICE"


class FabricConfig(enum.Enum):
    """ttnn fabric configurations (the members of ttnn 0.81.1's ``FabricConfig``)."""

    DISABLED = "DISABLED"
    FABRIC_1D = "FABRIC_1D"
    FABRIC_1D_NEIGHBOR_EXCHANGE = "FABRIC_1D_NEIGHBOR_EXCHANGE"
    FABRIC_1D_RING = "FABRIC_1D_RING"
    FABRIC_2D = "FABRIC_2D"
    FABRIC_2D_TORUS_X = "FABRIC_2D_TORUS_X"
    FABRIC_2D_TORUS_XY = "FABRIC_2D_TORUS_XY"
    FABRIC_2D_TORUS_Y = "FABRIC_2D_TORUS_Y"
    CUSTOM = "CUSTOM"


class DispatchCoreType(enum.Enum):
    """Which cores run command dispatch."""

    WORKER = "WORKER"
    ETH = "ETH"


class DispatchCoreAxis(enum.Enum):
    """Along which axis dispatch cores are taken."""

    ROW = "ROW"
    COL = "COL"


@attrs.frozen(kw_only=True)
class DispatchCoreConfig:
    """``ttnn.DispatchCoreConfig(type=..., axis=...)`` (None: the device's default)."""

    type: DispatchCoreType | None = None
    axis: DispatchCoreAxis | None = None


_TO_TORCH: dict[DataType, torch.dtype] = {
    DataType.FLOAT32: torch.float32,
    DataType.BFLOAT16: torch.bfloat16,
    DataType.BFLOAT8_B: torch.float32,
    DataType.BFLOAT4_B: torch.float32,
    DataType.INT32: torch.int32,
    DataType.UINT32: torch.uint32,
    DataType.UINT16: torch.uint16,
    DataType.UINT8: torch.uint8,
    DataType.INT8: torch.int8,
}
"""What ``to_torch`` returns per ttnn dtype (measured on ttnn 0.81.1)."""

_INFERRED: dict[torch.dtype, DataType] = {
    torch.float32: DataType.FLOAT32,
    torch.float64: DataType.FLOAT32,
    torch.bfloat16: DataType.BFLOAT16,
    torch.float16: DataType.BFLOAT16,
    torch.int64: DataType.UINT32,
    torch.int32: DataType.INT32,
    torch.int16: DataType.UINT16,
    torch.uint8: DataType.UINT8,
    torch.bool: DataType.UINT8,
    torch.int8: DataType.INT8,
}
"""The ttnn dtype ``from_torch`` picks when none is given (measured on ttnn 0.81.1)."""

_BLOCK_FLOATS = frozenset({DataType.BFLOAT8_B, DataType.BFLOAT4_B})
_UNSIGNED_MASK = {DataType.UINT32: 0xFFFFFFFF, DataType.UINT16: 0xFFFF}


class Shape(tuple[int, ...]):
    """A ttnn shape: a tuple of ints that prints like ``Shape([2, 3])``."""

    def __repr__(self) -> str:
        return f"Shape({list(self)})"


class MeshShape:
    """Shape of a mesh device: ``MeshShape(1, 4)`` or ``MeshShape([1, 4])``."""

    def __init__(self, *dims: int | Sequence[int]) -> None:
        first = dims[0] if len(dims) == 1 else None
        flat: tuple[Any, ...] = tuple(first) if isinstance(first, Sequence) else dims
        if not flat or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in flat):
            raise TypeError(f"MeshShape: dimensions must be positive ints, got {flat!r}")
        self._dims: tuple[int, ...] = flat

    def dims(self) -> int:
        return len(self._dims)

    def mesh_size(self) -> int:
        size = 1
        for d in self._dims:
            size *= d
        return size

    def __getitem__(self, index: int) -> int:
        return self._dims[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._dims)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MeshShape) and other._dims == self._dims

    def __hash__(self) -> int:
        return hash(self._dims)

    def __repr__(self) -> str:
        return f"MeshShape({list(self._dims)})"


@attrs.frozen
class MeshTraceId:
    """Handle of a captured trace, as ``begin_trace_capture`` returns it."""

    value: int


@attrs.frozen(eq=False)
class MeshEvent:
    """A position in one mesh's command queue."""

    mesh: MeshDevice
    seq: int
    cq_id: int


@attrs.frozen
class MemoryConfig:
    """Placeholder for ttnn memory configs (accepted, not modelled)."""

    name: str


DRAM_MEMORY_CONFIG = MemoryConfig("DRAM")
L1_MEMORY_CONFIG = MemoryConfig("L1")


@attrs.frozen(eq=False)
class TensorToMesh:
    """A mesh mapper (replicate; shard along ``dim``; shard a 2-D mesh along ``dims``) or,
    as ``devices``, the topology of an op's per-device results."""

    mesh: MeshDevice
    kind: Literal["replicate", "shard", "shard2d", "devices"]
    dim: int = 0
    dims: tuple[int | None, int | None] = (None, None)
    grid: tuple[int, int] | None = None

    @property
    def spread(self) -> bool:
        """The tensor's payload is stacked per device (its chips hold different values)."""
        return self.kind != "replicate" and self.mesh.get_num_devices() > 1


@attrs.frozen(eq=False)
class MeshToTensor:
    """A mesh composer concatenating device tensors along ``dim`` (a 2-D one: each mesh
    row's along ``dims[1]``, the rows along ``dims[0]``)."""

    mesh: MeshDevice
    dim: int
    dims: tuple[int, int] | None = None
    grid: tuple[int, int] | None = None


class GeluVariant(enum.Enum):
    """``ttnn.GeluVariant``: which GELU ``ttnn.gelu`` computes (0.81.1's members)."""

    Accurate = 0
    FastLut = 1
    Tanh = 2


class Topology(enum.Enum):
    """``ttnn.Topology``: the fabric route a collective takes."""

    Ring = 0
    Linear = 1
    Mesh = 2
    Torus = 3


@attrs.define(eq=False)
class _Tape:
    """A captured trace: the ops run inside the capture and the tensors they touched."""

    trace_id: int
    mesh: MeshDevice
    ops: list[_TapeOp] = attrs.Factory(list)
    inputs: dict[int, Tensor] = attrs.Factory(dict)
    created: dict[int, Tensor] = attrs.Factory(dict)
    oversized: bool = False


@attrs.frozen(eq=False)
class _TapeOp:
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: Any


class MeshDevice:
    """A fake mesh (or submesh) with its own command queue, captures and traces."""

    def __init__(
        self,
        *,
        fake: FakeTtnn,
        mesh_id: int,
        shape: MeshShape,
        trace_region_size: int,
        num_command_queues: int,
        parent: MeshDevice | None,
    ) -> None:
        self._fake = fake
        self._id = mesh_id
        self._shape = shape
        self._trace_region_size = trace_region_size
        self._num_command_queues = num_command_queues
        self._parent = parent
        self._fabric: FabricConfig = fake._fabric if parent is None else parent._fabric
        self._program_cache: set[tuple[Any, ...]] = set()
        self._trace_bytes: dict[int, int] = {}
        self._submeshes: list[MeshDevice] = []
        self._closed = False
        self._seq = 0
        self._pending: list[Tensor] = []
        self._capture: _Tape | None = None
        self._traces: dict[int, _Tape] = {}
        self._trace_ids = 0

    def __repr__(self) -> str:
        return f"MeshDevice(id={self._id}, shape={list(self._shape)})"

    def id(self) -> int:
        return self._id

    @property
    def shape(self) -> MeshShape:
        return self._shape

    def get_num_devices(self) -> int:
        return self._shape.mesh_size()

    def get_submeshes(self) -> list[MeshDevice]:
        return list(self._submeshes)

    def create_submeshes(self, submesh_shape: MeshShape) -> list[MeshDevice]:
        """Split this mesh into equal submeshes of ``submesh_shape``."""
        self._fake._record("MeshDevice.create_submeshes", self, repr(submesh_shape))
        self._fake._require_open(self)
        dims, sub = list(self._shape), list(submesh_shape)
        if len(sub) != len(dims) or any(d % s for d, s in zip(dims, sub, strict=True)):
            raise RuntimeError(f"create_submeshes: {submesh_shape!r} does not tile {self._shape!r}")
        count = self.get_num_devices() // submesh_shape.mesh_size()
        made = [self._fake._new_mesh(submesh_shape, parent=self) for _ in range(count)]
        self._submeshes.extend(made)
        return made

    def create_submesh(self, submesh_shape: MeshShape, offset: object | None = None) -> MeshDevice:
        """One submesh of ``submesh_shape`` (``offset`` is accepted, not modelled)."""
        self._fake._record("MeshDevice.create_submesh", self, repr(submesh_shape))
        self._fake._require_open(self)
        made = self._fake._new_mesh(submesh_shape, parent=self)
        self._submeshes.append(made)
        return made

    def num_program_cache_entries(self) -> int:
        """Programs compiled on this mesh so far (each distinct op signature once)."""
        return len(self._program_cache)

    def clear_program_cache(self) -> None:
        self._fake._record("MeshDevice.clear_program_cache", self)
        self._program_cache.clear()

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq


class Tensor:
    """A fake ttnn tensor: a torch payload plus dtype, layout, storage and mesh topology."""

    def __init__(
        self,
        *,
        fake: FakeTtnn,
        payload: torch.Tensor,
        dtype: DataType,
        layout: Layout,
        mesh: MeshDevice | None,
        topology: TensorToMesh | None,
        created_in: _Tape | None = None,
        memory_config: MemoryConfig | None = None,
    ) -> None:
        self._fake = fake
        self._payload = payload
        self._memory_config = memory_config or DRAM_MEMORY_CONFIG
        self._dtype = dtype
        self._layout = layout
        self._mesh = mesh
        self._topology = topology
        self._allocated = True
        self._pending_seq: int | None = None
        self._created_in = created_in

    def __repr__(self) -> str:
        where = f"mesh {self._mesh.id()}" if self._mesh is not None else "host"
        return (
            f"ttnn.Tensor(shape={self.shape!r}, dtype={self._dtype.name}, "
            f"layout={self._layout.name}, {where})"
        )

    # ttnn surface

    @property
    def shape(self) -> Shape:
        dims = list(self._payload.shape)
        return Shape(dims[1:] if self._spread else dims)

    @property
    def _spread(self) -> bool:
        return self._topology is not None and self._topology.spread

    @property
    def padded_shape(self) -> Shape:
        """The stored shape: tile layout pads the last two dims (rank < 2 grows to 2) to 32."""
        dims = list(self.shape)
        if self._layout is Layout.TILE:
            dims = [1] * (2 - len(dims)) + dims
            for i in (-2, -1):
                dims[i] = -(-dims[i] // TILE_SIZE) * TILE_SIZE
        return Shape(dims)

    @property
    def dtype(self) -> DataType:
        return self._dtype

    @property
    def layout(self) -> Layout:
        return self._layout

    def storage_type(self) -> StorageType:
        return StorageType.HOST if self._mesh is None else StorageType.DEVICE

    def is_allocated(self) -> bool:
        return self._allocated

    def device(self) -> MeshDevice | None:
        return self._mesh

    def cpu(self, blocking: bool = True, cq_id: int | None = None) -> Tensor:
        """Device-to-host copy; a non-blocking copy is readable after a later event syncs."""
        return self._fake._cpu(self, blocking=blocking, cq_id=cq_id)

    def to_torch(self, mesh_composer: MeshToTensor | None = None) -> torch.Tensor:
        """Host tensor to torch (``ttnn.to_torch`` also accepts device tensors)."""
        self._fake._record("Tensor.to_torch", self._mesh, repr(self))
        if self._mesh is not None:
            raise RuntimeError("Tensor.to_torch: tensor is on device; use ttnn.to_torch")
        return self._fake._host_value(self, mesh_composer=mesh_composer)

    def deallocate(self, force: bool = True) -> None:
        self._fake.deallocate(self, force=force)

    def reshape(self, *shape: int | Sequence[int]) -> Tensor:
        first = shape[0] if len(shape) == 1 else None
        raw: Sequence[Any] = first if isinstance(first, Sequence) else shape
        dims = tuple(int(d) for d in raw)
        if self._mesh is None:
            devices = tuple(self._payload.shape[:1]) if self._spread else ()
            return Tensor(
                fake=self._fake,
                payload=self._payload.reshape(devices + dims),
                dtype=self._dtype,
                layout=self._layout,
                mesh=None,
                topology=self._topology,
            )
        result: Tensor = self._fake._call_op("reshape", torch.reshape, (self, dims), {})
        return result

    def item(self) -> Any:
        return self._fake._host_scalar(self, "item").item()

    def memory_config(self) -> MemoryConfig:
        return self._memory_config

    # torch interop: a real ttnn.Tensor has none; ``torch_ops="allow"`` is a test's opt-in

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Iterable[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        fake = next(t._fake for t in _tensors((args, kwargs)))
        if fake._torch_ops == "reject":
            name = getattr(func, "__name__", repr(func))
            raise fake._violate(
                "torch function on a ttnn tensor",
                f"{name}: a ttnn.Tensor does not dispatch torch functions; use a ttnn op",
            )
        return fake._run_op(func, tuple(args), dict(kwargs or {}))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        attr = getattr(torch.Tensor, name, None)
        if attr is None or self._fake._torch_ops == "reject":
            raise AttributeError(f"'ttnn.Tensor' object has no attribute {name!r}")
        if callable(attr):
            return functools.partial(self._fake._run_op_method, attr, self)
        return self._fake._run_op(_getattr_op(name), (self,), {})

    def __getitem__(self, index: Any) -> Any:
        """``tensor[...]``: ttnn's slice (a device op keeping dtype and layout)."""
        return self._fake._call_op("getitem", _torch_getitem, (self, index), {})

    __hash__ = object.__hash__


def _binary_operator(op: str, *, reflected: bool) -> Callable[..., Any]:
    """A ``ttnn.Tensor`` operator: the ttnn op ``op`` (``other op self`` when reflected)."""

    def method(self: Tensor, other: Any) -> Any:
        fn = getattr(self._fake, op)
        return fn(other, self) if reflected else fn(self, other)

    return method


#: The operators of a real ttnn 0.81.1 ``Tensor`` and the ttnn op each calls (ttnn binds them
#: in python: ``__rsub__`` calls ``subtract(other, self)``, ``__rtruediv__`` calls ``rdiv``).
TENSOR_OPERATORS: Mapping[str, tuple[str, bool]] = {
    "__add__": ("add", False),
    "__radd__": ("add", False),
    "__sub__": ("subtract", False),
    "__rsub__": ("subtract", True),
    "__mul__": ("multiply", False),
    "__rmul__": ("multiply", False),
    "__truediv__": ("divide", False),
    "__rtruediv__": ("rdiv", False),
    "__matmul__": ("matmul", False),
    "__eq__": ("eq", False),
    "__ne__": ("ne", False),
    "__gt__": ("gt", False),
    "__ge__": ("ge", False),
    "__lt__": ("lt", False),
    "__le__": ("le", False),
}
for _name, (_op, _reflected) in TENSOR_OPERATORS.items():
    _method = _binary_operator(_op, reflected=_reflected)
    _method.__name__ = _name
    setattr(Tensor, _name, _method)


def _torch_getitem(tensor: torch.Tensor, index: Any) -> torch.Tensor:
    return tensor[index]


@functools.cache
def _getattr_op(name: str) -> Callable[[torch.Tensor], Any]:
    def get(tensor: torch.Tensor) -> Any:
        return getattr(tensor, name)

    get.__name__ = f"getattr_{name}"
    return get


_DataType = DataType
_DispatchCoreConfig = DispatchCoreConfig
_FabricConfig = FabricConfig
_Topology = Topology
_GeluVariant = GeluVariant
_Layout = Layout
_MemoryConfig = MemoryConfig
_MeshDevice = MeshDevice
_MeshEvent = MeshEvent
_MeshShape = MeshShape
_MeshTraceId = MeshTraceId
_Shape = Shape
_StorageType = StorageType
_Tensor = Tensor


def _binary_op(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``ttnn.<name>(input_tensor_a, input_tensor_b, *, dtype=None, memory_config=None)``: an
    eltwise binary op computing ``func`` on the payloads (``FakeTtnn._binary`` gives its
    output dtype and layout)."""

    def op(
        self: FakeTtnn,
        input_tensor_a: Any,
        input_tensor_b: Any,
        *,
        dtype: Any = None,
        memory_config: Any = None,
    ) -> Any:
        return self._binary(name, func, input_tensor_a, input_tensor_b, dtype, memory_config)

    op.__name__ = name
    op.__qualname__ = f"FakeTtnn.{name}"
    op.__doc__ = f"``ttnn.{name}``: input A's dtype (or ``dtype``) and layout, as ttnn."
    return op


class FakeTtnn:
    """A fake ``ttnn`` module instance; pass it as ``TtnnDevice(..., ttnn_module=fake)``.

    ``fail`` maps a call name (``"execute_trace"``, ``"Tensor.cpu"``, ...) to the 1-based call
    number(s) that raise ``InjectedTtnnFailure`` instead of running (``inject`` adds more later).
    ``system_mesh_shape`` is what ``open_mesh_device()`` opens by default and the largest mesh
    it accepts. Call names are the ttnn names, ``Tensor.<method>`` and ``MeshDevice.<method>``.
    Device tensors refuse torch functions and torch methods, as a real ``ttnn.Tensor`` does;
    ``torch_ops="allow"`` is a test's opt-in to run small torch programs on them.
    ``trace_bytes_per_op`` is the trace-region cost of one captured op.
    """

    TILE_SIZE = TILE_SIZE
    DataType = DataType
    Layout = Layout
    StorageType = StorageType
    Shape = Shape
    MeshShape = MeshShape
    MeshDevice = MeshDevice
    MeshTraceId = MeshTraceId
    MeshEvent = MeshEvent
    MemoryConfig = MemoryConfig
    Tensor = Tensor
    CppTensorToMesh = TensorToMesh
    CppMeshToTensor = MeshToTensor
    float32 = DataType.FLOAT32
    bfloat16 = DataType.BFLOAT16
    bfloat8_b = DataType.BFLOAT8_B
    bfloat4_b = DataType.BFLOAT4_B
    int32 = DataType.INT32
    uint32 = DataType.UINT32
    uint16 = DataType.UINT16
    uint8 = DataType.UINT8
    int8 = DataType.INT8
    ROW_MAJOR_LAYOUT = Layout.ROW_MAJOR
    TILE_LAYOUT = Layout.TILE
    DEVICE_STORAGE_TYPE = StorageType.DEVICE
    DRAM_MEMORY_CONFIG = DRAM_MEMORY_CONFIG
    L1_MEMORY_CONFIG = L1_MEMORY_CONFIG
    FabricConfig = FabricConfig
    DispatchCoreType = DispatchCoreType
    DispatchCoreAxis = DispatchCoreAxis
    DispatchCoreConfig = DispatchCoreConfig
    Topology = Topology
    GeluVariant = GeluVariant

    def __init__(
        self,
        *,
        system_mesh_shape: Sequence[int] = (1, 1),
        fail: Mapping[str, int | Iterable[int]] | None = None,
        allocation_while_trace_live: Literal["raise", "warn"] = "raise",
        torch_ops: Literal["allow", "reject"] = "reject",
        trace_bytes_per_op: int = TRACE_BYTES_PER_OP,
    ) -> None:
        if allocation_while_trace_live not in ("raise", "warn"):
            raise ConfigError(
                "allocation_while_trace_live", allocation_while_trace_live, "must be raise|warn"
            )
        if torch_ops not in ("allow", "reject"):
            raise ConfigError("torch_ops", torch_ops, "must be allow|reject")
        if (
            isinstance(trace_bytes_per_op, bool)
            or not isinstance(trace_bytes_per_op, int)
            or trace_bytes_per_op < 1
        ):
            raise ConfigError("trace_bytes_per_op", trace_bytes_per_op, "must be an integer >= 1")
        self._trace_bytes_per_op = trace_bytes_per_op
        self._fabric = FabricConfig.DISABLED
        self._torch_ops = torch_ops
        self._system_shape = MeshShape(*system_mesh_shape)
        self._failing = _resolve_fail(fail or {})
        self._allocation_policy = allocation_while_trace_live
        self._counts: dict[str, int] = {}
        self._calls: list[TtnnCall] = []
        self._violations: list[TtnnRuleViolation] = []
        self._warnings: list[str] = []
        self._meshes: list[_MeshDevice] = []
        self._replaying = False
        self.ops_run = 0
        self.cache_loads = 0
        install_transformer_ops(self)

    def __repr__(self) -> str:
        return f"FakeTtnn(calls={len(self._calls)})"

    # recording and injection

    @property
    def calls(self) -> tuple[TtnnCall, ...]:
        """Every API call so far, in order, including injected failures."""
        return tuple(self._calls)

    def call_names(self, *, mesh: _MeshDevice | None = None) -> list[str]:
        """Names of the calls so far, optionally only those on ``mesh``."""
        return [c.name for c in self._calls if mesh is None or c.mesh_id == mesh.id()]

    @property
    def violations(self) -> tuple[TtnnRuleViolation, ...]:
        """Every rule violation raised so far (also those a caller swallowed)."""
        return tuple(self._violations)

    @property
    def warnings(self) -> tuple[str, ...]:
        """Rule breaches recorded instead of raised (``allocation_while_trace_live="warn"``)."""
        return tuple(self._warnings)

    def inject(self, name: str, *upcoming: int) -> None:
        """Fail upcoming calls of ``name``: ``1`` is the next one, ``2`` the one after."""
        done = self._counts.get(name, 0)
        numbers = {done + n for n in _resolve_fail({name: upcoming})[name]}
        self._failing = {**self._failing, name: self._failing.get(name, frozenset()) | numbers}

    def _record(self, name: str, mesh: _MeshDevice | None, detail: str = "") -> None:
        number = self._counts.get(name, 0) + 1
        self._counts[name] = number
        injected = number in self._failing.get(name, frozenset())
        self._calls.append(
            TtnnCall(
                name=name,
                mesh_id=None if mesh is None else mesh.id(),
                detail=detail,
                injected=injected,
            )
        )
        if injected:
            raise InjectedTtnnFailure(name=name, call_number=number)

    def _violate(self, rule: str, detail: str) -> TtnnRuleViolation:
        error = TtnnRuleViolation(rule, detail)
        self._violations.append(error)
        return error

    # meshes

    def set_fabric_config(
        self,
        config: _FabricConfig,
        reliability_mode: Any = None,
        num_planes: int | None = None,
        fabric_tensix_config: Any = None,
        fabric_udm_mode: Any = None,
        fabric_manager_mode: Any = None,
        router_config: Any = None,
    ) -> None:
        """Select the fabric for meshes opened later (ttnn: before ``open_mesh_device``); the
        wheel's other settings are accepted by their names and have no emulated effect."""
        self._record("set_fabric_config", None, repr(config))
        if not isinstance(config, FabricConfig):
            raise TypeError(f"set_fabric_config: expected a ttnn.FabricConfig, got {config!r}")
        open_meshes = [m for m in self._meshes if m._parent is None and not m._closed]
        if config is not FabricConfig.DISABLED and open_meshes:
            raise self._violate(
                "set_fabric_config before open_mesh_device",
                f"SetFabricConfig({config.name}) is not allowed while devices are still open",
            )
        self._fabric = config

    @property
    def fabric_config(self) -> _FabricConfig:
        """The fabric ``set_fabric_config`` selected (fake-only introspection)."""
        return self._fabric

    def open_mesh_device(
        self,
        mesh_shape: _MeshShape | None = None,
        l1_small_size: int = 0,
        trace_region_size: int = 0,
        num_command_queues: int = 1,
        dispatch_core_config: _DispatchCoreConfig | None = None,
        offset: object | None = None,
        physical_device_ids: Sequence[int] = (),
        worker_l1_size: int = 0,
    ) -> _MeshDevice:
        """Open a mesh of ``mesh_shape`` (default: the whole system mesh)."""
        shape = self._system_shape if mesh_shape is None else mesh_shape
        dispatch = dispatch_core_config or DispatchCoreConfig()
        core = None if dispatch.type is None else dispatch.type.name
        self._record(
            "open_mesh_device",
            None,
            f"{shape!r} l1_small_size={l1_small_size} trace_region_size={trace_region_size} "
            f"num_command_queues={num_command_queues} dispatch_core_type={core} "
            f"fabric={self._fabric.name}",
        )
        for name, value in (
            ("l1_small_size", l1_small_size),
            ("trace_region_size", trace_region_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TypeError(f"open_mesh_device: {name} must be an int >= 0, got {value!r}")
        if num_command_queues not in (1, 2):
            raise RuntimeError(
                f"open_mesh_device: num_command_queues must be 1 or 2, got {num_command_queues}"
            )
        if shape.mesh_size() > self._system_shape.mesh_size():
            raise RuntimeError(
                f"open_mesh_device: {shape!r} needs {shape.mesh_size()} devices, "
                f"the system has {self._system_shape.mesh_size()}"
            )
        if self._fabric is not FabricConfig.DISABLED and shape.mesh_size() < 2:
            raise RuntimeError(
                f"Fabric config {self._fabric.name} requires at least 2 participating chips, but "
                f"the opened mesh has {shape.mesh_size()} local device(s) on a single host."
            )
        return self._new_mesh(
            shape,
            parent=None,
            trace_region_size=trace_region_size,
            num_command_queues=num_command_queues,
        )

    def close_mesh_device(self, mesh_device: _MeshDevice) -> None:
        self._record("close_mesh_device", mesh_device)
        self._require_open(mesh_device)
        for mesh in [mesh_device, *mesh_device._submeshes]:
            mesh._closed = True
            mesh._traces.clear()
            mesh._trace_bytes.clear()

    def _new_mesh(
        self,
        shape: _MeshShape,
        *,
        parent: _MeshDevice | None,
        trace_region_size: int = 0,
        num_command_queues: int = 1,
    ) -> _MeshDevice:
        if parent is not None:
            trace_region_size = parent._trace_region_size
            num_command_queues = parent._num_command_queues
        mesh = MeshDevice(
            fake=self,
            mesh_id=len(self._meshes),
            shape=shape,
            trace_region_size=trace_region_size,
            num_command_queues=num_command_queues,
            parent=parent,
        )
        self._meshes.append(mesh)
        return mesh

    def _require_open(self, mesh: _MeshDevice, *, cq_id: int | None = None) -> None:
        if mesh._closed:
            raise self._violate("mesh closed", f"{mesh!r} was closed")
        if cq_id is not None and not 0 <= cq_id < mesh._num_command_queues:
            raise self._violate(
                "command queue",
                f"cq_id={cq_id} on {mesh!r}, opened with "
                f"num_command_queues={mesh._num_command_queues}",
            )

    # mappers and composers

    def replicate_tensor_to_mesh_mapper(self, mesh_device: _MeshDevice) -> TensorToMesh:
        return TensorToMesh(mesh=mesh_device, kind="replicate")

    def shard_tensor_to_mesh_mapper(self, mesh_device: _MeshDevice, dim: int) -> TensorToMesh:
        return TensorToMesh(mesh=mesh_device, kind="shard", dim=dim)

    def concat_mesh_to_tensor_composer(self, mesh_device: _MeshDevice, dim: int) -> MeshToTensor:
        return MeshToTensor(mesh=mesh_device, dim=dim)

    def ReplicateTensorToMesh(self, mesh_device: _MeshDevice) -> TensorToMesh:
        """Deprecated ttnn spelling of ``replicate_tensor_to_mesh_mapper``."""
        return self.replicate_tensor_to_mesh_mapper(mesh_device)

    def ShardTensorToMesh(self, mesh_device: _MeshDevice, dim: int) -> TensorToMesh:
        """Deprecated ttnn spelling of ``shard_tensor_to_mesh_mapper``."""
        return self.shard_tensor_to_mesh_mapper(mesh_device, dim)

    def ConcatMeshToTensor(self, mesh_device: _MeshDevice, dim: int) -> MeshToTensor:
        """Deprecated ttnn spelling of ``concat_mesh_to_tensor_composer``."""
        return self.concat_mesh_to_tensor_composer(mesh_device, dim)

    def ShardTensor2dMesh(
        self,
        mesh_device: _MeshDevice,
        mesh_shape: tuple[int, int],
        dims: tuple[int | None, int | None],
    ) -> TensorToMesh:
        """Device ``(r, c)`` of the ``mesh_shape`` grid holds chunk ``r`` along ``dims[0]``
        and chunk ``c`` along ``dims[1]`` (None: that mesh axis replicates)."""
        grid = _grid_2d("ShardTensor2dMesh", mesh_device, mesh_shape)
        return TensorToMesh(
            mesh=mesh_device, kind="shard2d", dims=_dims_2d("ShardTensor2dMesh", dims), grid=grid
        )

    def ConcatMesh2dToTensor(
        self, mesh_device: _MeshDevice, mesh_shape: tuple[int, int], dims: tuple[int, int]
    ) -> MeshToTensor:
        """Each ``mesh_shape`` row's device tensors joined along ``dims[1]``, the rows along
        ``dims[0]``."""
        grid = _grid_2d("ConcatMesh2dToTensor", mesh_device, mesh_shape)
        first, second = _dims_2d("ConcatMesh2dToTensor", dims)
        if first is None or second is None:
            raise TypeError("ConcatMesh2dToTensor: dims must be two integers")
        return MeshToTensor(mesh=mesh_device, dim=second, dims=(first, second), grid=grid)

    # host <-> device

    def from_torch(
        self,
        tensor: torch.Tensor | None,
        dtype: _DataType | None = None,
        *,
        spec: object | None = None,
        tile: object | None = None,
        pad_value: float | None = None,
        layout: _Layout | None = None,
        device: _MeshDevice | None = None,
        memory_config: _MemoryConfig | None = None,
        mesh_mapper: TensorToMesh | None = None,
        cq_id: int | None = None,
        preserve_nan_values: bool = False,
    ) -> _Tensor | None:
        """A host tensor, or a device tensor when ``device`` is given (a host write)."""
        self._record("from_torch", device, _describe_torch(tensor))
        if tensor is None:
            return None
        if spec is not None or tile is not None:
            raise NotImplementedError("FakeTtnn.from_torch: spec= and tile= are not modelled")
        resolved = _INFERRED.get(tensor.dtype) if dtype is None else dtype
        if resolved is None:
            raise TypeError(f"from_torch: no ttnn dtype for {tensor.dtype}")
        if layout is None:
            layout = Layout.TILE if resolved in _BLOCK_FLOATS else Layout.ROW_MAJOR
        if resolved in _BLOCK_FLOATS and layout is not Layout.TILE:
            raise RuntimeError("from_torch: Layout must be Layout::TILE for bfloat8_b or bfloat4_b")
        topology = mesh_mapper
        if device is not None:
            self._require_open(device)
            self._check_host_write("from_torch", device, allocates=True)
            if topology is not None and topology.mesh is not device:
                raise self._violate(
                    "mesh mapper mismatch", f"mapper built for {topology.mesh!r}, not {device!r}"
                )
            if topology is None:
                topology = TensorToMesh(mesh=device, kind="replicate")
        return Tensor(
            fake=self,
            payload=_store(_distribute(tensor.detach(), topology).clone(), resolved),
            dtype=resolved,
            layout=layout,
            mesh=device,
            topology=topology,
            memory_config=memory_config,
        )

    def as_tensor(
        self,
        tensor: torch.Tensor,
        dtype: _DataType | None = None,
        *,
        layout: _Layout = Layout.ROW_MAJOR,
        device: _MeshDevice | None = None,
        memory_config: _MemoryConfig | None = None,
        cache_file_name: str | None = None,
        preprocess: Callable[[torch.Tensor], torch.Tensor] | None = None,
        mesh_mapper: TensorToMesh | None = None,
        use_device_tilizer: bool = False,
    ) -> _Tensor | None:
        """``from_torch`` that, given ``cache_file_name``, stores the converted tensor in
        ``{cache_file_name}_dtype_{DTYPE}_layout_{LAYOUT}.tensorbin`` on first use and loads
        it from there afterwards, as ttnn does (the file holds this emulator's payload, not
        ttnn's tensorbin format; ``cache_loads`` counts the loads)."""
        if preprocess is not None:
            tensor = preprocess(tensor)
        if cache_file_name is None:
            return self.from_torch(
                tensor,
                dtype=dtype,
                layout=layout,
                device=device,
                memory_config=memory_config,
                mesh_mapper=mesh_mapper,
            )
        resolved = _INFERRED.get(tensor.dtype) if dtype is None else dtype
        if resolved is None:
            raise TypeError(f"as_tensor: no ttnn dtype for {tensor.dtype}")
        path = Path(f"{cache_file_name}_dtype_{resolved.name}_layout_{layout.name}.tensorbin")
        if path.is_file():
            self._record("as_tensor", device, f"load {path}")
            payload = torch.load(path, weights_only=True)
            expected = tuple(_distribute(tensor.to("meta"), mesh_mapper).shape)
            if tuple(payload.shape) != expected:
                raise RuntimeError(
                    f"as_tensor: {path} holds shape {tuple(payload.shape)}, not {expected} "
                    f"(shape {tuple(tensor.shape)} through {mesh_mapper!r})"
                )
            self.cache_loads += 1
            topology = mesh_mapper
            if device is not None:  # a host write, held as stored (no re-rounding)
                self._require_open(device)
                self._check_host_write("as_tensor", device, allocates=True)
                topology = topology or TensorToMesh(mesh=device, kind="replicate")
            return Tensor(
                fake=self,
                payload=payload,
                dtype=resolved,
                layout=layout,
                mesh=device,
                topology=topology,
                memory_config=memory_config,
            )
        made = self.from_torch(
            tensor,
            dtype=resolved,
            layout=layout,
            device=device,
            memory_config=memory_config,
            mesh_mapper=mesh_mapper,
        )
        if made is None:
            raise TypeError("as_tensor: tensor must be a torch tensor")
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        torch.save(made._payload, partial)
        os.replace(partial, path)
        self._record("as_tensor", device, f"dump {path}")
        return made

    def to_torch(
        self,
        tensor: _Tensor,
        dtype: torch.dtype | None = None,
        *,
        torch_rank: int | None = None,
        mesh_composer: MeshToTensor | None = None,
        device: _MeshDevice | None = None,
        cq_id: int | None = None,
    ) -> torch.Tensor:
        """Torch value of a host tensor; a device tensor is read back (blocking) first."""
        self._record("to_torch", tensor._mesh, repr(tensor))
        if tensor._mesh is not None:
            tensor = self._cpu(tensor, blocking=True, cq_id=cq_id, record=False)
        value = self._host_value(tensor, mesh_composer=mesh_composer)
        if torch_rank is not None:
            while value.dim() > torch_rank:
                if value.shape[0] != 1:
                    raise RuntimeError("ttnn: Unable to squeeze to desired rank!")
                value = value.squeeze(0)
        return value if dtype is None else value.to(dtype)

    def to_device(
        self,
        tensor: _Tensor,
        device: _MeshDevice,
        memory_config: _MemoryConfig | None = None,
        *,
        queue_id: int | None = None,
    ) -> _Tensor:
        """A device copy of a host tensor (a host write and an allocation)."""
        self._record("to_device", device, repr(tensor))
        self._require_open(device)
        if tensor._mesh is not None:
            return tensor
        self._check_host_write("to_device", device, allocates=True)
        self._require_readable(tensor, "to_device")
        return Tensor(
            fake=self,
            payload=tensor._payload.clone(),
            dtype=tensor._dtype,
            layout=tensor._layout,
            mesh=device,
            topology=tensor._topology or TensorToMesh(mesh=device, kind="replicate"),
        )

    def from_device(
        self, tensor: _Tensor, blocking: bool = True, *, queue_id: int | None = None
    ) -> _Tensor:
        self._record("from_device", tensor._mesh, repr(tensor))
        return self._cpu(tensor, blocking=blocking, cq_id=queue_id, record=False)

    def allocate_tensor_on_device(
        self,
        shape: Sequence[int],
        dtype: _DataType,
        layout: _Layout,
        mesh_device: _MeshDevice,
        memory_config: _MemoryConfig | None = None,
    ) -> _Tensor:
        """An uninitialized device tensor (filled with a poison value here)."""
        self._record("allocate_tensor_on_device", mesh_device, f"{list(shape)} {dtype.name}")
        self._require_open(mesh_device)
        self._check_host_write("allocate_tensor_on_device", mesh_device, allocates=True)
        host = _TO_TORCH[dtype]
        payload = _store(torch.full(tuple(shape), _poison(host), dtype=host), dtype)
        return Tensor(
            fake=self,
            payload=payload,
            dtype=dtype,
            layout=layout,
            mesh=mesh_device,
            topology=TensorToMesh(mesh=mesh_device, kind="replicate"),
            memory_config=memory_config,
        )

    def copy_host_to_device_tensor(
        self, host_tensor: _Tensor, device_tensor: _Tensor, cq_id: int | None = None
    ) -> None:
        """Overwrite ``device_tensor`` in place from ``host_tensor`` (a host write)."""
        self._record("copy_host_to_device_tensor", device_tensor._mesh, repr(device_tensor))
        mesh = device_tensor._mesh
        if mesh is None or host_tensor._mesh is not None:
            raise RuntimeError("copy_host_to_device_tensor: needs a host source and device target")
        self._require_open(mesh, cq_id=cq_id)
        self._check_host_write("copy_host_to_device_tensor", mesh, allocates=False)
        self._require_allocated(device_tensor, "copy_host_to_device_tensor")
        self._require_readable(host_tensor, "copy_host_to_device_tensor")
        if (
            host_tensor.shape != device_tensor.shape
            or host_tensor._dtype is not device_tensor._dtype
            or host_tensor._layout is not device_tensor._layout
        ):
            raise RuntimeError(
                f"copy_host_to_device_tensor: {host_tensor!r} does not match {device_tensor!r}"
            )
        mapped = host_tensor._topology.mesh if host_tensor._topology is not None else None
        if mesh.get_num_devices() > 1 and mapped is not mesh:
            raise self._violate(
                "host tensor not distributed for this mesh",
                f"{host_tensor!r} was not mapped to {mesh!r} (from_torch(..., mesh_mapper=...))",
            )
        with torch.no_grad():
            if host_tensor._spread and not device_tensor._spread:  # the chips now differ
                device_tensor._payload = host_tensor._payload.clone()
                device_tensor._topology = host_tensor._topology
            else:  # a replicated host value broadcasts to every chip's copy
                device_tensor._payload.copy_(host_tensor._payload)

    def deallocate(self, tensor: _Tensor, force: bool = True) -> None:
        """Free a device tensor; a second deallocation is a violation here."""
        self._record("deallocate", tensor._mesh, repr(tensor))
        mesh = tensor._mesh
        if mesh is None:
            return
        if not tensor._allocated:
            raise self._violate("deallocate twice", f"{tensor!r} was already deallocated")
        capture = mesh._capture
        if capture is not None and tensor._created_in is not capture:
            raise self._violate(
                "deallocate inside capture",
                f"{tensor!r} was not created by the trace being captured",
            )
        for tape in mesh._traces.values():
            if id(tensor) in tape.inputs or id(tensor) in tape.created:
                raise self._violate(
                    "release_trace before deallocating its tensors",
                    f"{tensor!r} is used by live trace {tape.trace_id}",
                )
        tensor._allocated = False

    # reads, events, synchronization

    def _cpu(
        self, tensor: _Tensor, *, blocking: bool, cq_id: int | None, record: bool = True
    ) -> _Tensor:
        mesh = tensor._mesh
        if record:
            self._record("Tensor.cpu", mesh, f"{tensor!r} blocking={blocking}")
        if mesh is None:
            return tensor
        self._require_open(mesh, cq_id=cq_id)
        self._require_allocated(tensor, "Tensor.cpu")
        if mesh._capture is not None:
            raise self._violate("no read inside capture", f"device-to-host read of {tensor!r}")
        host = Tensor(
            fake=self,
            payload=tensor._payload.detach().clone(),
            dtype=tensor._dtype,
            layout=tensor._layout,
            mesh=None,
            topology=tensor._topology,
        )
        if not blocking:
            host._pending_seq = mesh._next_seq()
            mesh._pending.append(host)
        return host

    def record_event(
        self,
        mesh_device: _MeshDevice,
        cq_id: int | None = None,
        sub_device_ids: Sequence[object] = (),
        device_range: object | None = None,
    ) -> _MeshEvent:
        self._record("record_event", mesh_device)
        self._require_open(mesh_device, cq_id=cq_id)
        if mesh_device._capture is not None:
            raise self._violate("no event inside capture", f"record_event on {mesh_device!r}")
        return MeshEvent(mesh=mesh_device, seq=mesh_device._next_seq(), cq_id=cq_id or 0)

    def event_synchronize(self, mesh_event: _MeshEvent) -> None:
        """Complete every non-blocking read queued before ``mesh_event``."""
        mesh = mesh_event.mesh
        self._record("event_synchronize", mesh)
        self._require_open(mesh)
        self._complete(mesh, before=mesh_event.seq)

    def wait_for_event(self, cq_id: int | None, mesh_event: _MeshEvent) -> None:
        self._record("wait_for_event", mesh_event.mesh)

    def synchronize_device(
        self, device: _MeshDevice, cq_id: int | None = None, sub_device_ids: Sequence[object] = ()
    ) -> None:
        self._record("synchronize_device", device)
        self._require_open(device, cq_id=cq_id)
        if device._capture is not None:
            raise self._violate("no synchronize inside capture", f"on {device!r}")
        self._complete(device, before=device._seq + 1)

    def _complete(self, mesh: _MeshDevice, *, before: int) -> None:
        for host in [h for h in mesh._pending if (h._pending_seq or 0) < before]:
            host._pending_seq = None
        mesh._pending = [h for h in mesh._pending if h._pending_seq is not None]

    def is_tensor_storage_on_device(self, tensor: _Tensor) -> bool:
        return tensor._mesh is not None

    # traces

    def begin_trace_capture(self, mesh_device: _MeshDevice, *, cq_id: int | None = None) -> Any:
        self._record("begin_trace_capture", mesh_device)
        self._require_open(mesh_device, cq_id=cq_id)
        if mesh_device._capture is not None:
            raise self._violate("no nested capture", f"{mesh_device!r} is already capturing")
        trace_id = mesh_device._trace_ids
        mesh_device._trace_ids += 1
        mesh_device._capture = _Tape(trace_id=trace_id, mesh=mesh_device)
        return MeshTraceId(trace_id)

    def end_trace_capture(
        self, mesh_device: _MeshDevice, trace_id: _MeshTraceId, *, cq_id: int | None = None
    ) -> None:
        self._record("end_trace_capture", mesh_device, repr(trace_id))
        tape = mesh_device._capture
        if tape is None or tape.trace_id != trace_id.value:
            raise self._violate("end_trace_capture", f"{trace_id!r} is not being captured")
        mesh_device._capture = None
        size = max(1, len(tape.ops)) * self._trace_bytes_per_op
        free = mesh_device._trace_region_size - sum(mesh_device._trace_bytes.values())
        mesh_device._traces[tape.trace_id] = tape
        if size > free:
            # The capture is over but its buffers never fit: only release_trace remains.
            tape.ops.clear()
            tape.oversized = True
            raise self._violate(
                "trace region",
                f"Creating trace buffers of size {size}B on MeshDevice {mesh_device.id()}, but "
                f"only {free}B is allocated for trace region.",
            )
        mesh_device._trace_bytes[tape.trace_id] = size

    def execute_trace(
        self,
        mesh_device: _MeshDevice,
        trace_id: _MeshTraceId,
        *,
        cq_id: int | None = None,
        blocking: bool = True,
    ) -> None:
        """Replay the trace's tape against the current payloads of its tensors."""
        self._record("execute_trace", mesh_device, repr(trace_id))
        self._require_open(mesh_device, cq_id=cq_id)
        if mesh_device._capture is not None:
            raise self._violate("no replay inside capture", f"{trace_id!r}")
        tape = mesh_device._traces.get(trace_id.value)
        if tape is None or tape.oversized:
            raise self._violate("execute_trace", f"{trace_id!r} is not a live trace")
        for tensor in tape.inputs.values():
            if not tensor._allocated:
                raise self._violate("trace input deallocated", f"{tensor!r}")
        self._replaying = True
        try:
            for op in tape.ops:
                self._replay(op)
        finally:
            self._replaying = False

    def release_trace(self, mesh_device: _MeshDevice, trace_id: _MeshTraceId) -> None:
        self._record("release_trace", mesh_device, repr(trace_id))
        if mesh_device._capture is not None:
            raise self._violate("no release inside capture", f"{trace_id!r}")
        if mesh_device._traces.pop(trace_id.value, None) is None:
            raise self._violate("release_trace", f"{trace_id!r} is not a live trace")
        mesh_device._trace_bytes.pop(trace_id.value, None)

    # ops

    def register_op(
        self, name: str, fn: Callable[..., Any], *, output: OutputSpec | None = None
    ) -> None:
        """Expose ``fn`` (computing on torch payloads) as ``fake.<name>``, traced like any op.

        Calls are recorded under ``name`` (and can be failed like any call). ``output`` gives
        the ttnn dtype and layout of the op's outputs from its tensor inputs and keyword
        arguments (default: those of its first tensor argument).
        """

        def op(*args: Any, **kwargs: Any) -> Any:
            return self._call_op(name, fn, args, kwargs, output=output)

        op.__name__ = name
        setattr(self, name, op)

    #: Keyword arguments that carry positions or page tables: int32 (or uint32) tensors.
    INDEX_ARGUMENTS = ("update_idxs_tensor", "page_table", "cur_pos_tensor", "page_table_tensor")

    def install_namespace(
        self, namespace: str, ops: Mapping[str, tuple[Callable[..., Any], str | None]]
    ) -> None:
        """``fake.<namespace>.<op>`` for each op (``ttnn.experimental``, ``ttnn.transformer``):
        computed on payloads, recorded as ``<namespace>.<op>``, traced like any op. Float
        tensor inputs must be in tile layout and index tensors int32, as ttnn requires; an
        op's output (``"same"``) takes its first tensor's dtype and layout (None: in place)."""
        holder = getattr(self, namespace, None)
        if holder is None:
            holder = _Namespace(namespace)
            setattr(self, namespace, holder)
        for op_name, (fn, output) in ops.items():
            setattr(holder, op_name, self._namespaced_op(f"{namespace}.{op_name}", fn, output))

    def _namespaced_op(
        self, name: str, fn: Callable[..., Any], output: str | None
    ) -> Callable[..., Any]:
        def op(*args: Any, **kwargs: Any) -> Any:
            kwargs = {k: v for k, v in kwargs.items() if k not in _PLACEMENT_KWARGS}
            for key, value in [*enumerate(args), *kwargs.items()]:
                if not isinstance(value, Tensor):
                    continue
                index = key in self.INDEX_ARGUMENTS or _POSITIONAL_INDEX.get(name) == key
                if index and value._dtype not in (DataType.INT32, DataType.UINT32):
                    self._record(name, value._mesh)
                    raise self._violate("op input", f"{name}: {key} must be int32")
                if not index and value._layout is not Layout.TILE:
                    self._record(name, value._mesh)
                    raise self._violate("op input", f"{name}: {key} must be in TILE layout")
            func = fn
            target = args[0] if args else None
            if output is None and isinstance(target, Tensor):  # in place: stored as the dtype
                func = _stored_in_place(fn, target._dtype)
                if any(t._spread for t in _tensors((args, kwargs))):
                    self._spread(target)
            return self._call_op(
                name, func, args, kwargs, output=_same_spec if output == "same" else None
            )

        op.__name__ = name.rpartition(".")[2]
        op.__wrapped__ = fn  # type: ignore[attr-defined]  # its parameters, for inspect
        return op

    add = _binary_op("add", torch.add)
    subtract = _binary_op("subtract", torch.sub)
    multiply = _binary_op("multiply", torch.mul)
    divide = _binary_op("divide", torch.true_divide)
    eq = _binary_op("eq", torch.eq)
    ne = _binary_op("ne", torch.ne)
    gt = _binary_op("gt", torch.gt)
    ge = _binary_op("ge", torch.ge)
    lt = _binary_op("lt", torch.lt)
    le = _binary_op("le", torch.le)

    def rdiv(self, input_tensor: Any, value: float, *, memory_config: Any = None) -> Any:
        """``value / input_tensor``."""
        return self._binary("rdiv", _rdiv, input_tensor, value, None, memory_config)

    def _binary(
        self,
        name: str,
        func: Callable[..., Any],
        a: Any,
        b: Any,
        dtype: _DataType | None,
        memory_config: _MemoryConfig | None,
    ) -> Any:
        """An eltwise binary op: input A's dtype (or ``dtype``) and layout, as ttnn."""
        kwargs = {} if memory_config is None else {"memory_config": memory_config}

        def output(inputs: Sequence[_Tensor], _: Mapping[str, Any]) -> tuple[_DataType, _Layout]:
            return (dtype or inputs[0]._dtype, inputs[0]._layout)

        return self._call_op(
            name, _drop_memory_config(func), (a, b), kwargs, output=output, key_extra=(dtype,)
        )

    def matmul(
        self,
        input_tensor_a: Any,
        input_tensor_b: Any,
        *,
        dtype: Any = None,
        memory_config: Any = None,
    ) -> Any:
        """``a @ b``; both inputs in tile layout ("Inputs to matmul must be tilized")."""
        for tensor in (input_tensor_a, input_tensor_b):
            if isinstance(tensor, Tensor) and tensor._layout is not Layout.TILE:
                self._record("matmul", tensor._mesh)
                raise self._violate("op input", "Inputs to matmul must be tilized")

        def output(inputs: Sequence[_Tensor], _: Mapping[str, Any]) -> tuple[_DataType, _Layout]:
            return (dtype or inputs[0]._dtype, Layout.TILE)

        kwargs = {} if memory_config is None else {"memory_config": memory_config}
        return self._call_op(
            "matmul",
            _drop_memory_config(_matmul32),
            (input_tensor_a, input_tensor_b),
            kwargs,
            output=output,
            key_extra=(dtype,),
        )

    def _require_tile(self, name: str, *tensors: Any) -> None:
        for tensor in tensors:
            if isinstance(tensor, Tensor) and tensor._layout is not Layout.TILE:
                self._record(name, tensor._mesh)
                raise self._violate("op input", f"{name}: input tensors must be in TILE layout")

    def linear(
        self,
        input_tensor_a: Any,
        input_tensor_b: Any,
        *,
        bias: Any = None,
        transpose_a: bool = False,
        transpose_b: bool = False,
        memory_config: Any = None,
        dtype: Any = None,
        program_config: Any = None,
        compute_kernel_config: Any = None,
        core_grid: Any = None,
        activation: str | None = None,
    ) -> Any:
        """``a @ b (+ bias)`` (``b`` is ``[in, out]``, as tt_transformers stores weights),
        tile inputs, float32 accumulation, output in ``dtype`` (default: A's), tile layout;
        ``activation`` ``"silu"``/``"relu"``/``"gelu"`` fused."""
        self._require_tile("linear", input_tensor_a, input_tensor_b, bias)
        if activation not in (None, "silu", "relu", "gelu"):
            raise ValueError(f"linear: unsupported activation {activation!r}")

        def run(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
            a = a.transpose(-1, -2) if transpose_a else a
            b = b.transpose(-1, -2) if transpose_b else b
            out = _matmul32(a, b)
            if bias is not None:
                out = out + bias.float().reshape(-1)[: out.shape[-1]]
            return _ACTIVATIONS[activation](out) if activation else out

        def output(inputs: Sequence[_Tensor], _: Mapping[str, Any]) -> tuple[_DataType, _Layout]:
            return (dtype or inputs[0]._dtype, Layout.TILE)

        kwargs = {} if bias is None else {"bias": bias}
        return self._call_op(
            "linear",
            run,
            (input_tensor_a, input_tensor_b),
            kwargs,
            output=output,
            key_extra=(transpose_a, transpose_b, dtype, activation),
        )

    def rms_norm(
        self,
        input_tensor: Any,
        *,
        epsilon: float = 1e-12,
        weight: Any = None,
        bias: Any = None,
        residual_input_tensor: Any = None,
        memory_config: Any = None,
        program_config: Any = None,
        compute_kernel_config: Any = None,
    ) -> Any:
        """``x / sqrt(mean(x^2, -1) + epsilon) * weight (+ bias)`` over the last dimension,
        computed in float32 (``x`` = input + residual when given), tile input, input's dtype."""
        self._require_tile("rms_norm", input_tensor, residual_input_tensor)

        def run(
            x: torch.Tensor,
            weight: torch.Tensor | None = None,
            bias: torch.Tensor | None = None,
            residual_input_tensor: torch.Tensor | None = None,
        ) -> torch.Tensor:
            x = x.float()
            if residual_input_tensor is not None:
                x = x + residual_input_tensor.float()
            out = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)
            width = out.shape[-1]
            if weight is not None:
                out = out * weight.float().reshape(-1)[:width]
            if bias is not None:
                out = out + bias.float().reshape(-1)[:width]
            return out

        kwargs = {
            k: v
            for k, v in (
                ("weight", weight),
                ("bias", bias),
                ("residual_input_tensor", residual_input_tensor),
            )
            if v is not None
        }
        return self._call_op(
            "rms_norm", run, (input_tensor,), kwargs, output=_same_spec, key_extra=(epsilon,)
        )

    def permute(self, input_tensor: Any, dims: Sequence[int], *, memory_config: Any = None) -> Any:
        """``input_tensor`` with its dimensions reordered by ``dims``; dtype and layout kept."""
        order = tuple(int(d) for d in dims)
        return self._call_op(
            "permute",
            lambda x: x.permute(order).contiguous(),
            (input_tensor,),
            {},
            output=_same_spec,
            key_extra=(order,),
        )

    def silu(self, input_tensor: Any, *, memory_config: Any = None) -> Any:
        """``x * sigmoid(x)`` in float32, the input's dtype and layout."""
        return self._call_op(
            "silu",
            lambda x: _ACTIVATIONS["silu"](x.float()),
            (input_tensor,),
            {},
            output=_same_spec,
        )

    def gelu(
        self,
        input_tensor: Any,
        *,
        variant: _GeluVariant = GeluVariant.Accurate,
        fast_and_approximate_mode: bool = False,
        memory_config: Any = None,
    ) -> Any:
        """GELU in float32, the input's dtype and layout: ``Accurate`` is erf's (torch's
        exact gelu), ``Tanh`` the tanh approximation (torch's ``approximate="tanh"``), as
        ttnn 0.81.1 documents them; its ``FastLut`` piecewise-linear table is not emulated
        (refused, as is ``fast_and_approximate_mode``, the legacy name for it)."""
        if not isinstance(variant, GeluVariant):
            raise TypeError(f"gelu: variant must be a ttnn.GeluVariant, got {variant!r}")
        if variant is GeluVariant.FastLut or fast_and_approximate_mode:
            raise NotImplementedError(
                "the ttnn emulator does not compute gelu's FastLut table (use Accurate or Tanh)"
            )
        approximate = "tanh" if variant is GeluVariant.Tanh else "none"
        return self._call_op(
            "gelu",
            lambda x: torch.nn.functional.gelu(x.float(), approximate=approximate),
            (input_tensor,),
            {},
            output=_same_spec,
            key_extra=(variant,),
        )

    def softmax(
        self,
        input_tensor: Any,
        dim: int = -1,
        *,
        memory_config: Any = None,
        compute_kernel_config: Any = None,
        numeric_stable: bool = True,
    ) -> Any:
        """Softmax over ``dim`` in float32, the input's dtype and layout."""
        return self._call_op(
            "softmax",
            lambda x: torch.softmax(x.float(), dim=dim),
            (input_tensor,),
            {},
            output=_same_spec,
            key_extra=(dim, numeric_stable),
        )

    def embedding(
        self,
        input_tensor: Any,
        weight: Any,
        *,
        memory_config: Any = None,
        padding_idx: int | None = None,
        layout: _Layout = Layout.ROW_MAJOR,
        dtype: _DataType | None = None,
    ) -> Any:
        """Rows of ``weight`` picked by integer ids (UINT32 or BFLOAT16, as ttnn requires);
        the output is ``dtype`` (default: the weight's) in ``layout`` (default: row-major)."""
        if isinstance(input_tensor, Tensor) and input_tensor._dtype not in (
            DataType.UINT32,
            DataType.BFLOAT16,
        ):
            self._record("embedding", input_tensor._mesh)
            raise self._violate(
                "op input", f"Input must be UINT32 or BFLOAT16 (got {input_tensor._dtype.name})"
            )

        def output(inputs: Sequence[_Tensor], _: Mapping[str, Any]) -> tuple[_DataType, _Layout]:
            return (dtype or inputs[1]._dtype, layout)

        return self._call_op(
            "embedding",
            _embedding,
            (input_tensor, weight),
            {},
            output=output,
            key_extra=(padding_idx, layout, dtype),
        )

    def to_layout(
        self,
        tensor: Any,
        layout: _Layout,
        dtype: _DataType | None = None,
        memory_config: Any = None,
    ) -> Any:
        """``tensor`` in ``layout`` (itself when nothing changes, as in ttnn)."""
        if (
            isinstance(tensor, Tensor)
            and tensor._layout is layout
            and (dtype is None or dtype is tensor._dtype)
        ):
            self._record("to_layout", tensor._mesh)
            return tensor
        if (
            dtype or getattr(tensor, "_dtype", None)
        ) in _BLOCK_FLOATS and layout is not Layout.TILE:
            raise RuntimeError("to_layout: Layout must be Layout::TILE for bfloat8_b or bfloat4_b")

        def output(inputs: Sequence[_Tensor], _: Mapping[str, Any]) -> tuple[_DataType, _Layout]:
            return (dtype or inputs[0]._dtype, layout)

        return self._call_op(
            "to_layout", _identity, (tensor,), {}, output=output, key_extra=(layout, dtype)
        )

    def typecast(self, input_tensor: Any, dtype: _DataType, *, memory_config: Any = None) -> Any:
        """``input_tensor`` converted to ``dtype`` (block floats need tile layout)."""
        if dtype in _BLOCK_FLOATS and getattr(input_tensor, "_layout", None) is not Layout.TILE:
            raise RuntimeError("typecast: Layout must be Layout::TILE for bfloat8_b or bfloat4_b")

        def output(inputs: Sequence[_Tensor], _: Mapping[str, Any]) -> tuple[_DataType, _Layout]:
            return (dtype, inputs[0]._layout)

        return self._call_op(
            "typecast", _identity, (input_tensor,), {}, output=output, key_extra=(dtype,)
        )

    def reshape(self, input_tensor: Any, shape: Sequence[int]) -> Any:
        return input_tensor.reshape(shape)

    def concat(
        self,
        tensors: Sequence[Any],
        dim: int = 0,
        *,
        memory_config: Any = None,
        output_tensor: Any = None,
        groups: int = 1,
    ) -> Any:
        """The tensors joined along ``dim``: one dtype and one layout for all, as ttnn
        requires (a tile concat off the last two dims keeps tiles whole)."""
        tensors = list(tensors)
        if not tensors:
            raise RuntimeError("concat: needs at least one tensor")
        if output_tensor is not None or groups != 1:
            raise NotImplementedError("FakeTtnn.concat: output_tensor= and groups= not modelled")
        specs = {(t._dtype, t._layout) for t in tensors if isinstance(t, Tensor)}
        if len(specs) != 1 or len(tensors) != sum(isinstance(t, Tensor) for t in tensors):
            first = next((t for t in tensors if isinstance(t, Tensor)), None)
            self._record("concat", None if first is None else first._mesh)
            raise self._violate(
                "op input", "concat: all tensors must be ttnn tensors of one dtype and layout"
            )
        return self._call_op(
            "concat",
            lambda *parts: torch.cat(parts, dim=dim),
            tuple(tensors),
            {},
            output=_same_spec,
            key_extra=(dim,),
        )

    # collectives (tt_transformers' all-reduce on a 1xN mesh: reduce_scatter then all_gather)

    def all_gather(
        self,
        input_tensor: Any,
        dim: int,
        *,
        cluster_axis: int | None = None,
        memory_config: Any = None,
        output_tensor: Any = None,
        subdevice_id: Any = None,
        num_links: int | None = None,
        topology: _Topology | None = None,
    ) -> Any:
        """Each device's tensor joined along ``dim`` with the others of its ring (every device,
        or those along ``cluster_axis``): ``output_shape[dim] = input_shape[dim] * ring``."""
        self._collective_checks(
            "all_gather", input_tensor, dim, cluster_axis, output_tensor, num_links, topology
        )
        return self._collective(
            "all_gather", input_tensor, cluster_axis,
            lambda shards, rings: per_mesh.gathered(shards, rings, dim), key=(dim,),
        )  # fmt: skip

    def reduce_scatter(
        self,
        input_tensor: Any,
        dim: int,
        *,
        cluster_axis: int | None = None,
        subdevice_id: Any = None,
        memory_config: Any = None,
        output_tensor: Any = None,
        num_links: int | None = None,
        topology: _Topology | None = None,
    ) -> Any:
        """The ring's sum, device ``i`` of the ring keeping chunk ``i`` along ``dim``
        (``output_shape[dim] = input_shape[dim] / ring``): bfloat16, bfloat8_b or float32,
        rank 2 or more, ``dim`` divisible by the ring size, as ttnn requires. Summed as the
        chip sums (``_ccl_numerics``): in the tensor's dtype, not float32; without
        ``cluster_axis`` a 2-D mesh reduces along axis 0, then axis 1, as ttnn does."""
        ring = self._collective_checks(
            "reduce_scatter", input_tensor, dim, cluster_axis, output_tensor, num_links, topology
        )
        size = int(input_tensor.shape[dim])
        if size % ring:
            self._record("reduce_scatter", input_tensor._mesh)
            raise self._violate(
                "op input",
                f"reduce_scatter: dim {dim} ({size}) is not divisible by the {ring} devices",
            )
        register, stored = _ccl_numerics(input_tensor._dtype)
        direct = self._direct_reduce_scatter(input_tensor, dim, ring, topology)
        return self._collective(
            "reduce_scatter", input_tensor, cluster_axis,
            lambda shards, rings: per_mesh.scattered(
                shards, rings, dim, direct=direct, register=register, stored=stored
            ),
            key=(dim,), per_axis=True,
        )  # fmt: skip

    def all_reduce(
        self,
        input_tensor: Any,
        *,
        cluster_axis: int | None = None,
        subdevice_id: Any = None,
        memory_config: Any = None,
        num_links: int | None = None,
        topology: _Topology | None = None,
    ) -> Any:
        """The ring's sum on every device of it (the input's shape and dtype): bfloat16,
        bfloat8_b or float32, rank 2 or more; summed in the tensor's dtype as
        ``reduce_scatter`` (without ``cluster_axis`` a 2-D mesh reduces per axis)."""
        self._collective_checks(
            "all_reduce", input_tensor, None, cluster_axis, None, num_links, topology
        )
        register, _ = _ccl_numerics(input_tensor._dtype)
        return self._collective(
            "all_reduce", input_tensor, cluster_axis,
            lambda shards, rings: per_mesh.reduced(shards, rings, register=register), key=(),
            per_axis=True,
        )  # fmt: skip

    def _direct_reduce_scatter(
        self, tensor: _Tensor, dim: int, ring: int, topology: _Topology | None
    ) -> bool:
        """Whether ttnn 0.81.1 takes its one-shot ``reduce_scatter_minimal_direct`` path: a
        ring (``Topology.Ring``, or none given on a ring fabric), tile layout, each device's
        chunk whole tiles along ``dim``, and at most 512 KiB of padded input per device
        (``k_direct_rs_max_input_bytes``); otherwise the store-and-forward kernels."""
        mesh = tensor._mesh
        assert mesh is not None
        if topology is None:
            ring_fabric = mesh._fabric is FabricConfig.FABRIC_1D_RING
            topology = Topology.Ring if ring_fabric else Topology.Linear
        if topology is not Topology.Ring or tensor._layout is not Layout.TILE:
            return False
        padded = list(tensor.padded_shape)
        rank = len(padded)
        if dim % rank >= rank - 2 and (padded[dim] // ring) % TILE_SIZE:
            return False
        size = 1
        for d in padded:
            size *= d
        return size * _CCL_BYTES.get(tensor._dtype, 4) <= 512 << 10

    def _collective_checks(
        self,
        name: str,
        tensor: Any,
        dim: int | None,
        cluster_axis: int | None,
        output_tensor: Any,
        num_links: int | None,
        topology: Any,
    ) -> int:
        """The ring size once the arguments are ones ttnn accepts (else its error)."""
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name}: input_tensor must be a ttnn.Tensor, got {type(tensor)}")
        mesh = tensor._mesh
        if output_tensor is not None:
            raise NotImplementedError(f"FakeTtnn.{name}: output_tensor= is not modelled")
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"{name}: topology must be a ttnn.Topology, got {topology!r}")
        if num_links is not None and not _is_count(num_links):
            raise TypeError(f"{name}: num_links must be a positive integer, got {num_links!r}")

        def refuse(detail: str) -> TtnnRuleViolation:
            self._record(name, mesh)
            return self._violate("op input", f"{name}: {detail}")

        if mesh is None:
            raise refuse("input_tensor is a host tensor")
        rank = len(tensor.shape)
        if dim is not None and not -rank <= dim < rank:
            raise refuse(f"dim {dim} is out of range for a rank-{rank} tensor")
        if name != "all_gather":
            if rank < 2:
                raise refuse("input must be rank 2 or greater")
            if tensor._dtype not in (DataType.BFLOAT16, DataType.BFLOAT8_B, DataType.FLOAT32):
                raise refuse(f"dtype {tensor._dtype.name} is not BFLOAT16, BFLOAT8_B or FLOAT32")
        if cluster_axis is not None and cluster_axis not in range(mesh.shape.dims()):
            raise refuse(f"cluster_axis {cluster_axis} is not an axis of {mesh.shape!r}")
        if mesh.get_num_devices() > 1 and mesh._fabric is FabricConfig.DISABLED:
            self._record(name, mesh)
            raise self._violate(
                "fabric",
                f"{name} on {mesh!r}: the mesh was opened without a fabric "
                "(set_fabric_config(FABRIC_1D...) before open_mesh_device)",
            )
        grid = per_mesh.mesh_grid(list(mesh.shape))
        fabric_2d = mesh._fabric.name.startswith("FABRIC_2D")
        if name == "all_gather" and cluster_axis is None and min(grid) > 1 and not fabric_2d:
            raise refuse("1D fabric on a 2D mesh_device requires cluster_axis to be set")
        return len(per_mesh.rings(grid, cluster_axis)[0])

    def _collective(
        self,
        name: str,
        tensor: _Tensor,
        cluster_axis: int | None,
        combine: Callable[[list[torch.Tensor], list[list[int]]], list[torch.Tensor]],
        *,
        key: tuple[Any, ...],
        per_axis: bool = False,
    ) -> Any:
        """Run ``combine`` over every device's value; a result every device shares is held
        once (replicated), else stacked per device. ``per_axis``: without ``cluster_axis``
        a mesh of more than one row and column runs it along axis 0, then axis 1 (ttnn's
        reductions on a non-line mesh)."""
        mesh = tensor._mesh
        assert mesh is not None
        devices = mesh.get_num_devices()
        grid = per_mesh.mesh_grid(list(mesh.shape))
        if per_axis and cluster_axis is None and min(grid) > 1:
            ring_sets = [per_mesh.rings(grid, 0), per_mesh.rings(grid, 1)]
        else:
            ring_sets = [per_mesh.rings(grid, cluster_axis)]

        def run(payload: torch.Tensor | Shards) -> torch.Tensor | Shards:
            if isinstance(payload, Shards):
                shards = list(payload.stacked.unbind(0))
            else:
                shards = [payload] * devices
            out = shards
            for rings in ring_sets:
                out = combine(out, rings)
            if all(o is out[0] for o in out):
                return out[0].clone()
            return Shards(torch.stack(out))

        run.__name__ = name
        return self._call_op(
            name, run, (tensor,), {}, output=_same_spec, key_extra=(*key, cluster_axis),
            collective=True,
        )  # fmt: skip

    def _call_op(
        self,
        name: str,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        output: OutputSpec | None = None,
        key_extra: tuple[Any, ...] = (),
        collective: bool = False,
    ) -> Any:
        """A ttnn op called by name: recorded on the mesh of its first tensor, then run."""
        first = next(_tensors((args, kwargs)), None)
        self._record(name, None if first is None else first._mesh)
        return self._run_op(
            func,
            args,
            kwargs,
            name=name,
            output=output,
            key_extra=key_extra,
            collective=collective,
        )

    def _run_op_method(
        self, func: Callable[..., Any], tensor: _Tensor, *args: Any, **kw: Any
    ) -> Any:
        return self._run_op(func, (tensor, *args), kw)

    def _run_op(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        name: str | None = None,
        output: OutputSpec | None = None,
        key_extra: tuple[Any, ...] = (),
        collective: bool = False,
    ) -> Any:
        """Run ``func`` on the payloads (once per chip where they differ; a ``collective``
        gets the whole mesh's values), record it on a capture's tape, wrap its outputs."""
        name = name or str(getattr(func, "__name__", repr(func)))
        inputs = list(_tensors((args, kwargs)))
        if not inputs:
            return func(*args, **kwargs)
        meshes = {id(t._mesh): t._mesh for t in inputs}
        mesh = inputs[0]._mesh
        if mesh is None or None in meshes.values():
            raise self._violate("op on host tensor", f"{name} got a host tensor")
        if len(meshes) > 1:
            raise self._violate("op across meshes", f"{name} mixes {list(meshes.values())}")
        self._require_open(mesh)
        for tensor in inputs:
            self._require_allocated(tensor, name)
        capture = mesh._capture
        if not collective and mesh.get_num_devices() > 1:
            func = per_mesh.per_device(func)  # each chip runs the op on its own values
        key = _program_key(name, args, kwargs, key_extra)
        if key not in mesh._program_cache:
            if capture is not None:
                raise self._violate(
                    "program cache miss during capture", f"{name}: {CACHE_MISS_IN_CAPTURE}"
                )
            mesh._program_cache.add(key)
        payloads = {id(t._payload): t for t in inputs}
        result = func(*_unwrap(args), **_unwrap(kwargs))
        self.ops_run += 1
        template = inputs[0]
        if output is None:
            spec: tuple[_DataType, _Layout] | None = None
        else:
            spec = output(inputs, kwargs)

        def wrap(payload: torch.Tensor | Shards) -> _Tensor:
            spread = isinstance(payload, Shards)
            raw = payload.stacked if isinstance(payload, Shards) else payload
            same = payloads.get(id(raw))
            if same is not None:
                return same
            return self._op_output(raw, template, spec, kwargs.get("memory_config"), spread=spread)

        outputs = _wrap(result, wrap)
        if capture is not None:
            for tensor in inputs:
                if tensor._created_in is not capture:
                    capture.inputs[id(tensor)] = tensor
            for tensor in _tensors(outputs):
                if tensor._created_in is capture:
                    capture.created[id(tensor)] = tensor
            capture.ops.append(_TapeOp(func=func, args=args, kwargs=kwargs, outputs=outputs))
        return outputs

    def _op_output(
        self,
        payload: torch.Tensor,
        template: _Tensor,
        spec: tuple[_DataType, _Layout] | None,
        memory_config: _MemoryConfig | None,
        *,
        spread: bool = False,
    ) -> _Tensor:
        """A new device tensor; ``spec`` (the op's dtype and layout) or, for a torch function a
        test opted into, the dtype ttnn would infer and the template's layout."""
        mesh = template._mesh
        if spec is None:
            dtype, layout = _INFERRED.get(payload.dtype, DataType.FLOAT32), template._layout
        else:
            dtype, layout = spec
            payload = _store(payload, dtype)
        return Tensor(
            fake=self,
            payload=payload,
            dtype=dtype,
            layout=layout,
            mesh=mesh,
            topology=None
            if mesh is None
            else TensorToMesh(mesh=mesh, kind="devices" if spread else "replicate"),
            created_in=None if mesh is None else mesh._capture,
            memory_config=memory_config or template._memory_config,
        )

    def _replay(self, op: _TapeOp) -> None:
        result = op.func(*_unwrap(op.args), **_unwrap(op.kwargs))
        self.ops_run += 1
        new = list(per_mesh.leaves(result))
        old = list(per_mesh.leaves(op.outputs))
        name = getattr(op.func, "__name__", repr(op.func))
        if len(new) != len(old):
            raise self._violate("trace replay", f"{name} changed its output structure")
        for fresh, kept in zip(new, old, strict=True):
            if isinstance(fresh, Shards):
                fresh = fresh.stacked
            if isinstance(kept, Tensor):
                if not isinstance(fresh, torch.Tensor) or fresh.shape != kept._payload.shape:
                    raise self._violate("trace replay", f"{name} changed an output shape")
                if fresh is not kept._payload:
                    kept._payload = _store(fresh, kept._dtype)

    # guards and host values

    def _check_host_write(self, name: str, mesh: _MeshDevice, *, allocates: bool) -> None:
        if mesh._capture is not None:
            rule = "no allocation inside capture" if allocates else "no host write inside capture"
            raise self._violate(rule, f"{name} on {mesh!r}")
        if allocates and mesh._traces:
            detail = (
                f"{name} on {mesh!r} while trace(s) {sorted(mesh._traces)} are live; "
                f"allocate persistent inputs before the first begin_trace_capture"
            )
            if self._allocation_policy == "raise":
                raise self._violate("allocation while a trace is live", detail)
            self._warnings.append(detail)

    def _spread(self, tensor: _Tensor) -> None:
        """Give each chip its own copy of a replicated tensor an op is about to write per chip
        (a KV cache written with tensor-parallel heads): the chips' values may now differ."""
        mesh = tensor._mesh
        if tensor._spread or mesh is None or mesh.get_num_devices() < 2:
            return
        devices = mesh.get_num_devices()
        tensor._payload = tensor._payload.unsqueeze(0).repeat(devices, *[1] * tensor._payload.dim())
        tensor._topology = TensorToMesh(mesh=mesh, kind="devices")

    def _require_allocated(self, tensor: _Tensor, name: str) -> None:
        if not tensor._allocated and not self._replaying:
            raise self._violate("use after deallocate", f"{name} on {tensor!r}")

    def _require_readable(self, tensor: _Tensor, name: str) -> None:
        if tensor._pending_seq is not None:
            raise self._violate(
                "event synchronized before host read",
                f"{name} read {tensor!r} from a non-blocking Tensor.cpu before an event recorded "
                f"after it was synchronized",
            )

    def _host_value(self, tensor: _Tensor, *, mesh_composer: MeshToTensor | None) -> torch.Tensor:
        self._require_readable(tensor, "to_torch")
        value = _to_torch_value(tensor._payload, tensor._dtype)
        topology = tensor._topology
        devices = topology.mesh.get_num_devices() if topology is not None else 1
        if devices == 1:
            return value
        if mesh_composer is None or topology is None:
            raise RuntimeError(
                f"to_torch: {tensor!r} spans {devices} devices; pass a mesh_composer"
            )
        shards = list(value.unbind(0)) if topology.spread else [value] * devices
        if mesh_composer.dims is not None and mesh_composer.grid is not None:
            return per_mesh.concat_2d(shards, dims=mesh_composer.dims, grid=mesh_composer.grid)
        return per_mesh.concat_1d(shards, dim=mesh_composer.dim)

    def _host_scalar(self, tensor: _Tensor, what: str) -> torch.Tensor:
        mesh = tensor._mesh
        if mesh is not None:
            self._require_allocated(tensor, what)
            if mesh._capture is not None:
                raise self._violate("no read inside capture", f"{what}() of {tensor!r}")
        else:
            self._require_readable(tensor, what)
        return tensor._payload


OutputSpec = Callable[[Sequence[Tensor], Mapping[str, Any]], tuple[DataType, Layout]]
"""``(tensor inputs, keyword arguments) -> (dtype, layout)`` of an op's outputs."""


def _program_key(
    name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], extra: tuple[Any, ...]
) -> tuple[Any, ...]:
    """A program-cache key like tt-metal's: the op, each tensor input's shape, dtype, layout
    and memory config, and the op's attributes; Python numbers are runtime arguments."""

    def part(value: Any) -> Any:
        if isinstance(value, Tensor):
            return (
                "tensor",
                tuple(value.shape),
                value._dtype,
                value._layout,
                value._memory_config,
            )
        if isinstance(value, (bool, int, float)):
            return "scalar"
        if isinstance(value, (tuple, list)):
            return tuple(part(v) for v in value)
        if isinstance(value, Mapping):
            return tuple((k, part(v)) for k, v in sorted(value.items()))
        return repr(value)

    attributes = tuple(
        (k, repr(v) if not isinstance(v, Tensor) else part(v)) for k, v in sorted(kwargs.items())
    )
    return (name, part(args), attributes, tuple(repr(e) for e in extra))


def _drop_memory_config(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` ignoring a ``memory_config`` keyword (placement is not modelled in payloads)."""

    @functools.wraps(func)
    def run(*args: Any, memory_config: Any = None) -> Any:
        return func(*args)

    return run


def _stored_in_place(fn: Callable[..., Any], dtype: DataType) -> Callable[..., Any]:
    """``fn`` writing into its first argument, then that payload re-stored as ``dtype`` (a
    block-float row takes a new shared exponent when one of its elements is rewritten)."""

    if dtype not in _BLOCK_FLOATS:  # the write already cast to the payload's dtype
        return fn

    def run(target: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = fn(target, *args, **kwargs)
        target.copy_(_store(target, dtype))
        return result

    return run


class _Namespace:
    """A ttnn sub-module (``ttnn.experimental``, ``ttnn.transformer``) of a fake."""

    def __init__(self, name: str) -> None:
        self.__name__ = f"ttnn.{name}"


#: Positional page-table arguments of namespaced ops (int32 like the keyword ones).
_POSITIONAL_INDEX: Mapping[str, int] = {
    "experimental.paged_fill_cache": 2,
    "transformer.chunked_scaled_dot_product_attention": 3,
}

#: Keywords of ttnn ops that only place or tune the computation (not modelled in payloads).
_PLACEMENT_KWARGS = frozenset({"memory_config", "program_config", "compute_kernel_config"})


def emulator(*, mesh_shape: Sequence[int]) -> FakeTtnn:
    """The ``emulator`` ttnn module a recipe selects (``device.ttnn.module: emulator``): a
    ``FakeTtnn`` whose system holds the recipe's mesh, strict as a chip (rule violations
    raise). Host-write allocations while a trace is live are recorded in ``warnings``, as
    tt-metal warns of them: eager prefill stages its inputs while the decode trace lives,
    as tt_transformers' generator does under vLLM."""
    return FakeTtnn(system_mesh_shape=tuple(mesh_shape), allocation_while_trace_live="warn")


def _matmul32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A matmul as the chip runs it: float32 accumulation over the stored values (a bf16
    activation times a bfloat8_b weight mixes payload dtypes torch alone refuses)."""
    return torch.matmul(a.float(), b.float())


_ACTIVATIONS: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": torch.nn.functional.silu,
    "relu": torch.relu,
    "gelu": torch.nn.functional.gelu,
}


def _same_spec(inputs: Sequence[Tensor], _: Mapping[str, Any]) -> tuple[DataType, Layout]:
    return (inputs[0]._dtype, inputs[0]._layout)


def _rdiv(tensor: torch.Tensor, value: float) -> torch.Tensor:
    return value / tensor


def _embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.embedding(ids.long(), weight)


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone()


def _resolve_fail(fail: Mapping[str, int | Iterable[int]]) -> dict[str, frozenset[int]]:
    resolved: dict[str, frozenset[int]] = {}
    for name, numbers in fail.items():
        wanted = (numbers,) if isinstance(numbers, int) else tuple(numbers)
        for n in wanted:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError(f"fail.{name}", n, "call numbers are integers >= 1")
        resolved[name] = frozenset(wanted)
    return resolved


#: Bytes a device stores per element (block floats with their shared exponents), for the
#: direct reduce-scatter's size gate.
_CCL_BYTES: Mapping[DataType, float] = {
    DataType.FLOAT32: 4,
    DataType.BFLOAT16: 2,
    DataType.BFLOAT8_B: 1088 / 1024,
}


def _ccl_numerics(dtype: DataType) -> tuple[per_mesh.Rounding, per_mesh.Rounding]:
    """How a reduction's partial sums are rounded on the chip: in the destination register
    (float32 with fp32 accumulation, which ttnn turns on for float32 tensors only, else
    bfloat16) and when a partial is stored and sent on (the tensor's dtype)."""
    if dtype is DataType.FLOAT32:
        return _as_float, _as_float

    def register(value: torch.Tensor) -> torch.Tensor:
        return value.to(torch.bfloat16).float()

    def stored(value: torch.Tensor) -> torch.Tensor:
        return _store(value, dtype).float()

    return register, stored


def _as_float(value: torch.Tensor) -> torch.Tensor:
    return value.float()


def _store(tensor: torch.Tensor, dtype: DataType) -> torch.Tensor:
    """The payload kept for ``dtype``: the value a chip would hold, in a torch-computable form."""
    if dtype in _BLOCK_FLOATS:  # a shared exponent per face row, 7 (3) magnitude bits
        bits = MANTISSA_BITS["bfloat8_b" if dtype is DataType.BFLOAT8_B else "bfloat4_b"]
        return round_block_float(tensor, mantissa_bits=bits)
    mask = _UNSIGNED_MASK.get(dtype)
    if mask is not None:
        return tensor.to(torch.int64) & mask
    return tensor.to(_TO_TORCH[dtype])


def _to_torch_value(payload: torch.Tensor, dtype: DataType) -> torch.Tensor:
    mask = _UNSIGNED_MASK.get(dtype)
    if mask is not None:
        return (payload.to(torch.int64) & mask).to(_TO_TORCH[dtype])
    return payload.detach().to(_TO_TORCH[dtype], copy=True)


def _poison(dtype: torch.dtype) -> float | int:
    if dtype.is_floating_point:
        return float("nan")
    return torch.iinfo(dtype).max


def _tensors(tree: Any) -> Iterator[Tensor]:
    for leaf in per_mesh.leaves(tree):
        if isinstance(leaf, Tensor):
            yield leaf


def _unwrap(tree: Any) -> Any:
    if isinstance(tree, Tensor):
        return Shards(tree._payload) if tree._spread else tree._payload
    if isinstance(tree, dict):
        return {k: _unwrap(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return _rebuild(tree, [_unwrap(v) for v in tree])
    return tree


def _wrap(tree: Any, wrap_tensor: Callable[[torch.Tensor | Shards], Tensor]) -> Any:
    if isinstance(tree, (torch.Tensor, Shards)):
        return wrap_tensor(tree)
    if isinstance(tree, dict):
        return {k: _wrap(v, wrap_tensor) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return _rebuild(tree, [_wrap(v, wrap_tensor) for v in tree])
    return tree


def _rebuild(original: tuple[Any, ...] | list[Any], items: list[Any]) -> Any:
    if isinstance(original, list):
        return items
    if type(original) is tuple:
        return tuple(items)
    try:
        return type(original)(items)
    except TypeError:
        return type(original)(*items)


def _distribute(tensor: torch.Tensor, topology: TensorToMesh | None) -> torch.Tensor:
    """The payload ``topology`` (a mesh mapper) gives ``tensor``: itself when replicated,
    else stacked per device."""
    if topology is None or not topology.spread:
        return tensor
    devices = topology.mesh.get_num_devices()
    if topology.kind == "shard":
        return per_mesh.shard_1d(tensor, dim=topology.dim, devices=devices)
    if topology.kind == "shard2d" and topology.grid is not None:
        return per_mesh.shard_2d(tensor, dims=topology.dims, grid=topology.grid)
    raise TypeError(f"{topology!r} is not a mesh mapper")


def _grid_2d(name: str, mesh: MeshDevice, mesh_shape: Any) -> tuple[int, int]:
    """``mesh_shape`` (two positive integers) as the grid over ``mesh``'s devices."""
    shape = tuple(mesh_shape) if isinstance(mesh_shape, (tuple, list, MeshShape)) else ()
    if len(shape) != 2 or not all(_is_count(d) for d in shape):
        raise TypeError(f"{name}: mesh_shape must be two positive integers, got {mesh_shape!r}")
    if shape[0] * shape[1] != mesh.get_num_devices():
        raise RuntimeError(
            f"{name}: mesh_shape {list(shape)} does not cover the mesh's "
            f"{mesh.get_num_devices()} devices"
        )
    return int(shape[0]), int(shape[1])


def _dims_2d(name: str, dims: Any) -> tuple[int | None, int | None]:
    pair = tuple(dims) if isinstance(dims, (tuple, list)) else ()
    ok = all(d is None or (isinstance(d, int) and not isinstance(d, bool)) for d in pair)
    if len(pair) != 2 or not ok:
        raise TypeError(f"{name}: dims must be two integers (or None), got {dims!r}")
    return pair[0], pair[1]


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _describe_torch(tensor: torch.Tensor | None) -> str:
    if tensor is None:
        return "None"
    return f"torch(shape={tuple(tensor.shape)}, dtype={str(tensor.dtype).removeprefix('torch.')})"
