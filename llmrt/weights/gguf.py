"""GGUF checkpoints (llama.cpp's format), read into Hugging Face form.

`read_gguf` parses the file (`gguf_file.open_gguf`: one private mmap, the header read with
`struct`), dequantizes every tensor to float32 with the `gguf` package,
and, through the `GGUFArchitecture` the family reading that `general.architecture` declares
(found in the registry), renames llama.cpp tensors to Hugging Face parameter names, undoes
llama.cpp's layout changes (the rotary permutation of Q/K rows for llama, the Conv1D
transpose for gpt2) and builds a `config.json`-style dict; the tokenizer comes from the
metadata. `load_gguf` puts a content-hashed
cache in front of it, so the (slow) dequantization happens once per file.

With `keep_quantized`, 2-D tensors in a block layout the kernels run (Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16) stay quantized (`QuantizedWeight`, rows permuted like the
float path); a tensor whose conversion is not a row permutation (gpt2's transposed
projections) is dequantized as before, with a warning saying what it costs. That path reads
the file directly (no dequantization to cache); blocks kept as they are stay views of the
file's mapping (no copy; pages come from the page cache as the kernels touch them). A 2-D
tensor of a type the kernels do not run is a `CheckpointError` naming it and its type, unless
`requantize="q8_0"` (the recipe's `checkpoint.requantize`): then it is requantized once to
Q8_0 with a warning, and the blocks are cached beside the dequantized entries.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Mapping
from math import prod
from pathlib import Path
from typing import Any

import attrs
import gguf as gguf_py
import numpy as np
import torch

from llmrt.errors import CheckpointError
from llmrt.families.gguf_architecture import GGUFArchitecture
from llmrt.kernels.formats import (
    BLOCK_WEIGHTS,
    CheckpointTensor,
    QuantizedWeight,
    block_kind_of,
    from_gguf_bytes,
    quantize,
)
from llmrt.lifecycle.progress import progress
from llmrt.weights.cache import CachedCheckpoint, CacheEntry, file_digest
from llmrt.weights.gguf_architectures import header_config
from llmrt.weights.gguf_file import GGUFTensor, open_gguf
from llmrt.weights.gguf_tokenizer import gguf_tokenizer
from llmrt.weights.tokenizer import Tokenizer

LOADER_VERSION = 1
"""Bump when the conversion changes, so cached entries of older conversions are not reused."""
REQUANTIZE_VERSION = 1
"""The same for the cache of requantized blocks (``requantize``)."""
#: What ``requantize`` may name: the kind tensors without a kernel are requantized to.
REQUANTIZE_KINDS: tuple[str, ...] = ("q8_0",)

_log = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class GGUFContents:
    """A GGUF file in Hugging Face form: config dict, float32 tensors, tokenizer (if any)."""

    hf_config: dict[str, Any]
    tensors: dict[str, CheckpointTensor]
    tokenizer: Tokenizer | None
    #: The file's mapping, when tensors (``keep_quantized`` blocks) may view it.
    mapping: mmap.mmap | None = None


def load_gguf(
    *, path: Path, cache_dir: Path, keep_quantized: bool = False, requantize: str | None = None
) -> GGUFContents:
    """`read_gguf(path)`, served from / stored to the cache under `cache_dir`.

    `keep_quantized` reads the file directly, keeping block-quantized weights as they are;
    `requantize` (with it) is what a 2-D tensor of a type without a kernel becomes (see the
    module doc), cached under `cache_dir` by the file's content hash.
    """
    if not path.is_file():
        raise CheckpointError(str(path), "GGUF file not found")
    if requantize is not None and requantize not in REQUANTIZE_KINDS:
        raise CheckpointError(str(path), f"cannot requantize to {requantize!r}: {REQUANTIZE_KINDS}")
    if keep_quantized:
        if requantize is None:
            return read_gguf(path, keep_quantized=True)
        return _read_requantizing(path, cache_dir=cache_dir, kind=requantize)
    try:
        digest = file_digest(path, cache_dir=cache_dir)
    except OSError as exc:
        raise CheckpointError(str(path), f"cannot read GGUF file: {exc}") from exc
    entry = CacheEntry.for_digest(
        cache_dir=cache_dir, kind="gguf", digest=digest, version=LOADER_VERSION
    )
    cached = entry.read()
    if cached is not None:
        try:
            tokenizer = (
                None
                if cached.tokenizer_json is None
                else Tokenizer.from_json(cached.tokenizer_json, item=str(entry.tokenizer_path))
            )
        except CheckpointError as exc:
            _log.warning("discarding cache entry with a bad tokenizer: %s", exc)
        else:
            return GGUFContents(
                hf_config=cached.hf_config, tensors=dict(cached.tensors), tokenizer=tokenizer
            )
    contents = read_gguf(path)
    entry.write(
        CachedCheckpoint(
            hf_config=contents.hf_config,
            tensors={k: v for k, v in contents.tensors.items() if isinstance(v, torch.Tensor)},
            tokenizer_json=None if contents.tokenizer is None else contents.tokenizer.to_json(),
        )
    )
    return contents


def read_gguf_config(path: Path) -> dict[str, Any]:
    """The Hugging Face config of the GGUF file at `path`, from its header alone (no tensor
    data, no tokenizer): what `family: auto` needs to pick a family."""
    if not path.is_file():
        raise CheckpointError(str(path), "GGUF file not found")
    return header_config(open_gguf(path), item=str(path))[1]


def _read_requantizing(path: Path, *, cache_dir: Path, kind: str) -> GGUFContents:
    """`read_gguf(path, keep_quantized=True, requantize=kind)`, the requantized blocks read
    from / stored to their cache entry."""
    try:
        digest = file_digest(path, cache_dir=cache_dir)
    except OSError as exc:
        raise CheckpointError(str(path), f"cannot read GGUF file: {exc}") from exc
    entry = CacheEntry.for_digest(
        cache_dir=cache_dir, kind=f"gguf-{kind}", digest=digest, version=REQUANTIZE_VERSION
    )
    cached = entry.read()
    done: dict[str, torch.Tensor] = {} if cached is None else dict(cached.tensors)
    before = set(done)
    contents = read_gguf(path, keep_quantized=True, requantize=kind, requantized=done)
    if set(done) != before:
        entry.write(CachedCheckpoint(hf_config={}, tensors=done, tokenizer_json=None))
    return contents


def read_gguf(
    path: Path,
    *,
    keep_quantized: bool = False,
    requantize: str | None = None,
    requantized: dict[str, torch.Tensor] | None = None,
) -> GGUFContents:
    """Parse and dequantize the GGUF file at `path` (no cache); see the module doc for
    `keep_quantized` and `requantize`. `requantized` (GGUF name -> blocks) holds blocks
    requantized earlier, and receives the ones this call makes."""
    item = str(path)
    reader = open_gguf(path)
    metadata = reader.metadata
    architecture, hf_config = header_config(reader, item=item)
    arch_name = metadata["general.architecture"]
    shapes = {t.name: t.shape for t in reader.tensors}
    tokenizer = gguf_tokenizer(metadata, item=item)
    tensors: dict[str, CheckpointTensor] = {}
    verb = "reading" if keep_quantized else "dequantizing"
    stacked: list[GGUFTensor] = []  # quantized 3-D (expert) tensors dequantized
    for tensor in progress(reader.tensors, desc=f"{verb} {path.name}", unit="tensor"):
        if tensor.name in architecture.config_tensors:
            continue  # read into hf_config
        hf_name = architecture.hf_name(tensor.name)
        if hf_name is None:
            raise CheckpointError(
                f"{item}: {tensor.name}", f"no Hugging Face name for this {arch_name} tensor"
            )
        if keep_quantized:
            shape = shapes[tensor.name]
            where = f"{item}: {tensor.name}"
            kept: np.ndarray | None = None
            if len(shape) == 2 and _without_kernel(tensor, shape):
                kept = _requantized(
                    tensor, shape=shape, kind=requantize, item=where, done=requantized
                )
            blocks = _quantized(
                tensor, architecture, shape=shape, hf_config=hf_config, data=kept
            )
            if blocks is not None:
                tensors[hf_name] = blocks
                continue
            if len(shape) == 2 and tensor.tensor_type != gguf_py.GGMLQuantizationType.F32:
                _log.warning(
                    "%s: %s kept as float32 (%.1f MB): its conversion to Hugging Face layout "
                    "is not a row permutation",
                    where,
                    tensor.tensor_type.name,
                    4 * prod(shape) / 1e6,
                )
            elif len(shape) > 2 and tensor.tensor_type != gguf_py.GGMLQuantizationType.F32:
                stacked.append(tensor)
        values = dequantize_tensor(tensor, shape=shapes[tensor.name], item=f"{item}: {tensor.name}")
        converted = architecture.convert(tensor.name, values, hf_config)
        array = np.ascontiguousarray(converted, dtype=np.float32)
        tensors[hf_name] = torch.from_numpy(array if array.flags.writeable else array.copy())
    if stacked:
        _log.warning(
            "%s: %d stacked expert tensors (%s) dequantized to float32, %.1f MB from %.1f MB "
            "in the file: llmrt runs mixture-of-experts weights in float",
            item,
            len(stacked),
            ", ".join(sorted({t.tensor_type.name for t in stacked})),
            sum(4 * prod(t.shape) for t in stacked) / 1e6,
            sum(t.data.nbytes for t in stacked) / 1e6,
        )
    return GGUFContents(
        hf_config=hf_config,
        tensors=architecture.regroup(tensors, hf_config),
        tokenizer=tokenizer,
        mapping=reader.mapping if keep_quantized else None,
    )


def _without_kernel(tensor: GGUFTensor, shape: tuple[int, ...]) -> bool:
    """Whether a 2-D `tensor` is in a block type (or width) the kernels cannot run."""
    if tensor.tensor_type == gguf_py.GGMLQuantizationType.F32:
        return False
    kind = block_kind_of(int(tensor.tensor_type))
    return kind is None or shape[1] % BLOCK_WEIGHTS[kind] != 0


def _requantized(
    tensor: GGUFTensor,
    *,
    shape: tuple[int, ...],
    kind: str | None,
    item: str,
    done: dict[str, torch.Tensor] | None,
) -> np.ndarray:
    """`tensor`'s values requantized to `kind` blocks (GGUF row order), or the
    `CheckpointError` naming the tensor and its type when `kind` is None."""
    type_name = tensor.tensor_type.name
    if kind is None:
        raise CheckpointError(
            item,
            f"GGUF type {type_name} (shape {list(shape)}) has no llmrt kernel; kernels run "
            "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16 and F32. Set "
            "checkpoint.requantize=q8_0 to requantize such tensors once at load, or use a "
            "float checkpoint.weights",
        )
    cached = None if done is None else done.get(tensor.name)
    if cached is not None:
        return cached.numpy()
    start = time.perf_counter()
    values = dequantize_tensor(tensor, shape=shape, item=item)
    blocks = quantize(torch.from_numpy(values), kind=kind, field="checkpoint.requantize")  # type: ignore[arg-type]
    _log.warning(
        "%s: GGUF type %s has no llmrt kernel; requantized to %s (%.1f -> %.1f MB, %.1f s, "
        "once: cached; a second rounding of every weight)",
        item,
        type_name,
        kind.upper(),
        tensor.data.nbytes / 1e6,
        blocks.nbytes / 1e6,
        time.perf_counter() - start,
    )
    if done is not None:
        done[tensor.name] = blocks.blocks
    return blocks.blocks.numpy()


def _quantized(
    tensor: GGUFTensor,
    architecture: GGUFArchitecture,
    *,
    shape: tuple[int, ...],
    hf_config: Mapping[str, Any],
    data: np.ndarray | None = None,
) -> QuantizedWeight | None:
    """`tensor` kept in its blocks (or `data`: its Q8_0 requantization), rows in Hugging Face
    order; None when it cannot stay so."""
    kind = "q8_0" if data is not None else block_kind_of(int(tensor.tensor_type))
    if kind is None or len(shape) != 2 or shape[1] % BLOCK_WEIGHTS[kind]:
        return None
    rows = np.arange(shape[0]).reshape(shape[0], 1)
    order = architecture.convert(tensor.name, rows, hf_config)
    if order.shape != rows.shape:
        return None
    weight = from_gguf_bytes(
        kind=kind, shape=(shape[0], shape[1]), data=tensor.data if data is None else data
    )
    if np.array_equal(order, rows):
        return weight
    return weight.select_rows(torch.from_numpy(np.ascontiguousarray(order.reshape(-1))))


def dequantize_tensor(tensor: GGUFTensor, *, shape: tuple[int, ...], item: str) -> np.ndarray:
    """`tensor` as a float32 array of `shape` (torch order: GGUF's dims reversed)."""
    try:
        values = gguf_py.quants.dequantize(tensor.data, tensor.tensor_type)
    except Exception as exc:  # truncated data or an unknown quantization
        raise CheckpointError(
            item, f"cannot dequantize {tensor.tensor_type.name} data: {exc}"
        ) from exc
    if values.size != prod(shape):
        reason = f"holds {values.size} values, expected {prod(shape)} for shape {shape}"
        raise CheckpointError(item, reason)
    return np.asarray(values, dtype=np.float32).reshape(shape)
