"""A GGUF file opened for reading: header parsed with `struct`, tensor data as views of one mmap.

`gguf.GGUFReader` builds a numpy view for every part of every metadata value (the 49k-token
vocabulary and 48k merges of a small model become ~250k views), which costs seconds on every
start. This reader walks the same layout with `struct.unpack_from` and numpy bulk reads, and
returns the same values (`GGUFReader`'s `field.contents()`, the same tensor arrays), so the
header of a small model parses in a fraction of a second.

The file is mapped once, privately (`ACCESS_COPY`): tensor arrays are writeable views of that
mapping, so `torch.from_numpy` wraps them without copying; the kernel reads pages from the page
cache on first touch, and a write (none is expected) would stay private to this process.
Layout: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3, either
byte order).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Mapping
from math import prod
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import attrs
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

from llmrt.errors import CheckpointError

SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_SCALARS: Mapping[int, str] = MappingProxyType(
    {
        GGUFValueType.UINT8: "B",
        GGUFValueType.INT8: "b",
        GGUFValueType.UINT16: "H",
        GGUFValueType.INT16: "h",
        GGUFValueType.UINT32: "I",
        GGUFValueType.INT32: "i",
        GGUFValueType.FLOAT32: "f",
        GGUFValueType.BOOL: "?",
        GGUFValueType.UINT64: "Q",
        GGUFValueType.INT64: "q",
        GGUFValueType.FLOAT64: "d",
    }
)
_PLAIN_ARRAYS: Mapping[GGMLQuantizationType, type[np.generic]] = MappingProxyType(
    {
        GGMLQuantizationType.F16: np.float16,
        GGMLQuantizationType.F32: np.float32,
        GGMLQuantizationType.F64: np.float64,
        GGMLQuantizationType.I8: np.int8,
        GGMLQuantizationType.I16: np.int16,
        GGMLQuantizationType.I32: np.int32,
        GGMLQuantizationType.I64: np.int64,
    }
)


@attrs.frozen(kw_only=True, eq=False)
class GGUFTensor:
    """One tensor: `dims` as the file lists them (innermost first), `data` a view of the mmap.

    `data` has `GGUFReader`'s shape and dtype: the dims reversed (torch order), as raw `uint8`
    bytes in the last dim for block-quantized types.
    """

    name: str
    tensor_type: GGMLQuantizationType
    dims: tuple[int, ...]
    data: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape in torch order (outermost first)."""
        return tuple(reversed(self.dims))


@attrs.frozen(kw_only=True, eq=False)
class GGUFFile:
    """A parsed GGUF file: its metadata values by key, and its tensors in file order."""

    metadata: Mapping[str, Any]
    tensors: tuple[GGUFTensor, ...]
    #: The file's private mapping every tensor's ``data`` views (``mapped_pages`` gives its
    #: resident pages back once a model has copied them out).
    mapping: mmap.mmap | None = None


#: At most one parsed file kept by ``open_gguf(..., hand_on=True)`` for the next open, which
#: takes it when it opens the same unchanged file (any other open drops it): ``-m FILE`` reads
#: the header to derive a recipe, then the loader opens the file again and takes this parse (a
#: vocabulary's header costs ~50 ms to parse and megabytes to hold twice). Keyed by the file's
#: identity and modification time.
_handed_on: dict[tuple[str, int, int, int], GGUFFile] = {}


def open_gguf(path: Path, *, hand_on: bool = False) -> GGUFFile:
    """Parse the GGUF file at `path`; damage or an unsupported layout is a `CheckpointError`.

    ``hand_on`` keeps the result for the next ``open_gguf``: if that opens the same unchanged
    file it takes the result instead of parsing again; either way it is dropped then.
    """
    item = str(path)
    try:
        stat = path.stat()
        key = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    except OSError as exc:
        raise CheckpointError(item, f"cannot map GGUF file: {exc}") from exc
    parsed = _handed_on.pop(key, None)
    _handed_on.clear()  # kept for the next open only, whichever file it opens
    if parsed is None:
        parsed = _parse_file(path, item=item)
    if hand_on:
        _handed_on[key] = parsed
    return parsed


def _parse_file(path: Path, *, item: str) -> GGUFFile:
    try:
        with path.open("rb") as handle:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
        raise CheckpointError(item, f"cannot map GGUF file: {exc}") from exc
    try:
        return _Parser(mapped, item=item).parse()
    except (struct.error, UnicodeDecodeError, ValueError, OverflowError) as exc:
        raise CheckpointError(item, f"corrupt or unreadable GGUF file: {exc}") from exc


def read_gguf_metadata(path: Path) -> Mapping[str, Any]:
    """The metadata of the GGUF file at `path` (its tensors are mapped, never read)."""
    return open_gguf(path).metadata


