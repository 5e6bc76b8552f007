"""The Llama family: Llama 1-3, SmolLM2 and the checkpoints that copy them, as a mapping of
their ``config.json`` onto decoder parts (pre-norm RMSNorm, SwiGLU, RoPE, optional biases).

Mistral/Mixtral, Qwen2, Qwen3/Qwen3-MoE and Granite share Llama's tensor names and layout;
each has its own module (Granite's reuses ``read`` here and adds its multipliers).
"""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec

MODEL_TYPES: tuple[str, ...] = ("llama",)
IGNORED_SUFFIXES: tuple[str, ...] = (".rotary_emb.inv_freq",)


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a Llama ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    model = hfparts.read_common(cfg, family="llama", dtype=dtype)
    n = model.num_layers
    hfparts.reject_value(cfg, "pretraining_tp", allowed=1, reason="only pretraining_tp=1")
    kinds = hfparts.layer_kinds(cfg, num_layers=n, default=["full_attention"] * n)
    cfg.reject_if(
        "layer_types",
        present="sliding_attention" in kinds,
        reason=f"{cfg.raw.get('model_type', 'llama')} has no sliding-window layers "
        "(transformers ignores them)",
    )
    bias = cfg.flag("attention_bias", False)
    spec = DecoderSpec(
        model=model,
        attention=hfparts.attention(model, qkv_bias=bias, o_bias=bias),
        mlp=MLPSpec(
            activation=hfparts.activation(cfg, "hidden_act", "silu"),
            intermediate_size=cfg.positive_int("intermediate_size"),
            bias=cfg.flag("mlp_bias", False),
        ),
        norm=NormSpec(kind="rms", eps=cfg.positive_float("rms_norm_eps", 1e-6)),
        layers=tuple(LayerSpec() for _ in range(n)),
        ropes=(hfparts.rope(cfg, model),),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
    )
    return spec, TensorNames()


#: The family the registry serves under ``llama``.
FAMILY = DecoderFamily(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_types=MODEL_TYPES,
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=IGNORED_SUFFIXES,
)
