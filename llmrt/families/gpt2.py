"""The GPT-2 family: learned absolute positions, LayerNorm, fused q/k/v, plain GELU MLP and
biases everywhere, as a mapping onto decoder parts.

HF GPT-2 stores its projections as ``Conv1D`` weights ``[in, out]`` (``TensorNames.
transposed``); the decoder transposes them once at load so every matmul is a plain linear.
"""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec
from llmrt.families.renames import BaseModelPrefix

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
#: GPT-2 switches no part computes (per-layer score scaling, upcast attention, cross-attention).
UNSUPPORTED = ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention")
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
    hfparts.reject_flags(cfg, UNSUPPORTED)
    names = {**ALIASES, "num_key_value_heads": None}  # no grouped K/V heads
    model = hfparts.read_common(cfg, family="gpt2", dtype=dtype, names=names)
    scale = model.head_dim**-0.5 if cfg.flag("scale_attn_weights", True) else 1.0
    spec = DecoderSpec(
        model=model,
        attention=hfparts.attention(model, scale=scale, qkv_bias=True, o_bias=True),
        mlp=MLPSpec(
            kind="plain",
            activation=hfparts.activation(cfg, "activation_function", "gelu_new"),
            intermediate_size=cfg.positive_int("n_inner", 4 * model.hidden_size),
            bias=True,
        ),
        norm=NormSpec(kind="layer", eps=cfg.positive_float("layer_norm_epsilon", 1e-5), bias=True),
        layers=tuple(LayerSpec(rope=None) for _ in range(model.num_layers)),
        positions="learned",
        tie_word_embeddings=cfg.flag("tie_word_embeddings", True),
    )
    return spec, NAMES


#: The family the registry serves under ``gpt2``.
FAMILY = DecoderFamily(
    name="gpt2",
    architectures=("GPT2LMHeadModel",),
    model_types=MODEL_TYPES,
    read=read,
    required_keys=REQUIRED_KEYS,
    ignored_suffixes=IGNORED_SUFFIXES,
    rename=BaseModelPrefix("transformer."),
)