class _Parser:
    """One pass over the header; `offset` advances as values are read."""

    def __init__(self, mapped: mmap.mmap, *, item: str) -> None:
        self._buffer = mapped
        self._bytes = np.frombuffer(mapped, dtype=np.uint8)
        self._item = item
        self._order: Literal["<", ">"] = "<"
        self.offset = 0

    def parse(self) -> GGUFFile:
        (magic,) = struct.unpack_from("<I", self._buffer, 0)
        if magic != GGUF_MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        (version,) = struct.unpack_from("<I", self._buffer, 4)
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self._order = ">"
            (version,) = struct.unpack_from(">I", self._buffer, 4)
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported ({SUPPORTED_VERSIONS})")
        self.offset = 8
        tensor_count, kv_count = self._unpack("QQ")
        metadata: dict[str, Any] = {
            "GGUF.version": version,
            "GGUF.tensor_count": tensor_count,
            "GGUF.kv_count": kv_count,
        }
        for _ in range(kv_count):
            key = self._string()
            if key in metadata:
                raise ValueError(f"duplicate metadata key {key!r}")
            (value_type,) = self._unpack("I")
            metadata[key] = self._value(value_type)
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self._alignment(metadata)
        data_start = -(-self.offset // alignment) * alignment
        tensors = tuple(self._tensor(*info, data_start=data_start) for info in infos)
        if len({tensor.name for tensor in tensors}) != len(tensors):
            raise ValueError("duplicate tensor names")
        return GGUFFile(metadata=MappingProxyType(metadata), tensors=tensors, mapping=self._buffer)

    def _unpack(self, codes: str) -> tuple[Any, ...]:
        layout = struct.Struct(self._order + codes)
        values = layout.unpack_from(self._buffer, self.offset)
        self.offset += layout.size
        return values

    def _string(self) -> str:
        (length,) = self._unpack("Q")
        end = self.offset + length
        if end > len(self._buffer):
            raise ValueError(f"string of {length} bytes at {self.offset} runs past the end")
        text = str(self._buffer[self.offset : end], encoding="utf-8")
        self.offset = end
        return text

    def _value(self, value_type: int) -> Any:
        if value_type == GGUFValueType.STRING:
            return self._string()
        code = _SCALARS.get(value_type)
        if code is not None:
            return self._unpack(code)[0]
        if value_type == GGUFValueType.ARRAY:
            item_type, count = self._unpack("IQ")
            return self._array(item_type, count)
        raise ValueError(f"unknown metadata value type {value_type} at {self.offset}")

    def _array(self, item_type: int, count: int) -> list[Any]:
        code = _SCALARS.get(item_type)
        if code is not None:  # numbers in one bulk read
            dtype = np.dtype(self._order + code)
            end = self.offset + dtype.itemsize * count
            if end > len(self._buffer):
                raise ValueError(f"array of {count} values at {self.offset} runs past the end")
            values = self._bytes[self.offset : end].view(dtype)
            self.offset = end
            result: list[Any] = values.tolist()
            return result
        if item_type == GGUFValueType.STRING:
            return self._strings(count)
        return [self._value(item_type) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        """`count` strings (a vocabulary: tens of thousands), in one tight loop."""
        length_of = struct.Struct(self._order + "Q").unpack_from
        buffer, offset, size = self._buffer, self.offset, len(self._buffer)
        strings = []
        for _ in range(count):
            (length,) = length_of(buffer, offset)
            offset += 8
            if offset + length > size:
                raise ValueError(f"string of {length} bytes at {offset} runs past the end")
            strings.append(str(buffer[offset : offset + length], encoding="utf-8"))
            offset += length
        self.offset = offset
        return strings

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        (n_dims,) = self._unpack("I")
        dims = self._unpack("Q" * n_dims)
        raw_type, offset = self._unpack("IQ")
        return name, tuple(int(d) for d in dims), int(raw_type), int(offset)

    def _alignment(self, metadata: Mapping[str, Any]) -> int:
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        return alignment

    def _tensor(
        self, name: str, dims: tuple[int, ...], raw_type: int, offset: int, *, data_start: int
    ) -> GGUFTensor:
        tensor_type = GGMLQuantizationType(raw_type)
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        shape = tuple(reversed(dims))
        count = prod(dims)
        plain = _PLAIN_ARRAYS.get(tensor_type)
        if plain is None:
            if shape and shape[-1] % block_size:
                raise ValueError(f"tensor {name}: {shape[-1]} values are not whole blocks")
            dtype = np.dtype(np.uint8)
            shape = (*shape[:-1], shape[-1] // block_size * type_size) if shape else shape
            n_bytes = count // block_size * type_size
        else:
            dtype = np.dtype(plain).newbyteorder(self._order)
            n_bytes = count * dtype.itemsize
        start = data_start + offset
        if start + n_bytes > len(self._buffer):
            raise ValueError(f"tensor {name}: data runs past the end of the file")
        data = self._bytes[start : start + n_bytes].view(dtype).reshape(shape)
        return GGUFTensor(name=name, tensor_type=tensor_type, dims=dims, data=data)
