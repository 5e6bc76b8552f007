"""The Cohere family (Command-R): parallel attention + MLP from one bias-free LayerNorm,
interleaved (GPT-J) RoPE, optional per-head q/k LayerNorm and a logit scale."""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a Cohere ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    model = hfparts.read_common(cfg, family="cohere", dtype=dtype)
    norm = NormSpec(kind="layer", eps=cfg.positive_float("layer_norm_eps", 1e-5))
    bias = cfg.flag("attention_bias", False)
    qk_norm = cfg.flag("use_qk_norm", False)
    spec = DecoderSpec(
        model=model,
        attention=hfparts.attention(
            model,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm="head" if qk_norm else None,
            qk_norm_spec=norm,
            qk_norm_per_head_weights=qk_norm,  # one [heads, head_dim] weight
            rope_style="interleaved",
        ),
        mlp=MLPSpec(
            activation=hfparts.activation(cfg, "hidden_act", "silu"),
            intermediate_size=cfg.positive_int("intermediate_size"),
        ),
        norm=norm,
        layers=tuple(LayerSpec() for _ in range(model.num_layers)),
        residual="parallel",
        mlp_norm=False,
        ropes=(hfparts.rope(cfg, model, theta=500000.0),),
        logit_scale=cfg.positive_float("logit_scale", 0.0625),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", True),
    )
    return spec, TensorNames()


#: The family the registry serves under ``cohere``.
FAMILY = DecoderFamily(
    name="cohere",
    architectures=("CohereForCausalLM",),
    model_types=("cohere",),
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
