"""The StableLM family (StableLM 2, StableLM-3B-4E1T): LayerNorm with bias, partial
rotary, optional q/k/v bias, per-head q/k LayerNorms and an optional parallel residual."""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec

MODEL_TYPES: tuple[str, ...] = ("stablelm",)


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a StableLM ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    model = hfparts.read_common(cfg, family="stablelm", dtype=dtype)
    eps = cfg.positive_float("layer_norm_eps", 1e-5)
    parallel = cfg.flag("use_parallel_residual", False)
    qk_norm = cfg.flag("qk_layernorm", False)
    spec = DecoderSpec(
        model=model,
        attention=hfparts.attention(
            model,
            qkv_bias=cfg.flag("use_qkv_bias", False),
            qk_norm="head" if qk_norm else None,
            qk_norm_spec=NormSpec(kind="layer", eps=eps),
            qk_norm_per_head_weights=qk_norm,
        ),
        mlp=MLPSpec(
            kind="gated",
            activation=hfparts.activation(cfg, "hidden_act", "silu"),
            intermediate_size=cfg.positive_int("intermediate_size"),
        ),
        norm=NormSpec(kind="layer", eps=eps, bias=True),
        layers=tuple(LayerSpec() for _ in range(model.num_layers)),
        residual="parallel" if parallel else "sequential",
        mlp_norm=not parallel,
        ropes=(hfparts.rope(cfg, model, partial=True, partial_default=0.25),),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
    )
    names = TensorNames(
        q_norm="self_attn.q_layernorm.norms.{h}", k_norm="self_attn.k_layernorm.norms.{h}"
    )
    return spec, names


#: The family the registry serves under ``stablelm``.
FAMILY = DecoderFamily(
    name="stablelm",
    architectures=("StableLmForCausalLM",),
    model_types=MODEL_TYPES,
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
