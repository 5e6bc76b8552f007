"""The StarCoder2 family: LayerNorm with bias, biased projections, plain GELU MLP and a
sliding window over every layer, as a mapping onto decoder parts."""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import AttentionSpec, DecoderSpec, LayerSpec, MLPSpec, NormSpec

MODEL_TYPES: tuple[str, ...] = ("starcoder2",)
REQUIRED_KEYS: tuple[str, ...] = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
)


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a StarCoder2 ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    hfparts.reject_common(cfg)
    hidden = cfg.positive_int("hidden_size")
    heads = hfparts.head_geometry(cfg, hidden=hidden)
    model = hfparts.model_config(cfg, family="starcoder2", dtype=dtype, hidden=hidden, heads=heads)
    num_heads, kv_heads, head_dim = heads
    bias = cfg.flag("use_bias", True)
    window = hfparts.window_size(cfg)
    spec = DecoderSpec(
        model=model,
        attention=AttentionSpec(
            num_heads=num_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            scale=head_dim**-0.5,
            qkv_bias=bias,
            o_bias=bias,
        ),
        mlp=MLPSpec(
            kind="plain",
            activation=hfparts.activation(cfg, "hidden_act", "gelu_pytorch_tanh"),
            intermediate_size=cfg.positive_int("intermediate_size"),
            bias=bias,
        ),
        norm=NormSpec(kind="layer", eps=cfg.positive_float("norm_epsilon", 1e-5), bias=True),
        layers=tuple(LayerSpec(window=window) for _ in range(model.num_layers)),
        ropes=(hfparts.rope(cfg, head_dim=head_dim, max_positions=model.max_position_embeddings),),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", True),
    )
    return spec, TensorNames(up="mlp.c_fc", down="mlp.c_proj")


#: The family the registry serves under ``starcoder2``.
FAMILY = DecoderFamily(
    name="starcoder2",
    model_types=MODEL_TYPES,
    read=read,
    required_keys=REQUIRED_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
