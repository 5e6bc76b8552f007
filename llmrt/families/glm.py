"""The GLM family (GLM-4 base, ``model_type: glm``): interleaved RoPE over half of each
head, q/k/v bias, a fused gate/up projection, head_dim 128 by default."""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a GLM ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    model = hfparts.read_common(cfg, family="glm", dtype=dtype, head_dim_default=128)
    spec = DecoderSpec(
        model=model,
        attention=hfparts.attention(
            model, qkv_bias=cfg.flag("attention_bias", True), rope_style="interleaved"
        ),
        mlp=MLPSpec(
            activation=hfparts.activation(cfg, "hidden_act", "silu"),
            intermediate_size=cfg.positive_int("intermediate_size"),
        ),
        norm=NormSpec(kind="rms", eps=cfg.positive_float("rms_norm_eps", 1.5625e-7)),
        layers=tuple(LayerSpec() for _ in range(model.num_layers)),
        ropes=(hfparts.rope(cfg, model, partial=True, partial_default=0.5),),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
    )
    return spec, TensorNames(gate_up="mlp.gate_up_proj")


#: The family the registry serves under ``glm``.
FAMILY = DecoderFamily(
    name="glm",
    architectures=("GlmForCausalLM",),
    model_types=("glm",),
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
