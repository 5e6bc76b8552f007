"""The GPT-2 family: learned absolute positions, LayerNorm, fused q/k/v, plain GELU MLP and
biases everywhere, as a mapping onto decoder parts.

HF GPT-2 stores its projections as ``Conv1D`` weights ``[in, out]`` (``TensorNames.
transposed``); the decoder transposes them once at load so every matmul is a plain linear.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from llmrt.errors import CheckpointError
from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.gguf_architecture import GGUFArchitecture, metadata_field, token_ids, vocab_size
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec
from llmrt.kernels.formats import CheckpointTensor

MODEL_TYPES: tuple[str, ...] = ("gpt2",)
#: transformers' ``GPT2Config.attribute_map``: the standard names win where both are given.
ALIASES = {
    "hidden_size": "n_embd",
    "max_position_embeddings": "n_positions",
    "num_attention_heads": "n_head",
    "num_hidden_layers": "n_layer",
}
REQUIRED_KEYS: tuple[str, ...] = ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions")
IGNORED_SUFFIXES: tuple[str, ...] = (".attn.bias", ".attn.masked_bias")
GELU_ACTIVATIONS: tuple[str, ...] = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu")
NAMES = TensorNames(
    embed="transformer.wte.weight",
    positions="transformer.wpe.weight",
    final_norm="transformer.ln_f",
    layer="transformer.h.{i}.",
    attn_norm="ln_1",
    mlp_norm="ln_2",
    qkv="attn.c_attn",
    o="attn.c_proj",
    up="mlp.c_fc",
    down="mlp.c_proj",
    transposed=True,
)


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a GPT-2 ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    hfparts.reject_common(cfg)
    cfg = hfparts.with_aliases(cfg, ALIASES)
    hidden = cfg.positive_int("n_embd")
    heads = cfg.positive_int("n_head")
    if hidden % heads:
        raise CheckpointError("config.n_head", f"must divide n_embd={hidden}, got {heads}")
    activation = cfg.text("activation_function", "gelu_new")
    cfg.reject_if(
        "activation_function",
        present=activation not in GELU_ACTIVATIONS,
        reason=f"unsupported activation (supported: {', '.join(GELU_ACTIVATIONS)})",
    )
    cfg.reject_if(
        "scale_attn_by_inverse_layer_idx",
        present=cfg.flag("scale_attn_by_inverse_layer_idx", False),
        reason="per-layer attention scaling is unsupported",
    )
    cfg.reject_if(
        "reorder_and_upcast_attn",
        present=cfg.flag("reorder_and_upcast_attn", False),
        reason="reordered, upcast attention is unsupported",
    )
    cfg.reject_if(
        "add_cross_attention",
        present=cfg.flag("add_cross_attention", False),
        reason="cross-attention is unsupported",
    )
    head_dim = hidden // heads
    model = hfparts.model_config(
        cfg,
        family="gpt2",
        dtype=dtype,
        hidden=hidden,
        heads=(heads, heads, head_dim),
        layers_key="n_layer",
        positions_key="n_positions",
    )
    spec = DecoderSpec(
        model=model,
        attention=hfparts.attention(
            model,
            scale=head_dim**-0.5 if cfg.flag("scale_attn_weights", True) else 1.0,
            qkv_bias=True,
            o_bias=True,
        ),
        mlp=MLPSpec(
            kind="plain",
            activation=hfparts.activation(cfg, "activation_function", "gelu_new"),
            intermediate_size=cfg.positive_int("n_inner", 4 * hidden),
            bias=True,
        ),
        norm=NormSpec(kind="layer", eps=cfg.positive_float("layer_norm_epsilon", 1e-5), bias=True),
        layers=tuple(LayerSpec(rope=None) for _ in range(model.num_layers)),
        positions="learned",
        tie_word_embeddings=cfg.flag("tie_word_embeddings", True),
    )
    return spec, NAMES


def canonical_names(
    tensors: Mapping[str, CheckpointTensor],
    *,
    expected: Mapping[str, tuple[int, ...]],
    config: Mapping[str, Any],
) -> dict[str, CheckpointTensor]:
    """Map bare ``GPT2Model`` names (``h.0.attn...``, as in the original hub files) to the
    ``transformer.``-prefixed ones in ``expected``; every other name passes through."""
    renamed: dict[str, CheckpointTensor] = {}
    for name, tensor in tensors.items():
        prefixed = f"transformer.{name}"
        key = prefixed if name not in expected and prefixed in expected else name
        if key in renamed:
            raise CheckpointError(name, f"duplicates {key} (both prefixed and bare names given)")
        renamed[key] = tensor
    return renamed


def _gguf_config(
    metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], item: str
) -> dict[str, Any]:
    """A llama.cpp ``gpt2`` GGUF's metadata as a GPT-2 ``config.json``."""
    hidden = int(metadata_field(metadata, "gpt2.embedding_length", item))
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size(metadata, shapes, "gpt2"),
        "n_embd": hidden,
        "n_layer": int(metadata_field(metadata, "gpt2.block_count", item)),
        "n_head": int(metadata_field(metadata, "gpt2.attention.head_count", item)),
        "n_positions": int(metadata_field(metadata, "gpt2.context_length", item)),
        "n_inner": int(metadata.get("gpt2.feed_forward_length") or 4 * hidden),
        "layer_norm_epsilon": float(
            metadata_field(metadata, "gpt2.attention.layer_norm_epsilon", item)
        ),
        "activation_function": "gelu_new",
        "tie_word_embeddings": "output.weight" not in shapes,
        **token_ids(metadata),
    }


_CONV1D = (".attn_qkv.weight", ".attn_output.weight", ".ffn_up.weight", ".ffn_down.weight")


def _gguf_convert(name: str, values: np.ndarray, hf_config: Mapping[str, Any]) -> np.ndarray:
    """GPT-2's Hugging Face projections are Conv1D (``[in, out]``); GGUF stores them as Linear."""
    return values.T if name.endswith(_CONV1D) else values


#: llama.cpp's ``gpt2`` architecture in Hugging Face form.
GGUF = GGUFArchitecture(
    name="gpt2",
    hf_config=_gguf_config,
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
    convert=_gguf_convert,
)

#: The family the registry serves under ``gpt2``.
FAMILY = DecoderFamily(
    name="gpt2",
    architectures=("GPT2LMHeadModel",),
    model_types=MODEL_TYPES,
    read=read,
    required_keys=REQUIRED_KEYS,
    ignored_suffixes=IGNORED_SUFFIXES,
    rename=canonical_names,
    gguf=GGUF,
)
