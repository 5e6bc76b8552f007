"""Arcee (AFM-4.5B) for llmrt: Llama's layout with a plain (ungated) MLP, ReLU² by default.

The package also adds a part llmrt does not ship, the ``quick_gelu`` activation
(``x * sigmoid(1.702 x)``), through the ``llmrt.parts`` entry point: every family then reads
``hidden_act: quick_gelu``.
"""

from __future__ import annotations

import torch

from llmrt.families import forms, hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def register_parts() -> None:
    """The ``llmrt.parts`` entry point: llmrt calls it once, before any family is read."""
    forms.register_activation("quick_gelu", quick_gelu, hf_names=("quick_gelu",))


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map an Arcee ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    model = hfparts.read_common(cfg, family="arcee", dtype=dtype)
    bias = cfg.flag("attention_bias", False)
    spec = DecoderSpec(
        model=model,
        attention=hfparts.attention(model, qkv_bias=bias, o_bias=bias),
        mlp=MLPSpec(
            kind="plain",
            activation=hfparts.activation(cfg, "hidden_act", "relu2"),
            intermediate_size=cfg.positive_int("intermediate_size"),
            bias=cfg.flag("mlp_bias", False),
        ),
        norm=NormSpec(kind="rms", eps=cfg.positive_float("rms_norm_eps", 1e-5)),
        layers=tuple(LayerSpec() for _ in range(model.num_layers)),
        ropes=(hfparts.rope(cfg, model),),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
    )
    return spec, TensorNames()


FAMILY = DecoderFamily(
    name="arcee",
    architectures=("ArceeForCausalLM",),
    model_types=("arcee",),
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
