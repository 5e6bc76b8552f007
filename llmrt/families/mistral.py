"""The Mistral family: Mistral and Mixtral, Llama's names and layout with one sliding window
over every layer (``sliding_window``; null: none); Mixtral's MLP is top-2 of its experts
with renormalised weights in every layer, and its defaults differ (RoPE base 1e6, eps 1e-5).
"""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, MoESpec, NormSpec


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a Mistral or Mixtral ``config.json`` onto parts (``CheckpointError`` naming a
    field); transformers' Mistral and Mixtral have no attention biases."""
    mixtral = cfg.raw.get("model_type") == "mixtral"
    model = hfparts.read_common(cfg, family="mistral", dtype=dtype)
    hfparts.reject_value(cfg, "pretraining_tp", allowed=1, reason="only pretraining_tp=1")
    act = hfparts.activation(cfg, "hidden_act", "silu")
    window = hfparts.window_size(cfg, default=None if mixtral else 4096)
    eps = 1e-5 if mixtral else 1e-6
    inter = cfg.positive_int("intermediate_size")
    experts = None
    if mixtral:
        experts = MoESpec(
            num_experts=cfg.positive_int("num_local_experts"),
            top_k=cfg.positive_int("num_experts_per_tok", 2),
            intermediate_size=inter,
            activation=act,
            routing="softmax_topk_normalized",
        )
    spec = DecoderSpec(
        model=model,
        attention=hfparts.attention(model),
        mlp=None if mixtral else MLPSpec(activation=act, intermediate_size=inter),
        moe=experts,
        norm=NormSpec(kind="rms", eps=cfg.positive_float("rms_norm_eps", eps)),
        layers=tuple(LayerSpec(window=window, moe=mixtral) for _ in range(model.num_layers)),
        ropes=(hfparts.rope(cfg, model, theta=1e6 if mixtral else 1e4),),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
    )
    return spec, TensorNames()


#: The family the registry serves under ``mistral``.
FAMILY = DecoderFamily(
    name="mistral",
    architectures=("MistralForCausalLM", "MixtralForCausalLM"),
    model_types=("mistral", "mixtral"),
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
