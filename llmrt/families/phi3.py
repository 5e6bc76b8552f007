"""The Phi-3 family: fused q/k/v and gate/up projections, partial rotary, LongRoPE and an
optional sliding window over every layer, as a mapping onto decoder parts."""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import AttentionSpec, DecoderSpec, LayerSpec, MLPSpec, NormSpec

MODEL_TYPES: tuple[str, ...] = ("phi3",)
REQUIRED_KEYS: tuple[str, ...] = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
)


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a Phi-3 ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    hfparts.reject_common(cfg)
    hidden = cfg.positive_int("hidden_size")
    heads = hfparts.head_geometry(cfg, hidden=hidden)
    model = hfparts.model_config(cfg, family="phi3", dtype=dtype, hidden=hidden, heads=heads)
    num_heads, kv_heads, head_dim = heads
    window = hfparts.window_size(cfg)
    spec = DecoderSpec(
        model=model,
        attention=AttentionSpec(
            num_heads=num_heads, num_kv_heads=kv_heads, head_dim=head_dim, scale=head_dim**-0.5
        ),
        mlp=MLPSpec(
            kind="gated",
            activation=hfparts.activation(cfg, "hidden_act", "silu"),
            intermediate_size=cfg.positive_int("intermediate_size"),
        ),
        norm=NormSpec(kind="rms", eps=cfg.positive_float("rms_norm_eps", 1e-5)),
        layers=tuple(LayerSpec(window=window) for _ in range(model.num_layers)),
        ropes=(
            hfparts.rope(
                cfg, head_dim=head_dim, max_positions=model.max_position_embeddings, partial=True
            ),
        ),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
    )
    return spec, TensorNames(qkv="self_attn.qkv_proj", gate_up="mlp.gate_up_proj")


#: The family the registry serves under ``phi3``.
FAMILY = DecoderFamily(
    name="phi3",
    model_types=MODEL_TYPES,
    read=read,
    required_keys=REQUIRED_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
