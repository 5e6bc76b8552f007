"""Reading Hugging Face ``config.json`` fields into parts, shared by the family modules.

Each helper reads one concern (head geometry, RoPE variants, per-layer attention kinds,
activation) exactly as transformers interprets it, and raises ``CheckpointError`` naming
the field for anything the parts cannot compute.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from llmrt.errors import CheckpointError
from llmrt.families.base import ModelConfig
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import HF_ACTIVATIONS, Activation, AttentionSpec, Routing
from llmrt.families.rope import RopeSpec, read_rope, read_rope_params, rope_parameters

LAYER_KINDS = ("full_attention", "sliding_attention")
#: ``config.json`` keys a random checkpoint of a Llama-style decoder must give.
DECODER_KEYS: tuple[str, ...] = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
)


def head_geometry(
    cfg: HFConfig,
    *,
    hidden: int,
    heads_key: str = "num_attention_heads",
    kv_key: str | None = "num_key_value_heads",
    head_dim_default: int | None = None,
) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim); head_dim defaults to ``hidden // heads``."""
    heads = cfg.positive_int(heads_key)
    kv_heads = cfg.positive_int(kv_key, heads) if kv_key is not None else heads
    if heads % kv_heads:
        raise CheckpointError(
            f"config.{kv_key}", f"must divide {heads_key}={heads}, got {kv_heads}"
        )
    if cfg.has("head_dim"):
        head_dim = cfg.positive_int("head_dim")
    elif head_dim_default is not None:
        head_dim = head_dim_default
    elif hidden % heads:
        raise CheckpointError(
            f"config.{heads_key}",
            f"must divide hidden_size={hidden} when head_dim is absent, got {heads}",
        )
    else:
        head_dim = hidden // heads
    return heads, kv_heads, head_dim


def model_config(
    cfg: HFConfig,
    *,
    family: str,
    dtype: torch.dtype,
    hidden: int,
    heads: tuple[int, int, int],
    layers_key: str = "num_hidden_layers",
    positions_key: str = "max_position_embeddings",
) -> ModelConfig:
    """The runtime-facing ``ModelConfig`` with token ids from the config."""
    num_heads, kv_heads, head_dim = heads
    return ModelConfig(
        family=family,
        vocab_size=cfg.positive_int("vocab_size"),
        hidden_size=hidden,
        num_layers=cfg.positive_int(layers_key),
        num_heads=num_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=cfg.positive_int(positions_key),
        dtype=dtype,
        bos_token_id=cfg.token_id("bos_token_id"),
        eos_token_ids=cfg.token_ids("eos_token_id"),
    )


def read_common(
    cfg: HFConfig,
    *,
    family: str,
    dtype: torch.dtype,
    head_dim_default: int | None = None,
    names: Mapping[str, str | None] | None = None,
) -> ModelConfig:
    """The reads every decoder config starts with: reject what no family implements, then
    the model config from ``hidden_size`` and the standard head keys. ``names`` maps a
    standard key to the architecture's own (GPT-2's ``n_embd``, transformers'
    ``attribute_map``: the standard key wins where the file gives both, and errors name the
    architecture's key otherwise), or to None where the architecture has no such option
    (``num_key_value_heads``: every head its own K/V)."""
    own = names or {}

    def key(standard: str) -> str:
        alias = own.get(standard, standard)
        return standard if alias is None or cfg.has(standard) else alias

    reject_common(cfg)
    hidden = cfg.positive_int(key("hidden_size"))
    heads = head_geometry(
        cfg,
        hidden=hidden,
        heads_key=key("num_attention_heads"),
        kv_key=None if own.get("num_key_value_heads", "") is None else key("num_key_value_heads"),
        head_dim_default=head_dim_default,
    )
    return model_config(
        cfg,
        family=family,
        dtype=dtype,
        hidden=hidden,
        heads=heads,
        layers_key=key("num_hidden_layers"),
        positions_key=key("max_position_embeddings"),
    )


def attention(model: ModelConfig, *, scale: float | None = None, **options: Any) -> AttentionSpec:
    """The attention part over ``model``'s head geometry; ``scale`` defaults to
    ``head_dim ** -0.5``, ``options`` are the rest of ``AttentionSpec`` (``qk_norm_spec``
    is dropped without a ``qk_norm``: it describes nothing then, and equal parts stay equal)."""
    if options.get("qk_norm") is None:
        options.pop("qk_norm_spec", None)
    return AttentionSpec(
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        scale=model.head_dim**-0.5 if scale is None else scale,
        **options,
    )


def activation(cfg: HFConfig, key: str, default: str) -> Activation:
    """The activation part for ``config.<key>``."""
    name = cfg.text(key, default)
    if name not in HF_ACTIVATIONS:
        raise CheckpointError(
            f"config.{key}",
            f"unsupported activation {name!r} (supported: {', '.join(HF_ACTIVATIONS)})",
        )
    return HF_ACTIVATIONS[name]


def rope(
    cfg: HFConfig,
    model: ModelConfig,
    *,
    partial: bool = False,
    theta: float = 10000.0,
    partial_default: float = 1.0,
) -> RopeSpec:
    """The single RoPE variant of a config over ``model``'s head_dim and positions;
    ``partial``: the architecture honours ``partial_rotary_factor`` (else a factor below
    one is rejected, not ignored). ``theta`` and ``partial_default`` are the architecture's
    transformers defaults when the config gives none (Mixtral's base is 1e6, GPT-NeoX
    rotates a quarter of each head): the runtime reads the raw ``config.json``."""
    head_dim = model.head_dim
    spec = read_rope(
        cfg,
        head_dim=head_dim,
        max_positions=model.max_position_embeddings,
        default_theta=theta,
        default_partial=partial_default,
    )
    if not partial and spec.head_dim != head_dim:
        _, params = rope_parameters(cfg)
        where = "rope_parameters." if "partial_rotary_factor" in params else ""
        raise CheckpointError(
            f"config.{where}partial_rotary_factor",
            "partial rotary embeddings are not part of this architecture",
        )
    return spec


