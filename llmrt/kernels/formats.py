"""Weight formats: how a linear layer's weight is stored, and block-quantized weights.

A ``QuantizedWeight`` is a ``[out, in]`` matrix kept in one of ggml's block layouts: the
32-weight ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``, ``q8_0``, the 256-weight K-quants ``q4_k``,
``q5_k``, ``q6_k``, or 16-bit float rows (``f16``, ``bf16``): the bytes a GGUF file holds,
row by row. The kernels in
``llmrt.kernels.native`` multiply by it without materialising float weights. Float
checkpoints reach the same layouts through ``quantize`` (``int8`` is ``q8_0``, ``int4`` is
``q4_1``: per-block scale and minimum, the more accurate of the two 4-bit layouts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, get_args

import attrs
import gguf as gguf_py
import numpy as np
import torch

from llmrt.errors import ConfigError
from llmrt.kernels.file_pages import release_file_pages

#: Storage of linear weights a recipe can ask for (``checkpoint.weights``).
WeightFormat = Literal["float32", "bfloat16", "int8", "int4", "gguf-native"]
WEIGHT_FORMATS: tuple[str, ...] = get_args(WeightFormat)
#: Formats whose linear layers run the block-quantized kernels.
QUANTIZED_FORMATS: tuple[str, ...] = ("int8", "int4", "gguf-native")

BlockKind = Literal["q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "f16", "bf16"]
BLOCK_KINDS: tuple[str, ...] = get_args(BlockKind)
BLOCK_SIZE = 32
#: ggml type ids, weights per block and bytes per block, by kind (csrc/blocks.h and
#: csrc/kquant_blocks.h hold the same table).
GGML_TYPE: dict[str, int] = {
    "q4_0": 2, "q4_1": 3, "q8_0": 8, "q5_0": 6, "q5_1": 7,
    "q4_k": 12, "q5_k": 13, "q6_k": 14, "f16": 1, "bf16": 30,
}  # fmt: skip
BLOCK_WEIGHTS: dict[str, int] = {
    "q4_0": 32, "q4_1": 32, "q8_0": 32, "q5_0": 32, "q5_1": 32,
    "q4_k": 256, "q5_k": 256, "q6_k": 256, "f16": 1, "bf16": 1,
}  # fmt: skip
BLOCK_BYTES: dict[str, int] = {
    "q4_0": 18, "q4_1": 20, "q8_0": 34, "q5_0": 22, "q5_1": 24,
    "q4_k": 144, "q5_k": 176, "q6_k": 210, "f16": 2, "bf16": 2,
}  # fmt: skip
#: A stacked weight's kernel type flag, header magic and most parts (``csrc/kquant_blocks.h``).
STACKED_TYPE = 1 << 62
STACKED_MAGIC = 0x4B53544B4C4C4D00
STACKED_MAX_PARTS = 4
#: The kinds the interleaved layout (``csrc/interleaved.cpp``) takes.
INTERLEAVABLE_KINDS: tuple[str, ...] = ("q4_0", "q4_1", "q8_0")
#: How a weight's blocks are ordered: ``ggml`` as the file holds them, or ``interleaved``
#: (``csrc/interleaved.cpp``: each row's quants grouped so one 64-byte load holds whole
#: blocks, for the integer-dot kernels; same bytes per block, rows stay independent).
BlockLayout = Literal["ggml", "interleaved"]
BLOCK_LAYOUTS: tuple[str, ...] = get_args(BlockLayout)
#: Layouts whose row ``r`` of blocks holds exactly row ``r`` of the matrix, so a row range of
#: the weight is that range of its blocks (``QuantizedWeight.rows``). A layout that packs
#: several rows together (a repack for another kernel) is left out.
ROW_LAYOUTS: tuple[str, ...] = ("ggml", "interleaved")
#: Added to the ggml type id in the kernel ops for interleaved blocks (``kInterleaved`` in
#: csrc/linear.h).
INTERLEAVED_TYPE = 256
#: The block kind a float checkpoint is quantized to, by weight format.
QUANTIZE_TO: dict[str, BlockKind] = {"int8": "q8_0", "int4": "q4_1"}


def block_kind_of(ggml_type: int) -> BlockKind | None:
    """The kind for a ggml tensor type id, or None when the kernels do not run it."""
    for kind, type_id in GGML_TYPE.items():
        if type_id == ggml_type:
            return kind  # type: ignore[return-value]
    return None


def _check_blocks(instance: QuantizedWeight, attribute: object, blocks: torch.Tensor) -> None:
    out_features, in_features = instance.shape
    per = BLOCK_WEIGHTS[instance.kind]
    if in_features <= 0 or in_features % per:
        raise ValueError(
            f"in_features of {instance.kind} must be a positive multiple of {per}, "
            f"got {in_features}"
        )
    expected = (out_features, in_features // per * BLOCK_BYTES[instance.kind])
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != expected:
        raise ValueError(
            f"{instance.kind} blocks for shape {instance.shape} must be uint8 {expected}, "
            f"got {blocks.dtype} {tuple(blocks.shape)}"
        )


#: Bytes up to which a build-time copy of weight blocks (fusing parts, permuting rows,
#: packing a stacked weight; the kernels' interleave takes the same bound) runs on the calling
#: thread instead of torch's thread team. Why: every parallel region wakes the team, and where
#: the cores are busy with other work that costs a scheduler time slice per call: on this
#: 2-core VM at load ~12 a 1 MiB ``torch.cat`` took 40 ms on 2 threads and 0.05 ms on one,
#: and a SmolLM2 build's few hundred such copies 7.7 s against 0.9 s. One thread copies a
#: block this size in milliseconds, so nothing is lost where the cores are free.
SERIAL_COPY_BYTES = 32 << 20


def copy_blocks(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for same-shape uint8 blocks; on the calling thread up to
    ``SERIAL_COPY_BYTES`` on the CPU (numpy's single-threaded copy), else torch's."""
    if _serial(src):
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)


