"""The Gemma 2 family: Gemma's ``(1 + w)`` RMSNorm, embedding scale and GeGLU, plus
post-attention/post-MLP norms, sliding-window layers alternating with full ones, a query
pre-scale (``query_pre_attn_scalar``) and attention/final logit soft-capping."""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec

#: Gemma 2's extra norms: the one before the MLP is ``pre_feedforward_layernorm``.
NAMES = TensorNames(mlp_norm="pre_feedforward_layernorm")


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a Gemma 2 ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    model = hfparts.read_common(cfg, family="gemma2", dtype=dtype, head_dim_default=256)
    n = model.num_layers
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    kinds = hfparts.layer_kinds(cfg, num_layers=n, default=alternating)
    windows = hfparts.layer_windows(kinds, hfparts.window_size(cfg, default=4096))
    norm = NormSpec(kind="rms_one_plus", eps=cfg.positive_float("rms_norm_eps", 1e-6))
    bias = cfg.flag("attention_bias", False)
    attention = hfparts.attention(
        model,
        scale=cfg.positive_float("query_pre_attn_scalar", 256) ** -0.5,
        qkv_bias=bias,
        o_bias=bias,
        softcap=cfg.optional_positive_float("attn_logit_softcapping", 50.0),
    )
    spec = DecoderSpec(
        model=model,
        attention=attention,
        mlp=MLPSpec(
            activation=hfparts.activation(cfg, "hidden_activation", "gelu_pytorch_tanh"),
            intermediate_size=cfg.positive_int("intermediate_size"),
        ),
        norm=norm,
        layers=tuple(LayerSpec(window=window) for window in windows),
        post_attn_norm=True,
        post_mlp_norm=True,
        ropes=(hfparts.rope(cfg, model),),
        embedding_scale=model.hidden_size**0.5,
        final_softcap=cfg.optional_positive_float("final_logit_softcapping", 30.0),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", True),
    )
    return spec, NAMES


#: The family the registry serves under ``gemma2``.
FAMILY = DecoderFamily(
    name="gemma2",
    architectures=("Gemma2ForCausalLM",),
    model_types=("gemma2",),
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
