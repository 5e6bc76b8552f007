"""The SmolLM3 family: Llama's layout with RoPE left out of every ``no_rope_layer_interval``-th
layer (``no_rope_layers``: 1 rotates, 0 does not), optional sliding windows, base 2e6."""

from __future__ import annotations

import torch

from llmrt.errors import CheckpointError
from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a SmolLM3 ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    model = hfparts.read_common(cfg, family="smollm3", dtype=dtype)
    n = model.num_layers
    interval = cfg.positive_int("no_rope_layer_interval", 4)
    rotates = cfg.raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    if not isinstance(rotates, list) or len(rotates) != n or not set(rotates) <= {0, 1}:
        raise CheckpointError("config.no_rope_layers", f"must list {n} flags (0 or 1)")
    window = hfparts.window_size(cfg) if cfg.flag("use_sliding_window", False) else None
    kinds = hfparts.qwen_layer_kinds(cfg, num_layers=n)
    bias = cfg.flag("attention_bias", False)
    spec = DecoderSpec(
        model=model,
        attention=hfparts.attention(model, qkv_bias=bias, o_bias=bias),
        mlp=MLPSpec(
            activation=hfparts.activation(cfg, "hidden_act", "silu"),
            intermediate_size=cfg.positive_int("intermediate_size"),
            bias=cfg.flag("mlp_bias", False),
        ),
        norm=NormSpec(kind="rms", eps=cfg.positive_float("rms_norm_eps", 1e-6)),
        layers=tuple(
            LayerSpec(window=window if kind == "sliding_attention" else None, rope=0 if r else None)
            for kind, r in zip(kinds, rotates, strict=True)
        ),
        ropes=(hfparts.rope(cfg, model, theta=2_000_000.0),),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", True),
    )
    return spec, TensorNames()


#: The family the registry serves under ``smollm3``.
FAMILY = DecoderFamily(
    name="smollm3",
    architectures=("SmolLM3ForCausalLM",),
    model_types=("smollm3",),
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
