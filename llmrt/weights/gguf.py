"""GGUF checkpoints (llama.cpp's format), read into Hugging Face form.

`read_gguf` parses the file with the `gguf` package, dequantizes every tensor to float32,
renames llama.cpp tensors to Hugging Face parameter names, undoes llama.cpp's layout changes
(the rotary permutation of Q/K rows for llama, the Conv1D transpose for gpt2), and builds a
`config.json`-style dict and the tokenizer from the metadata. `load_gguf` puts a content-hashed
cache in front of it, so the (slow) dequantization happens once per file.

With `keep_quantized`, 2-D tensors in a block layout the kernels run (Q4_0, Q4_1, Q8_0) stay
quantized (`QuantizedWeight`, rows permuted like the float path); a tensor whose conversion
is not a row permutation (gpt2's transposed projections) is dequantized as before. That path
reads the file directly (no dequantization to cache).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from math import prod
from pathlib import Path
from types import MappingProxyType
from typing import Any

import attrs
import gguf as gguf_py
import numpy as np
import torch

from llmrt.errors import CheckpointError
from llmrt.kernels.formats import CheckpointTensor, QuantizedWeight, block_kind_of, from_gguf_bytes
from llmrt.weights.cache import CachedCheckpoint, CacheEntry, file_digest
from llmrt.weights.gguf_tokenizer import gguf_tokenizer
from llmrt.weights.tokenizer import Tokenizer

LOADER_VERSION = 1
"""Bump when the conversion changes, so cached entries of older conversions are not reused."""

_log = logging.getLogger(__name__)
_BLOCK = re.compile(r"blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)")


@attrs.frozen(kw_only=True)
class GGUFContents:
    """A GGUF file in Hugging Face form: config dict, float32 tensors, tokenizer (if any)."""

    hf_config: dict[str, Any]
    tensors: dict[str, CheckpointTensor]
    tokenizer: Tokenizer | None


@attrs.frozen(kw_only=True)
class Architecture:
    """How one `general.architecture` maps to Hugging Face: config, tensor names, layouts."""

    hf_config: Callable[[Mapping[str, Any], Mapping[str, tuple[int, ...]], str], dict[str, Any]]
    global_names: Mapping[str, str]
    block_names: Mapping[str, str]
    convert: Callable[[str, np.ndarray, Mapping[str, Any]], np.ndarray]

    def hf_name(self, gguf_name: str) -> str | None:
        """The Hugging Face parameter name for `gguf_name`, or None when it has none."""
        if gguf_name in self.global_names:
            return self.global_names[gguf_name]
        match = _BLOCK.fullmatch(gguf_name)
        if match is None or match.group(2) not in self.block_names:
            return None
        layer, part, kind = match.groups()
        return self.block_names[part].format(layer=layer) + "." + kind


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


def read_gguf(path: Path, *, keep_quantized: bool = False) -> GGUFContents:
    """Parse and dequantize the GGUF file at `path` (no cache); see the module doc for
    `keep_quantized`."""
    item = str(path)
    try:
        reader = gguf_py.GGUFReader(str(path))
        metadata = {name: field.contents() for name, field in reader.fields.items()}
    except Exception as exc:  # the reader raises ValueError/IndexError/... on damaged files
        raise CheckpointError(item, f"corrupt or unreadable GGUF file: {exc}") from exc
    arch_name = metadata.get("general.architecture")
    architecture = ARCHITECTURES.get(str(arch_name))
    if architecture is None:
        raise CheckpointError(
            f"{item}: general.architecture",
            f"unsupported GGUF architecture {arch_name!r}; supported: {sorted(ARCHITECTURES)}",
        )
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    hf_config = architecture.hf_config(metadata, shapes, item)
    tokenizer = gguf_tokenizer(metadata, item=item)
    tensors: dict[str, CheckpointTensor] = {}
    for tensor in reader.tensors:
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
    return GGUFContents(hf_config=hf_config, tensors=tensors, tokenizer=tokenizer)


def _quantized(
    tensor: gguf_py.ReaderTensor,
    architecture: Architecture,
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


def dequantize_tensor(
    tensor: gguf_py.ReaderTensor, *, shape: tuple[int, ...], item: str
) -> np.ndarray:
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


def _field(metadata: Mapping[str, Any], key: str, item: str) -> Any:
    value = metadata.get(key)
    if value is None:
        raise CheckpointError(f"{item}: {key}", "missing GGUF metadata field")
    return value


def _token_ids(metadata: Mapping[str, Any]) -> dict[str, int]:
    ids = {}
    for hf_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        if metadata.get(gguf_key) is not None:
            ids[hf_key] = int(metadata[gguf_key])
    return ids


def _vocab_size(
    metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], arch: str
) -> int:
    if metadata.get(f"{arch}.vocab_size") is not None:
        return int(metadata[f"{arch}.vocab_size"])
    if "token_embd.weight" in shapes:
        return shapes["token_embd.weight"][0]
    return len(metadata.get("tokenizer.ggml.tokens") or ())


def _reject_rope_scaling(metadata: Mapping[str, Any], arch: str, item: str) -> None:
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise CheckpointError(
            f"{item}: {arch}.rope.scaling.type", f"rope scaling {scaling!r} is not supported"
        )


def _llama_config(
    metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], item: str
) -> dict[str, Any]:
    hidden = int(_field(metadata, "llama.embedding_length", item))
    heads = int(_field(metadata, "llama.attention.head_count", item))
    kv_heads = int(metadata.get("llama.attention.head_count_kv") or heads)
    head_dim = int(metadata.get("llama.attention.key_length") or hidden // heads)
    rope_dim = metadata.get("llama.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise CheckpointError(
            f"{item}: llama.rope.dimension_count",
            f"partial rotary ({rope_dim} of head_dim {head_dim}) is not supported",
        )
    _reject_rope_scaling(metadata, "llama", item)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": _vocab_size(metadata, shapes, "llama"),
        "hidden_size": hidden,
        "intermediate_size": int(_field(metadata, "llama.feed_forward_length", item)),
        "num_hidden_layers": int(_field(metadata, "llama.block_count", item)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": int(_field(metadata, "llama.context_length", item)),
        "rope_theta": float(metadata.get("llama.rope.freq_base") or 10000.0),
        "rms_norm_eps": float(_field(metadata, "llama.attention.layer_norm_rms_epsilon", item)),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "mlp_bias": "blk.0.ffn_up.bias" in shapes,
        "tie_word_embeddings": "output.weight" not in shapes,
        **_token_ids(metadata),
    }


def _llama_convert(name: str, values: np.ndarray, hf_config: Mapping[str, Any]) -> np.ndarray:
    """Undo llama.cpp's interleaving of rotary halves in Q and K rows (weights and biases)."""
    if ".attn_q." in name:
        return _unpermute_rotary(values, heads=int(hf_config["num_attention_heads"]))
    if ".attn_k." in name:
        return _unpermute_rotary(values, heads=int(hf_config["num_key_value_heads"]))
    return values


