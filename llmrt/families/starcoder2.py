"""The StarCoder2 family: LayerNorm with bias, biased projections, plain GELU MLP and a
sliding window over every layer, as a mapping onto decoder parts."""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec

MODEL_TYPES: tuple[str, ...] = ("starcoder2",)


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a StarCoder2 ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    model = hfparts.read_common(cfg, family="starcoder2", dtype=dtype)
    bias = cfg.flag("use_bias", True)
    window = hfparts.window_size(cfg)
    spec = DecoderSpec(
        model=model,
        attention=hfparts.attention(
            model,
            qkv_bias=bias,
            o_bias=bias,
        ),
        mlp=MLPSpec(
            kind="plain",
            activation=hfparts.activation(cfg, "hidden_act", "gelu_pytorch_tanh"),
            intermediate_size=cfg.positive_int("intermediate_size"),
            bias=bias,
        ),
        norm=NormSpec(kind="layer", eps=cfg.positive_float("norm_epsilon", 1e-5), bias=True),
        layers=tuple(LayerSpec(window=window) for _ in range(model.num_layers)),
        ropes=(hfparts.rope(cfg, model),),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", True),
    )
    return spec, TensorNames(up="mlp.c_fc", down="mlp.c_proj")


#: The family the registry serves under ``starcoder2``.
FAMILY = DecoderFamily(
    name="starcoder2",
    architectures=("Starcoder2ForCausalLM",),
    model_types=MODEL_TYPES,
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
