"""GGUF checkpoints (llama.cpp's format), read into Hugging Face form.

`read_gguf` parses the file (`gguf_file.open_gguf`: one private mmap, the header read with
`struct`), dequantizes every tensor to float32 with the `gguf` package,
and, through the `GGUFArchitecture` the family reading that `general.architecture` declares
(found in the registry), renames llama.cpp tensors to Hugging Face parameter names, undoes
llama.cpp's layout changes (the rotary permutation of Q/K rows for llama, the Conv1D
transpose for gpt2) and builds a `config.json`-style dict; the tokenizer comes from the
metadata. `load_gguf` puts a content-hashed
cache in front of it, so the (slow) dequantization happens once per file.

With `keep_quantized`, 2-D tensors in a block layout the kernels run (Q4_0, Q4_1, Q8_0) stay
quantized (`QuantizedWeight`, rows permuted like the float path); a tensor whose conversion
is not a row permutation (gpt2's transposed projections) is dequantized as before. That path
reads the file directly (no dequantization to cache); blocks kept as they are stay views of
the file's mapping (no copy; pages come from the page cache as the kernels touch them).
"""

from __future__ import annotations

import logging
import mmap
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
from llmrt.kernels.formats import CheckpointTensor, QuantizedWeight, block_kind_of, from_gguf_bytes
from llmrt.lifecycle.progress import progress
from llmrt.weights.cache import CachedCheckpoint, CacheEntry, file_digest
from llmrt.weights.gguf_architectures import architecture_for
from llmrt.weights.gguf_file import GGUFTensor, open_gguf
from llmrt.weights.gguf_tokenizer import gguf_tokenizer
from llmrt.weights.tokenizer import Tokenizer

LOADER_VERSION = 1
"""Bump when the conversion changes, so cached entries of older conversions are not reused."""

_log = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class GGUFContents:
    """A GGUF file in Hugging Face form: config dict, float32 tensors, tokenizer (if any)."""

    hf_config: dict[str, Any]
    tensors: dict[str, CheckpointTensor]
    tokenizer: Tokenizer | None
    #: The file's mapping, when tensors (``keep_quantized`` blocks) may view it.
    mapping: mmap.mmap | None = None


def load_gguf(*, path: Path, cache_dir: Path, keep_quantized: bool = False) -> GGUFContents:
    """`read_gguf(path)`, served from / stored to the cache under `cache_dir`.

    `keep_quantized` reads the file directly, keeping block-quantized weights as they are.
    """
    if not path.is_file():
        raise CheckpointError(str(path), "GGUF file not found")
    if keep_quantized:
        return read_gguf(path, keep_quantized=True)
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
    reader = open_gguf(path)
    architecture = _architecture(reader.metadata, str(path))
    shapes = {t.name: t.shape for t in reader.tensors}
    return architecture.hf_config(reader.metadata, shapes, str(path))


def _architecture(metadata: Mapping[str, Any], item: str) -> GGUFArchitecture:
    return architecture_for(str(metadata.get("general.architecture")), item=item)


def read_gguf(path: Path, *, keep_quantized: bool = False) -> GGUFContents:
    """Parse and dequantize the GGUF file at `path` (no cache); see the module doc for
    `keep_quantized`."""
    item = str(path)
    reader = open_gguf(path)
    metadata = reader.metadata
    architecture = _architecture(metadata, item)
    arch_name = metadata["general.architecture"]
    shapes = {t.name: t.shape for t in reader.tensors}
    hf_config = architecture.hf_config(metadata, shapes, item)
    tokenizer = gguf_tokenizer(metadata, item=item)
    tensors: dict[str, CheckpointTensor] = {}
    verb = "reading" if keep_quantized else "dequantizing"
    for tensor in progress(reader.tensors, desc=f"{verb} {path.name}", unit="tensor"):
        hf_name = architecture.hf_name(tensor.name)
        if hf_name is None:
            raise CheckpointError(
                f"{item}: {tensor.name}", f"no Hugging Face name for this {arch_name} tensor"
            )
        if keep_quantized:
            blocks = _quantized(
                tensor, architecture, shape=shapes[tensor.name], hf_config=hf_config
            )
            if blocks is not None:
                tensors[hf_name] = blocks
                continue
        values = dequantize_tensor(tensor, shape=shapes[tensor.name], item=f"{item}: {tensor.name}")
        converted = architecture.convert(tensor.name, values, hf_config)
        array = np.ascontiguousarray(converted, dtype=np.float32)
        tensors[hf_name] = torch.from_numpy(array if array.flags.writeable else array.copy())
    return GGUFContents(
        hf_config=hf_config,
        tensors=tensors,
        tokenizer=tokenizer,
        mapping=reader.mapping if keep_quantized else None,
    )


def _quantized(
    tensor: GGUFTensor,
    architecture: GGUFArchitecture,
    *,
    shape: tuple[int, ...],
    hf_config: Mapping[str, Any],
) -> QuantizedWeight | None:
    """`tensor` kept in its blocks, rows in Hugging Face order; None when it cannot stay so."""
    kind = block_kind_of(int(tensor.tensor_type))
    if kind is None or len(shape) != 2 or shape[1] % 32:
        return None
    rows = np.arange(shape[0]).reshape(shape[0], 1)
    order = architecture.convert(tensor.name, rows, hf_config)
    if order.shape != rows.shape:
        return None
    weight = from_gguf_bytes(kind=kind, shape=(shape[0], shape[1]), data=tensor.data)
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
