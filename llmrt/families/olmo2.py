"""The OLMo-2 family: post-norm residuals (norms on the attention and MLP outputs, none
on their inputs) and q/k RMSNorm over the whole projection, as a mapping onto parts."""

from __future__ import annotations

import torch

from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec, LayerSpec, MLPSpec, NormSpec

MODEL_TYPES: tuple[str, ...] = ("olmo2",)


def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
    """Map an OLMo-2 ``config.json`` onto parts (``CheckpointError`` naming a field)."""
    model = hfparts.read_common(cfg, family="olmo2", dtype=dtype)
    hfparts.reject_value(cfg, "clip_qkv", allowed=None, reason="q/k/v clipping is unsupported")
    norm = NormSpec(kind="rms", eps=cfg.positive_float("rms_norm_eps", 1e-5))
    bias = cfg.flag("attention_bias", False)
    spec = DecoderSpec(
        model=model,
        attention=hfparts.attention(
            model,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm="proj",
            qk_norm_spec=norm,
        ),
        mlp=MLPSpec(
            kind="gated",
            activation=hfparts.activation(cfg, "hidden_act", "silu"),
            intermediate_size=cfg.positive_int("intermediate_size"),
        ),
        norm=norm,
        layers=tuple(LayerSpec() for _ in range(model.num_layers)),
        attn_norm=False,
        mlp_norm=False,
        post_attn_norm=True,
        post_mlp_norm=True,
        ropes=(hfparts.rope(cfg, model),),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
    )
    return spec, TensorNames()


#: The family the registry serves under ``olmo2``.
FAMILY = DecoderFamily(
    name="olmo2",
    architectures=("Olmo2ForCausalLM",),
    model_types=MODEL_TYPES,
    read=read,
    required_keys=hfparts.DECODER_KEYS,
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
