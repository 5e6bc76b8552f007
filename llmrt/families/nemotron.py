"""The Nemotron family (Nemotron-3, Minitron): LayerNorm scaled by ``1 + w`` (LayerNorm1P),
a plain squared-ReLU MLP and partial rotary."""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a Nemotron ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    model = hfparts.read_common(cfg, family="nemotron", dtype=dtype)
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
        norm=NormSpec(kind="layer_one_plus", eps=cfg.positive_float("norm_eps", 1e-5), bias=True),
        layers=tuple(LayerSpec() for _ in range(model.num_layers)),
        ropes=(hfparts.rope(cfg, model, partial=True, partial_default=0.5),),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
    )
    return spec, TensorNames()


#: The family the registry serves under ``nemotron``.
FAMILY = DecoderFamily(
    name="nemotron",
    architectures=("NemotronForCausalLM",),
    model_types=("nemotron",),
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
