"""The Phi family (Phi-1, Phi-1.5, Phi-2): parallel attention + MLP from one LayerNorm,
partial rotary, biases everywhere (the LM head's too), optional q/k LayerNorm."""

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
    vocab_size,
)
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec

NAMES = TensorNames(
    final_norm="model.final_layernorm", o="self_attn.dense", up="mlp.fc1", down="mlp.fc2",
    q_norm="self_attn.q_layernorm", k_norm="self_attn.k_layernorm",
)  # fmt: skip


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


def _gguf_config(
    metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], item: str
) -> dict[str, Any]:
    """A llama.cpp ``phi2`` GGUF's metadata as a Phi ``config.json`` (NeoX RoPE: no q/k
    permutation; the rotated width is ``rope.dimension_count``)."""

    def field(key: str) -> Any:
        return metadata_field(metadata, f"phi2.{key}", item)

    reject_rope_scaling(metadata, "phi2", item)
    hidden, heads = int(field("embedding_length")), int(field("attention.head_count"))
    return {
        "architectures": ["PhiForCausalLM"],
        "model_type": "phi",
        "vocab_size": vocab_size(metadata, shapes, "phi2"),
        "hidden_size": hidden,
        "intermediate_size": int(field("feed_forward_length")),
        "num_hidden_layers": int(field("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata.get("phi2.attention.head_count_kv") or heads),
        "max_position_embeddings": int(field("context_length")),
        "layer_norm_eps": float(field("attention.layer_norm_epsilon")),
        "partial_rotary_factor": int(field("rope.dimension_count")) / (hidden // heads),
        "rope_theta": float(metadata.get("phi2.rope.freq_base") or 10000.0),
        "hidden_act": "gelu_new",
        "tie_word_embeddings": False,
        **token_ids(metadata),
    }


_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.dense", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}  # fmt: skip
#: llama.cpp's ``phi2`` architecture (separate q/k/v tensors) in Hugging Face form.
GGUF = GGUFArchitecture(
    name="phi2",
    hf_config=_gguf_config,
    global_names=MappingProxyType(
        {
            "token_embd.weight": "model.embed_tokens.weight",
            "output_norm.weight": "model.final_layernorm.weight",
            "output_norm.bias": "model.final_layernorm.bias",
            "output.weight": "lm_head.weight",
            "output.bias": "lm_head.bias",
        }
    ),
    block_names=MappingProxyType({k: f"model.layers.{{layer}}.{v}" for k, v in _BLOCK.items()}),
)

#: The family the registry serves under ``phi``.
FAMILY = DecoderFamily(
    name="phi",
    architectures=("PhiForCausalLM",),
    model_types=("phi",),
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
    gguf=GGUF,
)
