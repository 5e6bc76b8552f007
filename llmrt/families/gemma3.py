"""The Gemma 3 family (text): Gemma 2's layout with per-head q/k norms, a full-attention
layer every ``sliding_window_pattern``-th (default 6) and a RoPE variant per layer kind
(base 1e6 for the full layers, 1e4 for the sliding ones); no attention soft-capping."""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.gemma2 import NAMES
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec

#: Which of ``read``'s RoPE variants each layer kind uses.
ROPE_OF = {"full_attention": 0, "sliding_attention": 1}


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a Gemma 3 text ``config.json`` onto parts (``CheckpointError`` naming a field).
    Gemma 3 keeps ``attn_logit_softcapping`` in its config, but transformers never applies it."""
    model = hfparts.read_common(cfg, family="gemma3", dtype=dtype, head_dim_default=256)
    n = model.num_layers
    every = cfg.positive_int("sliding_window_pattern", cfg.raw.get("_sliding_window_pattern") or 6)
    pattern = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    kinds = hfparts.layer_kinds(cfg, num_layers=n, default=pattern)
    windows = hfparts.layer_windows(kinds, hfparts.window_size(cfg, default=4096))
    ropes = hfparts.rope_by_layer_kind(
        cfg, model, defaults={"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
    )
    norm = NormSpec(kind="rms_one_plus", eps=cfg.positive_float("rms_norm_eps", 1e-6))
    bias = cfg.flag("attention_bias", False)
    attention = hfparts.attention(
        model,
        scale=cfg.positive_float("query_pre_attn_scalar", 256) ** -0.5,
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="head",
        qk_norm_spec=norm,
    )
    spec = DecoderSpec(
        model=model,
        attention=attention,
        mlp=MLPSpec(
            activation=hfparts.activation(cfg, "hidden_activation", "gelu_pytorch_tanh"),
            intermediate_size=cfg.positive_int("intermediate_size"),
        ),
        norm=norm,
        layers=tuple(
            LayerSpec(window=window, rope=ROPE_OF[kind])
            for kind, window in zip(kinds, windows, strict=True)
        ),
        post_attn_norm=True,
        post_mlp_norm=True,
        ropes=(ropes["full_attention"], ropes["sliding_attention"]),
        embedding_scale=model.hidden_size**0.5,
        final_softcap=cfg.optional_positive_float("final_logit_softcapping", None),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", True),
    )
    return spec, NAMES


#: The family the registry serves under ``gemma3``.
FAMILY = DecoderFamily(
    name="gemma3",
    architectures=("Gemma3ForCausalLM",),
    model_types=("gemma3_text",),
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
