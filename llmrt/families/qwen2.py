"""The Qwen2 family (Qwen1.5, Qwen2, Qwen2.5): Llama's names and layout with q/k/v biases
and sliding windows from ``max_window_layers`` on when ``use_sliding_window`` is set."""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a Qwen2 ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    model = hfparts.read_common(cfg, family="qwen2", dtype=dtype)
    hfparts.reject_value(cfg, "pretraining_tp", allowed=1, reason="only pretraining_tp=1")
    kinds = hfparts.qwen_layer_kinds(cfg, num_layers=model.num_layers)
    windows = hfparts.layer_windows(kinds, hfparts.window_size(cfg))
    spec = DecoderSpec(
        model=model,
        attention=hfparts.attention(model, qkv_bias=True),
        mlp=MLPSpec(
            activation=hfparts.activation(cfg, "hidden_act", "silu"),
            intermediate_size=cfg.positive_int("intermediate_size"),
        ),
        norm=NormSpec(kind="rms", eps=cfg.positive_float("rms_norm_eps", 1e-6)),
        layers=tuple(LayerSpec(window=window) for window in windows),
        ropes=(hfparts.rope(cfg, model),),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
    )
    return spec, TensorNames()


#: The family the registry serves under ``qwen2``.
FAMILY = DecoderFamily(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
