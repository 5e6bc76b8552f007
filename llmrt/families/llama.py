"""The Llama family: Llama 1-3 / SmolLM2, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE and
Granite, as a mapping of their ``config.json`` onto decoder parts.

They share Llama's tensor names (``model.layers.N.self_attn.q_proj`` ...) and layout
(pre-norm RMSNorm, SwiGLU, RoPE); they differ in biases, q/k norms, sliding windows,
experts and multipliers, which this module reads and the parts compute.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from llmrt.errors import CheckpointError
from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.experts import fuse_experts
from llmrt.families.gguf_architecture import (
    STACKED_EXPERTS,
    GGUFArchitecture,
    join_stacked_experts,
    metadata_field,
    reject_rope_scaling,
    token_ids,
    unpermute_qk,
    vocab_size,
)
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import (
    DecoderSpec,
    LayerSpec,
    MLPSpec,
    MoESpec,
    NormSpec,
)

__all__ = ["FAMILY", "fuse_experts", "read"]

MODEL_TYPES: tuple[str, ...] = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "granite",
)
IGNORED_SUFFIXES: tuple[str, ...] = (".rotary_emb.inv_freq",)
#: Model types whose sliding window covers every layer (``sliding_window``, null: none).
_WINDOW_ALL = ("mistral", "mixtral")
_QWEN = ("qwen2", "qwen3", "qwen3_moe")


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a Llama-family ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    model_type = str(cfg.raw.get("model_type") or "llama")
    # Qwen3's head_dim defaults to 128 in transformers, not hidden_size // heads.
    head_dim = 128 if model_type == "qwen3" else None
    model = hfparts.read_common(cfg, family="llama", dtype=dtype, head_dim_default=head_dim)
    n = model.num_layers
    act = hfparts.activation(cfg, "hidden_act", "silu")
    hfparts.reject_value(cfg, "pretraining_tp", allowed=1, reason="only pretraining_tp=1")
    if model_type in _WINDOW_ALL:
        window = hfparts.window_size(cfg, default=4096 if model_type == "mistral" else None)
        kinds = ["full_attention" if window is None else "sliding_attention"] * n
    elif model_type in _QWEN:
        window = hfparts.window_size(cfg)
        kinds = hfparts.qwen_layer_kinds(cfg, num_layers=n)
    else:
        window = None
        kinds = hfparts.layer_kinds(cfg, num_layers=n, default=["full_attention"] * n)
        cfg.reject_if(
            "layer_types",
            present="sliding_attention" in kinds,
            reason=f"{model_type} has no sliding-window layers (transformers ignores them)",
        )
    if "sliding_attention" in kinds and window is None:
        raise CheckpointError("config.sliding_window", "required by sliding_attention layers")
    attention_bias = cfg.flag("attention_bias", False)
    scale: float | None = None
    embedding_scale = residual_multiplier = logit_scale = 1.0
    if model_type == "granite":
        scale = cfg.positive_float("attention_multiplier", 1.0)
        embedding_scale = cfg.positive_float("embedding_multiplier", 1.0)
        residual_multiplier = cfg.positive_float("residual_multiplier", 1.0)
        logit_scale = 1.0 / cfg.positive_float("logits_scaling", 1.0)
    eps = cfg.positive_float("rms_norm_eps", 1e-5 if model_type == "mixtral" else 1e-6)
    norm = NormSpec(kind="rms", eps=eps)
    attention = hfparts.attention(
        model,
        scale=scale,
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=model_type != "qwen2" and attention_bias,
        qk_norm="head" if model_type in ("qwen3", "qwen3_moe") else None,
        qk_norm_spec=norm,
    )
    moe, moe_layers = _moe(cfg, model_type=model_type, num_layers=n, activation=act)
    mlp = None
    if not all(moe_layers):
        mlp = MLPSpec(
            kind="gated",
            activation=act,
            intermediate_size=cfg.positive_int("intermediate_size"),
            bias=cfg.flag("mlp_bias", False) if model_type in ("llama", "granite") else False,
        )
    layers = tuple(
        LayerSpec(window=window if kind == "sliding_attention" else None, moe=is_moe)
        for kind, is_moe in zip(kinds, moe_layers, strict=True)
    )
    spec = DecoderSpec(
        model=model,
        attention=attention,
        mlp=mlp,
        moe=moe,
        norm=norm,
        layers=layers,
        ropes=(hfparts.rope(cfg, model, theta=1e6 if model_type == "mixtral" else 1e4),),
        embedding_scale=embedding_scale,
        residual_multiplier=residual_multiplier,
        logit_scale=logit_scale,
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
    )
    return spec, TensorNames()


def _moe(
    cfg: HFConfig, *, model_type: str, num_layers: int, activation: str
) -> tuple[MoESpec | None, list[bool]]:
    if model_type == "mixtral":
        spec = MoESpec(
            num_experts=cfg.positive_int("num_local_experts"),
            top_k=cfg.positive_int("num_experts_per_tok", 2),
            intermediate_size=cfg.positive_int("intermediate_size"),
            activation=activation,
            routing="softmax_topk_normalized",
        )
        return spec, [True] * num_layers
    if model_type != "qwen3_moe":
        return None, [False] * num_layers
    experts_key = "num_experts" if cfg.has("num_experts") else "num_local_experts"
    spec = MoESpec(
        num_experts=cfg.positive_int(experts_key),
        top_k=cfg.positive_int("num_experts_per_tok", 8),
        intermediate_size=cfg.positive_int("moe_intermediate_size"),
        activation=activation,
        routing="softmax_topk_normalized" if cfg.flag("norm_topk_prob", False) else "softmax_topk",
    )
    return spec, hfparts.sparse_layers(cfg, num_layers=num_layers)


def _gguf_config(
    metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], item: str
) -> dict[str, Any]:
    """A llama.cpp ``llama`` GGUF's metadata as a Llama ``config.json``."""
    hidden = int(metadata_field(metadata, "llama.embedding_length", item))
    heads = int(metadata_field(metadata, "llama.attention.head_count", item))
    kv_heads = int(metadata.get("llama.attention.head_count_kv") or heads)
    head_dim = int(metadata.get("llama.attention.key_length") or hidden // heads)
    rope_dim = metadata.get("llama.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise CheckpointError(
            f"{item}: llama.rope.dimension_count",
            f"partial rotary ({rope_dim} of head_dim {head_dim}) is not supported",
        )
    reject_rope_scaling(metadata, "llama", item)
    # llama.cpp writes Mixtral as ``llama`` with stacked experts (expert_count set).
    experts = metadata.get("llama.expert_count")
    moe = (
        {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": int(experts),
            "num_experts_per_tok": int(metadata_field(metadata, "llama.expert_used_count", item)),
            "sliding_window": None,
        }
        if experts
        else {}
    )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size(metadata, shapes, "llama"),
        "hidden_size": hidden,
        "intermediate_size": int(metadata_field(metadata, "llama.feed_forward_length", item)),
        "num_hidden_layers": int(metadata_field(metadata, "llama.block_count", item)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": int(metadata_field(metadata, "llama.context_length", item)),
        "rope_theta": float(metadata.get("llama.rope.freq_base") or 10000.0),
        "rms_norm_eps": float(
            metadata_field(metadata, "llama.attention.layer_norm_rms_epsilon", item)
        ),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "mlp_bias": "blk.0.ffn_up.bias" in shapes,
        "tie_word_embeddings": "output.weight" not in shapes,
        **token_ids(metadata),
        **moe,
    }



#: llama.cpp's ``llama`` architecture (Llama 1-3, SmolLM2, ...) in Hugging Face form.
GGUF = GGUFArchitecture(
    name="llama",
    hf_config=_gguf_config,
    global_names=MappingProxyType(
        {
            "token_embd.weight": "model.embed_tokens.weight",
            "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight",
        }
    ),
    block_names=MappingProxyType(
        {
            "attn_q": "model.layers.{layer}.self_attn.q_proj",
            "attn_k": "model.layers.{layer}.self_attn.k_proj",
            "attn_v": "model.layers.{layer}.self_attn.v_proj",
            "attn_output": "model.layers.{layer}.self_attn.o_proj",
            "ffn_gate": "model.layers.{layer}.mlp.gate_proj",
            "ffn_up": "model.layers.{layer}.mlp.up_proj",
            "ffn_down": "model.layers.{layer}.mlp.down_proj",
            "attn_norm": "model.layers.{layer}.input_layernorm",
            "ffn_norm": "model.layers.{layer}.post_attention_layernorm",
            **STACKED_EXPERTS,
        }
    ),
    convert=unpermute_qk,
    regroup=join_stacked_experts,
)

#: The family the registry serves under ``llama``.
FAMILY = DecoderFamily(
    name="llama",
    architectures=(
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "GraniteForCausalLM",
    ),
    model_types=MODEL_TYPES,
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=IGNORED_SUFFIXES,
    gguf=GGUF,
)