def rope_by_layer_kind(
    cfg: HFConfig, model: ModelConfig, *, defaults: dict[str, float]
) -> dict[str, RopeSpec]:
    """RoPE per layer kind (Gemma 3: ``rope_parameters`` keyed by ``full_attention`` /
    ``sliding_attention``; legacy ``rope_theta`` / ``rope_local_base_freq`` /
    ``rope_scaling`` for the full layers)."""
    source, params = rope_parameters(cfg)
    nested = source == "rope_parameters" and any(k in params for k in LAYER_KINDS)
    out = {}
    for kind in LAYER_KINDS:
        if nested:
            sub = params.get(kind) or {}
            if not isinstance(sub, dict):
                raise CheckpointError(f"config.rope_parameters.{kind}", "must be a mapping")
            item = f"config.rope_parameters.{kind}"
        elif kind == "full_attention":
            sub, item = params, f"config.{source}"
        else:
            sub, item = {}, "config.rope_local_base_freq"
        theta_key = "rope_local_base_freq" if kind == "sliding_attention" else "rope_theta"
        theta = sub.get("rope_theta", cfg.raw.get(theta_key, defaults[kind]))
        merged = {**sub, "rope_theta": theta}
        out[kind] = read_rope_params(
            merged,
            item=item,
            config=cfg,
            head_dim=model.head_dim,
            max_positions=model.max_position_embeddings,
        )
        if out[kind].head_dim != model.head_dim:
            raise CheckpointError(
                f"{item}.partial_rotary_factor",
                "partial rotary embeddings are not part of this architecture",
            )
    return out


def layer_kinds(cfg: HFConfig, *, num_layers: int, default: list[str]) -> list[str]:
    """``config.layer_types`` (validated) or ``default``."""
    kinds = cfg.raw.get("layer_types")
    if kinds is None:
        return default
    if not isinstance(kinds, list) or len(kinds) != num_layers:
        raise CheckpointError("config.layer_types", f"must list {num_layers} layer kinds")
    for i, kind in enumerate(kinds):
        if kind not in LAYER_KINDS:
            raise CheckpointError(
                f"config.layer_types[{i}]",
                f"unsupported layer kind {kind!r} (supported: {', '.join(LAYER_KINDS)})",
            )
    return list(kinds)


def window_size(
    cfg: HFConfig, key: str = "sliding_window", *, default: int | None = None
) -> int | None:
    """``config.sliding_window`` as a positive int; None when null; ``default`` (the
    architecture's transformers default) when absent."""
    if key not in cfg.raw:
        return default
    if cfg.raw[key] is None:
        return None
    return cfg.positive_int(key)


def qwen_layer_kinds(cfg: HFConfig, *, num_layers: int) -> list[str]:
    """Qwen2/Qwen3 sliding layers: ``layer_types``, else ``use_sliding_window`` from
    ``max_window_layers`` on (transformers' default)."""
    window = window_size(cfg) if cfg.flag("use_sliding_window", False) else None
    first = cfg.raw.get("max_window_layers", num_layers)
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise CheckpointError("config.max_window_layers", f"must be an int >= 0, got {first!r}")
    default = [
        "sliding_attention" if window is not None and i >= first else "full_attention"
        for i in range(num_layers)
    ]
    return layer_kinds(cfg, num_layers=num_layers, default=default)


def layer_windows(kinds: list[str], window: int | None) -> list[int | None]:
    """Each layer's sliding window: ``window`` for the ``sliding_attention`` layers, None for
    the others; a sliding layer without a window is a ``CheckpointError``."""
    if "sliding_attention" in kinds and window is None:
        raise CheckpointError("config.sliding_window", "required by sliding_attention layers")
    return [window if kind == "sliding_attention" else None for kind in kinds]


def routing(cfg: HFConfig) -> Routing:
    """The experts' routing: top-k weights renormalised when ``norm_topk_prob`` is set."""
    return "softmax_topk_normalized" if cfg.flag("norm_topk_prob", False) else "softmax_topk"


def sparse_layers(cfg: HFConfig, *, num_layers: int) -> list[bool]:
    """Which layers run the experts (Qwen-MoE's ``mlp_only_layers`` and
    ``decoder_sparse_step``): the others run the dense MLP."""
    step = cfg.positive_int("decoder_sparse_step", 1)
    dense = cfg.raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise CheckpointError("config.mlp_only_layers", f"must list layer indices: {dense!r}")
    return [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]


def reject_common(cfg: HFConfig) -> None:
    """Options no family implements."""
    cfg.reject_if(
        "quantization_config",
        present=cfg.has("quantization_config"),
        reason="pre-quantized checkpoints are unsupported",
    )
    cfg.reject_if(
        "use_bidirectional_attention",
        present=bool(cfg.raw.get("use_bidirectional_attention")),
        reason="bidirectional attention is unsupported (causal decoders only)",
    )


def reject_flags(cfg: HFConfig, names: tuple[str, ...]) -> None:
    """Reject each boolean option of ``names`` that the config sets true: an architecture's
    switches for what the parts do not compute."""
    for name in names:
        present = cfg.flag(name, False)
        cfg.reject_if(name, present=present, reason="unsupported option (no part computes it)")


def reject_value(cfg: HFConfig, name: str, *, allowed: Any, reason: str) -> None:
    """Reject ``config.<name>`` unless it is absent or equals ``allowed``."""
    value = cfg.raw.get(name)
    cfg.reject_if(name, present=value is not None and value != allowed, reason=reason)
