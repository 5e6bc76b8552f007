"""How GGUF files of one ``general.architecture`` are read in Hugging Face form (config from
the metadata, tensor names, llama.cpp's layout changes undone).

llmrt's own map of llama.cpp's architectures is a data table in the weights layer
(``llmrt.weights.gguf_architectures``); a package's family that reads another declares its
``GGUFArchitecture`` (``DecoderFamily.gguf``), which the GGUF loader finds through the
registry. The metadata helpers and layout converters here are shared by both.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np
import torch

from llmrt.errors import CheckpointError

_BLOCK = re.compile(r"blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)")

#: ``hf_config(metadata, shapes, item)``: the ``config.json`` dict (``item`` names the file).
ConfigReader = Callable[[Mapping[str, Any], Mapping[str, tuple[int, ...]], str], dict[str, Any]]
#: ``convert(gguf_name, values, hf_config)``: the tensor in Hugging Face layout (a row
#: permutation where it can be, so quantized blocks can stay quantized).
Converter = Callable[[str, np.ndarray, Mapping[str, Any]], np.ndarray]
#: ``regroup(tensors, hf_config)``: the whole named tensor set after ``convert``, with the
#: tensors llama.cpp merged or split regrouped the Hugging Face way (stacked experts' gate
#: and up joined into ``gate_up_proj``, stacked per-head norms split per head).
Regrouper = Callable[[dict[str, Any], Mapping[str, Any]], dict[str, Any]]


def keep_layout(name: str, values: np.ndarray, hf_config: Mapping[str, Any]) -> np.ndarray:
    """The converter of an architecture whose GGUF tensors are already in HF layout."""
    return values


def keep_groups(tensors: dict[str, Any], hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The regrouper of an architecture whose GGUF tensors map one to one onto HF's."""
    return tensors


@attrs.frozen(kw_only=True)
class GGUFArchitecture:
    """How one GGUF ``general.architecture`` (``name``) maps to Hugging Face.

    ``global_names`` maps whole GGUF tensor names; ``block_names`` maps the part of a
    ``blk.N.<part>.weight|bias`` name to an HF prefix with ``{layer}``. ``config_tensors``
    names small tensors that are configuration, not weights (Phi-3's LongRoPE factors):
    ``hf_config`` finds their values in ``metadata`` under their tensor names, and they are
    not loaded as weights. ``model_types`` are the ``model_type`` values its configs state
    (the families claiming them run its files; README's family table lists them).
    """

    name: str
    hf_config: ConfigReader
    global_names: Mapping[str, str]
    block_names: Mapping[str, str]
    convert: Converter = keep_layout
    regroup: Regrouper = keep_groups
    config_tensors: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()

    def hf_name(self, gguf_name: str) -> str | None:
        """The Hugging Face parameter name for ``gguf_name``, or None when it has none."""
        if gguf_name in self.global_names:
            return self.global_names[gguf_name]
        match = _BLOCK.fullmatch(gguf_name)
        if match is None or match.group(2) not in self.block_names:
            return None
        layer, part, kind = match.groups()
        return self.block_names[part].format(layer=layer) + "." + kind


#: llama.cpp's stacked expert tensors (and router) by block part, under intermediate HF names
#: that ``join_stacked_experts`` turns into the fused ones.
STACKED_EXPERTS: Mapping[str, str] = {
    "ffn_gate_inp": "model.layers.{layer}.mlp.gate",
    "ffn_gate_exps": "model.layers.{layer}.mlp.experts.gate_proj",
    "ffn_up_exps": "model.layers.{layer}.mlp.experts.up_proj",
    "ffn_down_exps": "model.layers.{layer}.mlp.experts.down_proj",
}


def join_stacked_experts(tensors: dict[str, Any], hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """A ``regroup``: llama.cpp stacks each layer's experts into ``ffn_{gate,up,down}_exps``
    (Mixtral, Qwen-MoE); Hugging Face (transformers 5) keeps ``mlp.experts.gate_up_proj``
    ``[experts, 2 * inter, hidden]`` (gate rows first) and ``mlp.experts.down_proj``, without
    a ``.weight`` suffix."""
    out = dict(tensors)
    for gate_name in [n for n in tensors if n.endswith(".mlp.experts.gate_proj.weight")]:
        layer = gate_name.removesuffix("gate_proj.weight")
        up = out.pop(f"{layer}up_proj.weight")
        out[f"{layer}gate_up_proj"] = torch.cat([out.pop(gate_name), up], dim=1).contiguous()
        out[f"{layer}down_proj"] = out.pop(f"{layer}down_proj.weight")
    return out


def metadata_field(metadata: Mapping[str, Any], key: str, item: str) -> Any:
    """A required metadata value (``CheckpointError`` naming file and key when missing)."""
    value = metadata.get(key)
    if value is None:
        raise CheckpointError(f"{item}: {key}", "missing GGUF metadata field")
    return value


def token_ids(metadata: Mapping[str, Any]) -> dict[str, int]:
    """bos/eos/pad token ids the metadata gives, under their ``config.json`` keys."""
    ids = {}
    for hf_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        if metadata.get(gguf_key) is not None:
            ids[hf_key] = int(metadata[gguf_key])
    return ids


def vocab_size(
    metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], arch: str
) -> int:
    """``<arch>.vocab_size``, else the embedding's rows, else the tokenizer's size."""
    if metadata.get(f"{arch}.vocab_size") is not None:
        return int(metadata[f"{arch}.vocab_size"])
    if "token_embd.weight" in shapes:
        return shapes["token_embd.weight"][0]
    return len(metadata.get("tokenizer.ggml.tokens") or ())


def reject_rope_scaling(metadata: Mapping[str, Any], arch: str, item: str) -> None:
    """``CheckpointError`` for a RoPE scaling the GGUF mapping does not translate."""
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise CheckpointError(
            f"{item}: {arch}.rope.scaling.type", f"rope scaling {scaling!r} is not supported"
        )


def unpermute_rotary(values: np.ndarray, *, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of the rotary halves in Q/K rows (weights or biases)."""
    half = values.shape[0] // heads // 2
    grouped = values.reshape(heads, half, 2, *values.shape[1:])
    return grouped.swapaxes(1, 2).reshape(values.shape)


def unpermute_qk(name: str, values: np.ndarray, hf_config: Mapping[str, Any]) -> np.ndarray:
    """A ``convert`` for llama-derived files: undo llama.cpp's interleaving of the rotary halves
    in the Q and K rows (weights and biases), by the config's head counts."""
    if ".attn_q." in name:
        return unpermute_rotary(values, heads=int(hf_config["num_attention_heads"]))
    if ".attn_k." in name:
        return unpermute_rotary(values, heads=int(hf_config["num_key_value_heads"]))
    return values
