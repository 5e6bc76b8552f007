"""The Qwen3 family: Qwen3 and Qwen3-MoE, Qwen2's layout with per-head q/k RMSNorm instead of
q/k/v biases (``attention_bias`` adds them to q/k/v and o); Qwen3-MoE's layers run top-k
of its experts (``mlp_only_layers`` / ``decoder_sparse_step``: the dense ones)."""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, MoESpec, NormSpec


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a Qwen3 or Qwen3-MoE ``config.json`` onto parts (``CheckpointError`` naming a
    field). Qwen3's head_dim defaults to 128 (transformers), Qwen3-MoE's to hidden / heads."""
    moe = cfg.raw.get("model_type") == "qwen3_moe"
    model = hfparts.read_common(
        cfg, family="qwen3", dtype=dtype, head_dim_default=None if moe else 128
    )
    n = model.num_layers
    hfparts.reject_value(cfg, "pretraining_tp", allowed=1, reason="only pretraining_tp=1")
    kinds = hfparts.qwen_layer_kinds(cfg, num_layers=n)
    windows = hfparts.layer_windows(kinds, hfparts.window_size(cfg))
    act = hfparts.activation(cfg, "hidden_act", "silu")
    sparse = hfparts.sparse_layers(cfg, num_layers=n) if moe else [False] * n
    experts = None
    if moe:  # transformers 5 names the count num_local_experts (num_experts: the old name)
        experts = MoESpec(
            num_experts=cfg.positive_int(
                "num_experts" if cfg.has("num_experts") else "num_local_experts"
            ),
            top_k=cfg.positive_int("num_experts_per_tok", 8),
            intermediate_size=cfg.positive_int("moe_intermediate_size"),
            activation=act,
            routing=hfparts.routing(cfg),
        )
    norm = NormSpec(kind="rms", eps=cfg.positive_float("rms_norm_eps", 1e-6))
    bias = cfg.flag("attention_bias", False)
    attention = hfparts.attention(
        model, qkv_bias=bias, o_bias=bias, qk_norm="head", qk_norm_spec=norm
    )
    dense = None if all(sparse) else cfg.positive_int("intermediate_size")
    spec = DecoderSpec(
        model=model,
        attention=attention,
        mlp=None if dense is None else MLPSpec(activation=act, intermediate_size=dense),
        moe=experts,
        norm=norm,
        layers=tuple(
            LayerSpec(window=window, moe=is_moe)
            for window, is_moe in zip(windows, sparse, strict=True)
        ),
        ropes=(hfparts.rope(cfg, model),),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
    )
    return spec, TensorNames()


#: The family the registry serves under ``qwen3``.
FAMILY = DecoderFamily(
    name="qwen3",
    architectures=("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
    model_types=("qwen3", "qwen3_moe"),
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
