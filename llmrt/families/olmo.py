"""The OLMo (v1) family: LayerNorm without weight or bias (eps fixed at 1e-5, as
transformers' ``OlmoLayerNorm``) and q/k/v clipping (``clip_qkv``)."""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map an OLMo ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    model = hfparts.read_common(cfg, family="olmo", dtype=dtype)
    bias = cfg.flag("attention_bias", False)
    clip = cfg.positive_float("clip_qkv") if cfg.has("clip_qkv") else None
    spec = DecoderSpec(
        model=model,
        attention=hfparts.attention(model, qkv_bias=bias, o_bias=bias, clip_qkv=clip),
        mlp=MLPSpec(
            activation=hfparts.activation(cfg, "hidden_act", "silu"),
            intermediate_size=cfg.positive_int("intermediate_size"),
        ),
        norm=NormSpec(kind="layer", eps=1e-5, weight=False),
        layers=tuple(LayerSpec() for _ in range(model.num_layers)),
        ropes=(hfparts.rope(cfg, model),),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
    )
    return spec, TensorNames()


#: The family the registry serves under ``olmo``.
FAMILY = DecoderFamily(
    name="olmo",
    architectures=("OlmoForCausalLM",),
    model_types=("olmo",),
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
