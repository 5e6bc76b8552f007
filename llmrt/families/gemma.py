"""The Gemma family: Gemma, Gemma 2 and Gemma 3 (text), as a mapping onto decoder parts.

``(1 + w)`` RMSNorm, ``sqrt(hidden)`` embedding scale, GeGLU, tied head; Gemma 2 adds
post-attention/post-MLP norms, alternating sliding-window layers, query pre-scaling and
attention/final logit soft-capping; Gemma 3 adds per-head q/k norms and a RoPE variant
per layer kind.
"""

from __future__ import annotations

import torch

from llmrt.errors import CheckpointError
from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec
from llmrt.families.rope import RopeSpec

MODEL_TYPES: tuple[str, ...] = ("gemma", "gemma2", "gemma3_text")


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a Gemma-family ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    model_type = str(cfg.raw.get("model_type") or "gemma")
    model = hfparts.read_common(cfg, family="gemma", dtype=dtype, head_dim_default=256)
    n = model.num_layers
    norm = NormSpec(kind="rms_one_plus", eps=cfg.positive_float("rms_norm_eps", 1e-6))
    if model_type == "gemma":
        act = hfparts.activation(cfg, "hidden_act", "gelu_pytorch_tanh")
        if cfg.raw.get("hidden_act") == "gelu":
            act = "gelu_tanh"  # transformers maps Gemma's legacy "gelu" to the tanh form
    else:
        act = hfparts.activation(cfg, "hidden_activation", "gelu_pytorch_tanh")
    ropes: tuple[RopeSpec, ...]
    if model_type == "gemma":
        kinds = ["full_attention"] * n
        ropes = (hfparts.rope(cfg, model),)
        rope_of = {"full_attention": 0}
        scale, softcap, final_softcap = model.head_dim**-0.5, None, None
    else:
        pattern = 2
        if model_type == "gemma3_text":
            pattern = cfg.positive_int(
                "sliding_window_pattern", cfg.raw.get("_sliding_window_pattern") or 6
            )
        default = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        kinds = hfparts.layer_kinds(cfg, num_layers=n, default=default)
        scale = cfg.positive_float("query_pre_attn_scalar", 256) ** -0.5
        # Gemma 3 keeps ``attn_logit_softcapping`` in its config but transformers never
        # applies it (the reference this family matches); Gemma 2 applies it.
        gemma2 = model_type == "gemma2"
        softcap = cfg.optional_positive_float("attn_logit_softcapping", 50.0) if gemma2 else None
        final_softcap = cfg.optional_positive_float(
            "final_logit_softcapping", 30.0 if gemma2 else None
        )
        if model_type == "gemma3_text":
            by_kind = hfparts.rope_by_layer_kind(
                cfg,
                model,
                defaults={"full_attention": 1_000_000.0, "sliding_attention": 10_000.0},
            )
            ropes = (by_kind["full_attention"], by_kind["sliding_attention"])
            rope_of = {"full_attention": 0, "sliding_attention": 1}
        else:
            ropes = (hfparts.rope(cfg, model),)
            rope_of = {"full_attention": 0, "sliding_attention": 0}
    window = hfparts.window_size(cfg, default=4096) if model_type != "gemma" else None
    if "sliding_attention" in kinds and window is None:
        raise CheckpointError("config.sliding_window", "required by sliding_attention layers")
    attention_bias = cfg.flag("attention_bias", False)
    attention = hfparts.attention(
        model,
        scale=scale,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        qk_norm="head" if model_type == "gemma3_text" else None,
        qk_norm_spec=norm,
        softcap=softcap,
    )
    extra_norms = model_type != "gemma"
    spec = DecoderSpec(
        model=model,
        attention=attention,
        mlp=MLPSpec(
            kind="gated", activation=act, intermediate_size=cfg.positive_int("intermediate_size")
        ),
        norm=norm,
        layers=tuple(
            LayerSpec(window=window if kind == "sliding_attention" else None, rope=rope_of[kind])
            for kind in kinds
        ),
        post_attn_norm=extra_norms,
        post_mlp_norm=extra_norms,
        ropes=ropes,
        embedding_scale=model.hidden_size**0.5,
        final_softcap=final_softcap,
        tie_word_embeddings=cfg.flag("tie_word_embeddings", True),
    )
    names = TensorNames(mlp_norm="pre_feedforward_layernorm") if extra_norms else TensorNames()
    return spec, names


#: The family the registry serves under ``gemma``.
FAMILY = DecoderFamily(
    name="gemma",
    architectures=(
        "GemmaForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
    ),
    model_types=MODEL_TYPES,
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
