"""The GPT-NeoX family (Pythia, GPT-NeoX-20B): LayerNorm with bias, per-head interleaved
fused q/k/v, partial rotary, plain GELU MLP with biases and the parallel residual."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from llmrt.errors import CheckpointError
from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec
from llmrt.kernels.formats import CheckpointTensor

MODEL_TYPES: tuple[str, ...] = ("gpt_neox",)
NAMES = TensorNames(
    embed="gpt_neox.embed_in.weight",
    final_norm="gpt_neox.final_layer_norm",
    layer="gpt_neox.layers.{i}.",
    attn_norm="input_layernorm",
    mlp_norm="post_attention_layernorm",
    qkv="attention.query_key_value",
    qkv_interleaved=True,
    o="attention.dense",
    up="mlp.dense_h_to_4h",
    down="mlp.dense_4h_to_h",
)
#: Buffers older checkpoints carry (causal masks, rotary tables).
IGNORED_SUFFIXES: tuple[str, ...] = (
    ".attention.bias",
    ".attention.masked_bias",
    ".rotary_emb.inv_freq",
)


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a GPT-NeoX ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    hfparts.reject_common(cfg)
    hidden = cfg.positive_int("hidden_size")
    heads = cfg.positive_int("num_attention_heads")
    if hidden % heads:
        raise CheckpointError(
            "config.num_attention_heads", f"must divide hidden_size={hidden}, got {heads}"
        )
    geometry = (heads, heads, hidden // heads)
    model = hfparts.model_config(cfg, family="gpt_neox", dtype=dtype, hidden=hidden, heads=geometry)
    bias = cfg.flag("attention_bias", True)
    parallel = cfg.flag("use_parallel_residual", True)
    if "rotary_pct" in cfg.raw and "partial_rotary_factor" not in cfg.raw:
        cfg = HFConfig(raw={**cfg.raw, "partial_rotary_factor": cfg.raw["rotary_pct"]})
    if "rotary_emb_base" in cfg.raw and "rope_theta" not in cfg.raw:
        cfg = HFConfig(raw={**cfg.raw, "rope_theta": cfg.raw["rotary_emb_base"]})
    spec = DecoderSpec(
        model=model,
        attention=hfparts.attention(
            model,
            qkv_bias=bias,
            o_bias=bias,
        ),
        mlp=MLPSpec(
            kind="plain",
            activation=hfparts.activation(cfg, "hidden_act", "gelu"),
            intermediate_size=cfg.positive_int("intermediate_size"),
            bias=True,
        ),
        norm=NormSpec(kind="layer", eps=cfg.positive_float("layer_norm_eps", 1e-5), bias=True),
        layers=tuple(LayerSpec() for _ in range(model.num_layers)),
        residual="parallel" if parallel else "sequential",
        ropes=(hfparts.rope(cfg, model, partial=True, partial_default=0.25),),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
    )
    return spec, NAMES


def canonical_names(
    tensors: Mapping[str, CheckpointTensor],
    *,
    expected: Mapping[str, tuple[int, ...]],
    config: Mapping[str, Any],
) -> dict[str, CheckpointTensor]:
    """Older checkpoints name the LM head ``embed_out``; map it onto ``lm_head``."""
    renamed = dict(tensors)
    if "embed_out.weight" in renamed:
        if "lm_head.weight" in renamed:
            raise CheckpointError("embed_out.weight", "duplicates lm_head.weight")
        renamed["lm_head.weight"] = renamed.pop("embed_out.weight")
    return renamed


#: The family the registry serves under ``gpt_neox``.
FAMILY = DecoderFamily(
    name="gpt_neox",
    architectures=("GPTNeoXForCausalLM",),
    model_types=MODEL_TYPES,
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=IGNORED_SUFFIXES,
    rename=canonical_names,
)
