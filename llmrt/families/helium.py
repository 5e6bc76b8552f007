"""The Helium family (Kyutai): Llama's layout with interleaved (GPT-J) RoPE, head_dim 128
and RMSNorm eps 1e-8 by default."""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map a Helium ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    model = hfparts.read_common(cfg, family="helium", dtype=dtype, head_dim_default=128)
    bias = cfg.flag("attention_bias", False)
    spec = DecoderSpec(
        model=model,
        # transformers' o_proj has no bias (and is hidden x hidden: heads * head_dim must be
        # hidden_size, which the checkpoint's shapes then show).
        attention=hfparts.attention(model, qkv_bias=bias, rope_style="interleaved"),
        mlp=MLPSpec(
            activation=hfparts.activation(cfg, "hidden_act", "silu"),
            intermediate_size=cfg.positive_int("intermediate_size"),
            bias=cfg.flag("mlp_bias", False),
        ),
        norm=NormSpec(kind="rms", eps=cfg.positive_float("rms_norm_eps", 1e-8)),
        layers=tuple(LayerSpec() for _ in range(model.num_layers)),
        ropes=(hfparts.rope(cfg, model, theta=100000.0),),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
    )
    return spec, TensorNames()


#: The family the registry serves under ``helium``.
FAMILY = DecoderFamily(
    name="helium",
    architectures=("HeliumForCausalLM",),
    model_types=("helium",),
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
