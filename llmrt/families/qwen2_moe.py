"""The Qwen2-MoE family (Qwen1.5-MoE, Qwen2-57B-A14B): top-k experts beside a shared expert
scaled by a sigmoid gate, q/k/v bias, dense layers by ``mlp_only_layers`` / sparse step."""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, MoESpec, NormSpec


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a Qwen2-MoE ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    model = hfparts.read_common(cfg, family="qwen2_moe", dtype=dtype)
    n = model.num_layers
    window = hfparts.window_size(cfg) if cfg.flag("use_sliding_window", False) else None
    kinds = hfparts.qwen_layer_kinds(cfg, num_layers=n)
    act = hfparts.activation(cfg, "hidden_act", "silu")
    moe = MoESpec(  # defaults: Qwen2MoeConfig's
        num_experts=cfg.positive_int("num_experts", 60),
        top_k=cfg.positive_int("num_experts_per_tok", 4),
        intermediate_size=cfg.positive_int("moe_intermediate_size", 1408),
        activation=act,
        routing=hfparts.routing(cfg),
        shared_intermediate_size=cfg.positive_int("shared_expert_intermediate_size", 5632),
        shared_gate=True,
    )
    sparse = hfparts.sparse_layers(cfg, num_layers=n)
    spec = DecoderSpec(
        model=model,
        attention=hfparts.attention(model, qkv_bias=cfg.flag("qkv_bias", True)),
        mlp=MLPSpec(activation=act, intermediate_size=cfg.positive_int("intermediate_size")),
        moe=moe,
        norm=NormSpec(kind="rms", eps=cfg.positive_float("rms_norm_eps", 1e-6)),
        layers=tuple(
            LayerSpec(window=window if kind == "sliding_attention" else None, moe=is_moe)
            for kind, is_moe in zip(kinds, sparse, strict=True)
        ),
        ropes=(hfparts.rope(cfg, model),),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
    )
    return spec, TensorNames()


FAMILY = DecoderFamily(
    name="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    model_types=("qwen2_moe",),
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
