"""The GPT-NeoX family (Pythia, GPT-NeoX-20B): LayerNorm with bias, per-head interleaved
fused q/k/v, partial rotary, plain GELU MLP with biases and the parallel residual."""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec
from llmrt.families.renames import LegacyNames

MODEL_TYPES: tuple[str, ...] = ("gpt_neox",)
NAMES = TensorNames(
    embed="gpt_neox.embed_in.weight",
    final_norm="gpt_neox.final_layer_norm",
    layer="gpt_neox.layers.{i}.",
    qkv="attention.query_key_value",
    qkv_interleaved=True,
    o="attention.dense",
    up="mlp.dense_h_to_4h",
    down="mlp.dense_4h_to_h",
)
#: transformers' current key -> the name older GPT-NeoX configs use for it.
LEGACY_KEYS = {"partial_rotary_factor": "rotary_pct", "rope_theta": "rotary_emb_base"}
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
    heads = hfparts.head_geometry(cfg, hidden=hidden, kv_key=None)  # no grouped KV heads
    model = hfparts.model_config(cfg, family="gpt_neox", dtype=dtype, hidden=hidden, heads=heads)
    bias = cfg.flag("attention_bias", True)
    parallel = cfg.flag("use_parallel_residual", True)
    # Older configs' names for the rotary share and base (the current names win).
    legacy = {new: cfg.raw[old] for new, old in LEGACY_KEYS.items() if old in cfg.raw}
    cfg = HFConfig(raw={**legacy, **cfg.raw})
    spec = DecoderSpec(
        model=model,
        attention=hfparts.attention(model, qkv_bias=bias, o_bias=bias),
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


#: The family the registry serves under ``gpt_neox``.
FAMILY = DecoderFamily(
    name="gpt_neox",
    architectures=("GPTNeoXForCausalLM",),
    model_types=MODEL_TYPES,
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=IGNORED_SUFFIXES,
    rename=LegacyNames({"embed_out.weight": "lm_head.weight"}),
)
