"""The OLMo (v1) family: LayerNorm without weight or bias (eps fixed at 1e-5, as
transformers' ``OlmoLayerNorm``) and q/k/v clipping (``clip_qkv``)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.gguf_architecture import (
    GGUFArchitecture,
    metadata_field,
    reject_rope_scaling,
    token_ids,
    unpermute_qk,
    vocab_size,
)
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


def _gguf_config(
    metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], item: str
) -> dict[str, Any]:
    """A llama.cpp ``olmo`` GGUF's metadata as an OLMo ``config.json`` (llama.cpp's
    ``OlmoModel``: Llama's keys and tensors, no norm weights, ``clamp_kqv``)."""

    def field(key: str) -> Any:
        return metadata_field(metadata, f"olmo.{key}", item)

    reject_rope_scaling(metadata, "olmo", item)
    heads = int(field("attention.head_count"))
    clip = metadata.get("olmo.attention.clamp_kqv")
    return {
        "architectures": ["OlmoForCausalLM"],
        "model_type": "olmo",
        "vocab_size": vocab_size(metadata, shapes, "olmo"),
        "hidden_size": int(field("embedding_length")),
        "intermediate_size": int(field("feed_forward_length")),
        "num_hidden_layers": int(field("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata.get("olmo.attention.head_count_kv") or heads),
        "max_position_embeddings": int(field("context_length")),
        "rope_theta": float(metadata.get("olmo.rope.freq_base") or 10000.0),
        "clip_qkv": None if clip is None else float(clip),
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "tie_word_embeddings": "output.weight" not in shapes,
        **token_ids(metadata),
    }



_BLOCK = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}
GGUF = GGUFArchitecture(
    name="olmo",
    hf_config=_gguf_config,
    global_names=MappingProxyType(
        {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
    ),
    block_names=MappingProxyType(
        {
            **{k: f"model.layers.{{layer}}.self_attn.{v}" for k, v in _BLOCK.items()},
            **{f"ffn_{p}": f"model.layers.{{layer}}.mlp.{p}_proj" for p in ("gate", "up", "down")},
        }
    ),
    convert=unpermute_qk,
)

#: The family the registry serves under ``olmo``.
FAMILY = DecoderFamily(
    name="olmo",
    architectures=("OlmoForCausalLM",),
    model_types=("olmo",),
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
    gguf=GGUF,
)