def _serial(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.numel() * t.element_size() <= SERIAL_COPY_BYTES


def _take_rows(blocks: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``blocks.index_select(0, index)`` (a new buffer from torch's allocator, so aligned as
    the kernels expect), on the calling thread up to ``SERIAL_COPY_BYTES``."""
    if not _serial(blocks):
        return blocks.index_select(0, index)
    picked = index.cpu().numpy()
    if picked.size and (picked.min() < 0 or picked.max() >= blocks.shape[0]):
        raise IndexError(f"row index out of range for {blocks.shape[0]} rows")
    rows = torch.empty((picked.size, blocks.shape[1]), dtype=blocks.dtype)
    np.take(blocks.numpy(), picked, axis=0, out=rows.numpy(), mode="clip")  # bounds checked
    return rows


@attrs.frozen(kw_only=True, eq=False)
class QuantizedWeight:
    """A ``[out, in]`` weight as ``out`` rows of ggml blocks (``blocks``: uint8 ``[out, bytes]``).

    Owns ``blocks``. ``dtype`` is the dtype it computes in (float32), so code that reads a
    weight's dtype (e.g. for RoPE tables) sees the activations' dtype.
    """

    kind: BlockKind = attrs.field(validator=attrs.validators.in_(BLOCK_KINDS))
    shape: tuple[int, int]
    blocks: torch.Tensor = attrs.field(validator=_check_blocks)
    layout: BlockLayout = attrs.field(default="ggml", validator=attrs.validators.in_(BLOCK_LAYOUTS))

    @property
    def kernel_type(self) -> int:
        """The type code the kernel ops take: the ggml type id, plus ``INTERLEAVED_TYPE``."""
        return GGML_TYPE[self.kind] + (INTERLEAVED_TYPE if self.layout == "interleaved" else 0)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def nbytes(self) -> int:
        """Bytes a full pass over the weight reads."""
        return int(self.blocks.numel())

    def select_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows at ``index`` (a row permutation or gather), still quantized."""
        rows = _take_rows(self.blocks, index)
        release_file_pages(self.blocks)  # a file view's pages: the copy replaces them
        return QuantizedWeight(
            kind=self.kind,
            shape=(int(index.numel()), self.shape[1]),
            blocks=rows,
            layout=self.layout,
        )

    def rows(self, start: int, count: int) -> QuantizedWeight:
        """Rows ``[start, start + count)`` as a view of the same blocks (no copy); only for a
        layout in ``ROW_LAYOUTS``."""
        if self.layout not in ROW_LAYOUTS:
            raise ValueError(f"the {self.layout} layout does not keep rows apart")
        if start < 0 or count <= 0 or start + count > self.shape[0]:
            raise ValueError(f"rows [{start}, {start + count}) of a weight of {self.shape[0]}")
        return QuantizedWeight(
            kind=self.kind,
            shape=(count, self.shape[1]),
            blocks=self.blocks[start : start + count],
            layout=self.layout,
        )

    def interleaved(self) -> QuantizedWeight:
        """This weight in the ``interleaved`` layout (a new buffer; itself when it is)."""
        if self.layout == "interleaved":
            return self
        if self.kind not in INTERLEAVABLE_KINDS:
            raise ValueError(
                f"the interleaved layout takes {list(INTERLEAVABLE_KINDS)}, not {self.kind}"
            )
        from llmrt.kernels.native import load_kernels

        load_kernels()
        blocks = torch.ops.llmrt_kernels.gguf_interleave(
            self.blocks, GGML_TYPE[self.kind], self.shape[1]
        )
        release_file_pages(self.blocks)
        return QuantizedWeight(
            kind=self.kind, shape=self.shape, blocks=blocks, layout="interleaved"
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[out, in]`` weight (the reference the kernels are checked against)."""
        from llmrt.kernels.native import load_kernels

        load_kernels()
        out: torch.Tensor = torch.ops.llmrt_kernels.gguf_dequantize(
            self.blocks, self.kernel_type, self.shape[1]
        )
        return out


#: A checkpoint tensor: float, or a linear weight kept in ggml blocks.
CheckpointTensor = torch.Tensor | QuantizedWeight


def dequantized(tensors: Mapping[str, CheckpointTensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every ``QuantizedWeight`` dequantized: the float32 reference."""
    return {
        name: t.dequantize() if isinstance(t, QuantizedWeight) else t for name, t in tensors.items()
    }


def concat_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one kind and width along ``out`` (fused q/k/v, gate/up)."""
    kinds = {p.kind for p in parts}
    widths = {p.shape[1] for p in parts}
    layouts = {p.layout for p in parts}
    if len(kinds) != 1 or len(widths) != 1 or len(layouts) != 1:
        raise ValueError(
            f"cannot fuse weights of kinds {sorted(kinds)} / widths {sorted(widths)} / "
            f"layouts {sorted(layouts)}"
        )
    if len(parts) == 1:
        return parts[0]
    rows = sum(p.shape[0] for p in parts)
    blocks = torch.empty(
        (rows, int(parts[0].blocks.shape[1])), dtype=torch.uint8, device=parts[0].device
    )
    offset = row = 0
    sources = []
    for p in parts:
        copy_blocks(blocks[row : row + p.shape[0]], p.blocks)
        sources.append(_moved_into(p.blocks, blocks, offset))
        offset += p.nbytes
        row += p.shape[0]
    _sweep(sources)
    return QuantizedWeight(
        kind=parts[0].kind, shape=(rows, parts[0].shape[1]), blocks=blocks, layout=parts[0].layout
    )


def _moved_into(part: torch.Tensor, whole: torch.Tensor, offset: int) -> torch.Tensor:
    """Rebind ``part`` (contiguous uint8 blocks, already copied into contiguous uint8
    ``whole`` at byte ``offset``) onto that copy, in place (``Tensor.set_``), so every
    holder of it reads the same bytes from the fused buffer. Why: the parts of a fused weight
    are a checkpoint's tensors (file views, and for llama's Q / K row-unpermuted copies); a
    checkpoint that kept them kept a second resident copy of every fused weight (a 3B
    Q4_K_M: 189 MiB of Q / K). A file view's pages are given back first (``file_pages``);
    returns a view of the old bytes for ``_sweep``."""
    source = part.view(part.shape)
    release_file_pages(part)
    part.set_(whole.untyped_storage(), offset, part.shape, part.stride())
    return source


def _sweep(sources: Sequence[torch.Tensor]) -> None:
    """Give back again the file pages of fused parts once all are copied. Why: copying the
    next part faults its first page in with the kernel's fault-around, which maps up to 16
    already cached pages before it, i.e. the tail of the part just given back; they stayed
    resident (~60 KiB per boundary, 8 of 12 runs of the file-pages test)."""
    for source in sources:
        release_file_pages(source, again=True)


def from_gguf_bytes(
    *, kind: BlockKind, shape: tuple[int, int], data: np.ndarray
) -> QuantizedWeight:
    """Wrap a GGUF tensor's raw bytes (``out`` rows of blocks) without dequantizing them."""
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(shape[0], -1)
    blocks = torch.from_numpy(raw.copy() if not raw.flags.writeable else raw)
    return QuantizedWeight(kind=kind, shape=shape, blocks=blocks)


def quantize(weight: torch.Tensor, *, kind: BlockKind, field: str) -> QuantizedWeight:
    """``weight`` ``[out, in]`` (float) in ``kind`` blocks, with ggml's rounding (gguf-py).

    ``in`` must be a multiple of the kind's block (``ConfigError`` naming ``field`` otherwise).
    gguf-py quantizes every 32-weight kind, ``f16`` and ``bf16``; not the K-quants.
    """
    per = BLOCK_WEIGHTS[kind]
    if weight.dim() != 2 or weight.shape[1] % per:
        raise ConfigError(
            field,
            kind,
            f"block quantization needs [out, in] weights with in a multiple of {per}, "
            f"not shape {tuple(weight.shape)}",
        )
    values = weight.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    raw = gguf_py.quants.quantize(values, gguf_py.GGMLQuantizationType(GGML_TYPE[kind]))
    return from_gguf_bytes(kind=kind, shape=(int(weight.shape[0]), int(weight.shape[1])), data=raw)


@attrs.frozen(kw_only=True, eq=False)
class StackedWeight:
    """A ``[out, in]`` weight whose row ranges are stored in different block kinds: a fused
    q/k/v or gate/up whose parts a quantizer stored differently (llama.cpp's mixes keep
    ``attn_v`` in more bits than ``attn_q``). Kept as its parts, each run by its own kernel,
    instead of a float32 copy. Owns nothing beyond ``parts``."""

    parts: tuple[QuantizedWeight, ...]

    def __attrs_post_init__(self) -> None:
        widths = {p.shape[1] for p in self.parts}
        if len(self.parts) < 2 or len(widths) != 1:
            raise ValueError(f"a stacked weight needs 2+ parts of one width, got {widths}")

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(p.kind for p in self.parts)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[out, in]`` weight."""
        return torch.cat([p.dequantize() for p in self.parts], dim=0)

    def packed(self) -> tuple[torch.Tensor, int, StackedWeight]:
        """The parts as one blob the kernels run in one call (``csrc/stacked.cpp``): the blob
        (uint8 ``[out, X]``), its kernel type, and this weight with its parts viewing the
        blob (so the parts' own buffers can be released: no second copy)."""
        parts = self.parts
        if len(parts) > STACKED_MAX_PARTS:
            raise ValueError(f"a stacked weight holds at most {STACKED_MAX_PARTS} parts")
        header = 16 + 32 * len(parts)
        offsets, at = [], -(-header // 64) * 64
        for p in parts:
            offsets.append(at)
            at += -(-p.nbytes // 64) * 64
        rows = self.shape[0]
        width = -(-at // rows)
        code = STACKED_TYPE
        fields = [STACKED_MAGIC, len(parts)]
        for i, (p, offset) in enumerate(zip(parts, offsets, strict=True)):
            code |= p.kernel_type << (16 + 10 * i)
            fields += [p.kernel_type, p.shape[0], int(p.blocks.shape[1]), offset]
        head = torch.tensor(fields, dtype=torch.int64).view(torch.uint8)
        done = self._blob(offsets=offsets, shape=(rows, width), head=head)
        if done is not None:
            return done, code, self
        blob = torch.empty(rows, width, dtype=torch.uint8)
        blob.numpy().fill(0)  # on this thread: see SERIAL_COPY_BYTES
        flat = blob.view(-1)
        views, sources = [], []
        for p, offset in zip(parts, offsets, strict=True):
            row_bytes = int(p.blocks.shape[1])
            # Made with set_, not by slicing: a slice is an autograd view that holds ``blob``
            # itself as its base, and rebinding it later (the weight placement's set_) keeps
            # that base, so the whole blob stayed resident beside its placed copy.
            view = torch.empty(0, dtype=torch.uint8).set_(
                blob.untyped_storage(), offset, (p.shape[0], row_bytes), (row_bytes, 1)
            )
            copy_blocks(view, p.blocks)
            sources.append(_moved_into(p.blocks, blob, offset))
            views.append(attrs.evolve(p, blocks=view))
        _sweep(sources)
        copy_blocks(flat[:header], head)
        return blob, code, StackedWeight(parts=tuple(views))

    def _blob(
        self, *, offsets: list[int], shape: tuple[int, int], head: torch.Tensor
    ) -> torch.Tensor | None:
        """The blob the parts already view when they are packed as ``packed`` would pack
        them (``shape`` bytes of one storage, each part at its offset, the header written),
        else None: packing packed parts copies nothing. The blob may lie inside a larger
        storage: the weight placement (``device.huge_pages``) moves every storage of a model
        into one mapping, and a second blob made there doubled the fused weight's bytes."""
        if self.parts[0].device.type != "cpu":
            return None
        storage = self.parts[0].blocks.untyped_storage()
        start = self.parts[0].blocks.data_ptr() - offsets[0]  # where the blob would begin
        begin = start - storage.data_ptr()
        if begin < 0 or begin + shape[0] * shape[1] > storage.nbytes():
            return None
        for p, offset in zip(self.parts, offsets, strict=True):
            if (
                p.blocks.untyped_storage().data_ptr() != storage.data_ptr()
                or p.blocks.data_ptr() != start + offset
            ):
                return None
        blob = torch.empty(0, dtype=torch.uint8).set_(storage, begin, shape, (shape[1], 1))
        return blob if torch.equal(blob.view(-1)[: head.numel()], head) else None
