"""The Granite family: Llama's layout and names with four multipliers (attention scale,
embedding, residual, logits), read on top of the Llama family's ``read``."""

from __future__ import annotations

import attrs
import torch

from llmrt.families import hfparts, llama
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a Granite ``config.json`` onto parts: Llama's, scaled (defaults 1: none)."""
    spec, names = llama.read(cfg, dtype)
    spec = attrs.evolve(
        spec,
        model=attrs.evolve(spec.model, family="granite"),
        attention=attrs.evolve(
            spec.attention, scale=cfg.positive_float("attention_multiplier", 1.0)
        ),
        embedding_scale=cfg.positive_float("embedding_multiplier", 1.0),
        residual_multiplier=cfg.positive_float("residual_multiplier", 1.0),
        logit_scale=1.0 / cfg.positive_float("logits_scaling", 1.0),
    )
    return spec, names


#: The family the registry serves under ``granite``.
FAMILY = DecoderFamily(
    name="granite",
    architectures=("GraniteForCausalLM",),
    model_types=("granite",),
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=llama.IGNORED_SUFFIXES,
)
