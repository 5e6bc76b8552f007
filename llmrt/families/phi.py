"""The Phi family (Phi-1, Phi-1.5, Phi-2): parallel attention + MLP from one LayerNorm,
partial rotary, biases everywhere (the LM head's too), optional q/k LayerNorm."""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec

NAMES = TensorNames(
    final_norm="model.final_layernorm",
    o="self_attn.dense",
    up="mlp.fc1",
    down="mlp.fc2",
    q_norm="self_attn.q_layernorm",
    k_norm="self_attn.k_layernorm",
)


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a Phi ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    model = hfparts.read_common(cfg, family="phi", dtype=dtype)
    norm = NormSpec(kind="layer", eps=cfg.positive_float("layer_norm_eps", 1e-5), bias=True)
    spec = DecoderSpec(
        model=model,
        attention=hfparts.attention(
            model,
            qkv_bias=True,
            o_bias=True,
            qk_norm="head" if cfg.flag("qk_layernorm", False) else None,
            qk_norm_spec=norm,
        ),
        mlp=MLPSpec(
            kind="plain",
            activation=hfparts.activation(cfg, "hidden_act", "gelu_new"),
            intermediate_size=cfg.positive_int("intermediate_size"),
            bias=True,
        ),
        norm=norm,
        layers=tuple(LayerSpec() for _ in range(model.num_layers)),
        residual="parallel",
        mlp_norm=False,
        ropes=(hfparts.rope(cfg, model, partial=True, partial_default=0.5),),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
        lm_head_bias=True,
    )
    return spec, NAMES


#: The family the registry serves under ``phi``.
FAMILY = DecoderFamily(
    name="phi",
    architectures=("PhiForCausalLM",),
    model_types=("phi",),
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
