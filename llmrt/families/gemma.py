"""The Gemma family (Gemma 1), as a mapping onto decoder parts: ``(1 + w)`` RMSNorm,
``sqrt(hidden)`` embedding scale, GeGLU, head_dim 256 by default and a tied head.

Gemma 2 and Gemma 3 add norms, sliding windows and soft-capping; each has its own module
(``gemma2``, ``gemma3``).
"""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a Gemma ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    model = hfparts.read_common(cfg, family="gemma", dtype=dtype, head_dim_default=256)
    act = hfparts.activation(cfg, "hidden_act", "gelu_pytorch_tanh")
    if cfg.raw.get("hidden_act") == "gelu":
        act = "gelu_tanh"  # transformers maps Gemma's legacy "gelu" to the tanh form
    bias = cfg.flag("attention_bias", False)
    spec = DecoderSpec(
        model=model,
        attention=hfparts.attention(model, qkv_bias=bias, o_bias=bias),
        mlp=MLPSpec(activation=act, intermediate_size=cfg.positive_int("intermediate_size")),
        norm=NormSpec(kind="rms_one_plus", eps=cfg.positive_float("rms_norm_eps", 1e-6)),
        layers=tuple(LayerSpec() for _ in range(model.num_layers)),
        ropes=(hfparts.rope(cfg, model),),
        embedding_scale=model.hidden_size**0.5,
        tie_word_embeddings=cfg.flag("tie_word_embeddings", True),
    )
    return spec, TensorNames()


#: The family the registry serves under ``gemma``.
FAMILY = DecoderFamily(
    name="gemma",
    architectures=("GemmaForCausalLM",),
    model_types=("gemma",),
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
