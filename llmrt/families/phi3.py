"""The Phi-3 family: fused q/k/v and gate/up projections, partial rotary, LongRoPE and an
optional sliding window over every layer, as a mapping onto decoder parts."""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec

MODEL_TYPES: tuple[str, ...] = ("phi3",)


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a Phi-3 ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    model = hfparts.read_common(cfg, family="phi3", dtype=dtype)
    window = hfparts.window_size(cfg)
    spec = DecoderSpec(
        model=model,
        attention=hfparts.attention(model),
        mlp=MLPSpec(
            kind="gated",
            activation=hfparts.activation(cfg, "hidden_act", "silu"),
            intermediate_size=cfg.positive_int("intermediate_size"),
        ),
        norm=NormSpec(kind="rms", eps=cfg.positive_float("rms_norm_eps", 1e-5)),
        layers=tuple(LayerSpec(window=window) for _ in range(model.num_layers)),
        ropes=(hfparts.rope(cfg, model, partial=True),),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
    )
    return spec, TensorNames(qkv="self_attn.qkv_proj", gate_up="mlp.gate_up_proj")


#: The family the registry serves under ``phi3``.
FAMILY = DecoderFamily(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    model_types=MODEL_TYPES,
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