def _unpermute_rotary(values: np.ndarray, *, heads: int) -> np.ndarray:
    half = values.shape[0] // heads // 2
    grouped = values.reshape(heads, half, 2, *values.shape[1:])
    return grouped.swapaxes(1, 2).reshape(values.shape)


def _gpt2_config(
    metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], item: str
) -> dict[str, Any]:
    hidden = int(_field(metadata, "gpt2.embedding_length", item))
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": _vocab_size(metadata, shapes, "gpt2"),
        "n_embd": hidden,
        "n_layer": int(_field(metadata, "gpt2.block_count", item)),
        "n_head": int(_field(metadata, "gpt2.attention.head_count", item)),
        "n_positions": int(_field(metadata, "gpt2.context_length", item)),
        "n_inner": int(metadata.get("gpt2.feed_forward_length") or 4 * hidden),
        "layer_norm_epsilon": float(_field(metadata, "gpt2.attention.layer_norm_epsilon", item)),
        "activation_function": "gelu_new",
        "tie_word_embeddings": "output.weight" not in shapes,
        **_token_ids(metadata),
    }


_GPT2_CONV1D = (".attn_qkv.weight", ".attn_output.weight", ".ffn_up.weight", ".ffn_down.weight")


def _gpt2_convert(name: str, values: np.ndarray, hf_config: Mapping[str, Any]) -> np.ndarray:
    """GPT-2's Hugging Face projections are Conv1D (`[in, out]`); GGUF stores them as Linear."""
    return values.T if name.endswith(_GPT2_CONV1D) else values


ARCHITECTURES: Mapping[str, Architecture] = MappingProxyType(
    {
        "llama": Architecture(
            hf_config=_llama_config,
            global_names=MappingProxyType(
                {
                    "token_embd.weight": "model.embed_tokens.weight",
                    "output_norm.weight": "model.norm.weight",
                    "output.weight": "lm_head.weight",
                }
            ),
            block_names=MappingProxyType(
                {
                    "attn_q": "model.layers.{layer}.self_attn.q_proj",
                    "attn_k": "model.layers.{layer}.self_attn.k_proj",
                    "attn_v": "model.layers.{layer}.self_attn.v_proj",
                    "attn_output": "model.layers.{layer}.self_attn.o_proj",
                    "ffn_gate": "model.layers.{layer}.mlp.gate_proj",
                    "ffn_up": "model.layers.{layer}.mlp.up_proj",
                    "ffn_down": "model.layers.{layer}.mlp.down_proj",
                    "attn_norm": "model.layers.{layer}.input_layernorm",
                    "ffn_norm": "model.layers.{layer}.post_attention_layernorm",
                }
            ),
            convert=_llama_convert,
        ),
        "gpt2": Architecture(
            hf_config=_gpt2_config,
            global_names=MappingProxyType(
                {
                    "token_embd.weight": "transformer.wte.weight",
                    "position_embd.weight": "transformer.wpe.weight",
                    "output_norm.weight": "transformer.ln_f.weight",
                    "output_norm.bias": "transformer.ln_f.bias",
                    "output.weight": "lm_head.weight",
                }
            ),
            block_names=MappingProxyType(
                {
                    "attn_norm": "transformer.h.{layer}.ln_1",
                    "attn_qkv": "transformer.h.{layer}.attn.c_attn",
                    "attn_output": "transformer.h.{layer}.attn.c_proj",
                    "ffn_norm": "transformer.h.{layer}.ln_2",
                    "ffn_up": "transformer.h.{layer}.mlp.c_fc",
                    "ffn_down": "transformer.h.{layer}.mlp.c_proj",
                }
            ),
            convert=_gpt2_convert,
        ),
    }
)
"""GGUF architectures llmrt reads, by `general.architecture`."""
