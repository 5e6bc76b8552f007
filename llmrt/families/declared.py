"""Decoder parts declared in a recipe (``model.parts``): try an architecture no family
knows yet without writing Python.

Sizes stay where every Hugging Face ``config.json`` keeps them (``hidden_size``,
``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
``intermediate_size``, ``vocab_size``, ``max_position_embeddings``, the RoPE keys, the MoE
counts, ``tie_word_embeddings``), so a random recipe shrinks and a safetensors directory
brings its own; ``model.parts`` declares the structure the config cannot: which norm,
activation, MLP, attention options, residual layout, positions and multipliers, and the
checkpoint's tensor names. ``parse_parts`` validates the section once (``RecipeError``
naming ``model.parts.<field>``); ``declared_family`` turns it into a ``DecoderFamily``
that builds through the same decoder, weights loader and containers as every family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

import attrs
import torch

from llmrt.errors import ConfigError, RecipeError
from llmrt.families import hfparts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.forms import activation_names, norm_kinds
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import (
    DecoderSpec,
    LayerSpec,
    MLPKind,
    MLPSpec,
    MoESpec,
    NormSpec,
    QKNorm,
    Residual,
    RopeStyle,
    Routing,
)
from llmrt.families.rope import RopeSpec, read_rope_params

#: Where the section lives in a recipe (the prefix of every error's field path).
PARTS_PATH = "model.parts"
#: The name a declared family reports (``ModelConfig.family``, ``llmrt check`` tables).
DECLARED_FAMILY = "parts"
Positions = Literal["rope", "learned", "none"]
#: Which layers an option covers: every layer, the even or odd ones, or listed indices.
LayerSelection = str | tuple[int, ...]
_SELECTIONS = ("all", "even", "odd")

Checker = Callable[[str, Any], Any]


def _fail(path: str, value: Any, reason: str) -> None:
    raise RecipeError(path, value, reason)


def _literal(literal: Any, *, optional: bool = False) -> Checker:
    choices = get_args(literal)

    def check(path: str, value: Any) -> Any:
        if value is None and optional:
            return None
        if value not in choices:
            shown = [*choices, None] if optional else list(choices)
            _fail(path, value, f"must be one of {shown}")
        return value

    return check


def _registered(names: Callable[[], tuple[str, ...]]) -> Checker:
    """A name from a registry read at check time (built-ins plus what packages registered)."""

    def check(path: str, value: Any) -> Any:
        if value not in names():
            _fail(path, value, f"must be one of {list(names())}")
        return value

    return check


def _flag(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        _fail(path, value, "must be true or false")
    return bool(value)


def _number(*, optional: bool = False) -> Checker:
    def check(path: str, value: Any) -> Any:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e300:
            _fail(path, value, "must be a positive number" + (" or null" if optional else ""))
        return float(value)

    return check


def _window(path: str, value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        _fail(path, value, "must be a positive integer or null")
    return value


def _selection(path: str, value: Any) -> LayerSelection:
    if isinstance(value, str):
        if value not in _SELECTIONS:
            _fail(path, value, f"must be one of {list(_SELECTIONS)} or a list of layer indices")
        return value
    if not isinstance(value, list):
        _fail(path, value, f"must be one of {list(_SELECTIONS)} or a list of layer indices")
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            _fail(f"{path}[{i}]", item, "must be a layer index (an integer >= 0)")
    return tuple(value)


def _embedding_scale(path: str, value: Any) -> float | str:
    if value == "sqrt_hidden":
        return "sqrt_hidden"
    scale: float | str = _number()(path, value)
    return scale


def _tensor_names(path: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        _fail(path, value, "must be a mapping of tensor-name fields")
    fields = {f.name: f for f in attrs.fields(TensorNames)}
    out: dict[str, Any] = {}
    for key, item in value.items():
        if key not in fields:
            _fail(
                f"{path}.{key}", item, f"is not a tensor-name field (fields: {', '.join(fields)})"
            )
        default = fields[key].default
        if isinstance(default, bool):
            out[key] = _flag(f"{path}.{key}", item)
        elif item is None and default is None:
            out[key] = None
        elif not isinstance(item, str) or not item:
            _fail(
                f"{path}.{key}",
                item,
                "must be a non-empty string" + (" or null" if default is None else ""),
            )
        else:
            out[key] = item
    if "{i}" not in out.get("layer", "{i}"):
        _fail(f"{path}.layer", out["layer"], "must contain {i} (the layer index)")
    return out


#: Each sub-section: field -> (default, checker). Top-level scalars are in ``_TOP``.
_SECTIONS: dict[str, dict[str, tuple[Any, Checker]]] = {
    "norm": {
        "kind": ("rms", _registered(norm_kinds)),
        "eps": (None, _number(optional=True)),
        "bias": (False, _flag),
        "weight": (True, _flag),
    },
    "attention": {
        "qkv_bias": (False, _flag),
        "o_bias": (False, _flag),
        "qk_norm": (None, _literal(QKNorm, optional=True)),
        "qk_norm_per_head_weights": (False, _flag),
        "scale": (None, _number(optional=True)),
        "softcap": (None, _number(optional=True)),
        "clip_qkv": (None, _number(optional=True)),
        "rope_style": ("neox", _literal(RopeStyle)),
        "sliding_window": (None, _window),
        "sliding_layers": ("all", _selection),
    },
    "mlp": {
        "kind": ("gated", _literal(MLPKind)),
        "activation": ("silu", _registered(activation_names)),
        "bias": (False, _flag),
    },
    "moe": {
        "activation": ("silu", _registered(activation_names)),
        "routing": ("softmax_topk_normalized", _literal(Routing)),
        "shared_expert": (False, _flag),
        "shared_gate": (False, _flag),
        "layers": ("all", _selection),
    },
}
_TOP: dict[str, tuple[Any, Checker]] = {
    "positions": ("rope", _literal(Positions)),
    "nope_layers": ((), _selection),
    "sliding_rope_theta": (None, _number(optional=True)),
    "residual": ("sequential", _literal(Residual)),
    "attn_norm": (True, _flag),
    "post_attn_norm": (False, _flag),
    "mlp_norm": (True, _flag),
    "post_mlp_norm": (False, _flag),
    "final_norm": (True, _flag),
    "embedding_scale": (1.0, _embedding_scale),
    "residual_multiplier": (1.0, _number()),
    "logit_scale": (1.0, _number()),
    "final_softcap": (None, _number(optional=True)),
    "lm_head_bias": (False, _flag),
    "tensor_names": ({}, _tensor_names),
}


def _read_fields(
    raw: Any, *, path: str, fields: Mapping[str, tuple[Any, Checker]]
) -> dict[str, Any]:
    if not isinstance(raw, dict):
        _fail(path, raw, "must be a mapping")
    for key in raw:
        if key not in fields:
            _fail(f"{path}.{key}", raw[key], f"is not a part option (options: {', '.join(fields)})")
    return {
        key: check(f"{path}.{key}", raw[key]) if key in raw else default
        for key, (default, check) in fields.items()
    }


@attrs.frozen(kw_only=True)
class DeclaredParts:
    """A validated ``model.parts`` section: per-section option values, defaults filled in.

    ``mlp`` / ``moe`` are None when the recipe declares none (``mlp: null``; no ``moe``).
    """

    norm: Mapping[str, Any]
    attention: Mapping[str, Any]
    mlp: Mapping[str, Any] | None
    moe: Mapping[str, Any] | None
    top: Mapping[str, Any]
    path: str = PARTS_PATH

    def read(self, cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
        """The decoder these parts make at ``cfg``'s sizes (sizes: ``CheckpointError``
        naming ``config.<key>``; parts that do not fit: ``RecipeError`` naming the part)."""
        model = hfparts.read_common(cfg, family=DECLARED_FAMILY, dtype=dtype)
        n = model.num_layers
        attn, top = self.attention, self.top
        sliding = self._layers("attention.sliding_layers", attn["sliding_layers"], n)
        moe_layers = self._layers("moe.layers", self.moe["layers"], n) if self.moe else set()
        nope = self._layers("nope_layers", top["nope_layers"], n)
        window = attn["sliding_window"]
        variants = self._ropes(cfg, model) if top["positions"] == "rope" else ()
        layers = tuple(
            LayerSpec(
                window=window if i in sliding else None,
                rope=None
                if i in nope
                else (1 if len(variants) > 1 and window and i in sliding else 0),
                moe=i in moe_layers,
            )
            for i in range(n)
        )
        kind = self.norm["kind"]
        layer = kind.startswith("layer")
        eps_key = "layer_norm_eps" if layer else "rms_norm_eps"
        eps = self.norm["eps"] or cfg.positive_float(eps_key, 1e-5 if layer else 1e-6)
        norm = self._part(
            "norm", NormSpec, kind=kind, eps=eps, bias=self.norm["bias"], weight=self.norm["weight"]
        )
        scale = top["embedding_scale"]
        try:
            spec = DecoderSpec(
                model=model,
                attention=self._part(
                    "attention",
                    hfparts.attention,
                    model,
                    scale=attn["scale"],
                    qkv_bias=attn["qkv_bias"],
                    o_bias=attn["o_bias"],
                    qk_norm=attn["qk_norm"],
                    qk_norm_spec=norm,
                    qk_norm_per_head_weights=attn["qk_norm_per_head_weights"],
                    softcap=attn["softcap"],
                    clip_qkv=attn["clip_qkv"],
                    rope_style=attn["rope_style"],
                ),
                mlp=self._mlp(cfg, n=n, moe_layers=moe_layers),
                moe=self._moe(cfg),
                norm=norm,
                layers=layers,
                residual=top["residual"],
                attn_norm=top["attn_norm"],
                post_attn_norm=top["post_attn_norm"],
                mlp_norm=top["mlp_norm"],
                post_mlp_norm=top["post_mlp_norm"],
                final_norm=top["final_norm"],
                positions=top["positions"],
                ropes=variants,
                embedding_scale=model.hidden_size**0.5 if scale == "sqrt_hidden" else scale,
                residual_multiplier=top["residual_multiplier"],
                logit_scale=top["logit_scale"],
                final_softcap=top["final_softcap"],
                tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
                lm_head_bias=top["lm_head_bias"],
            )
        except ConfigError as exc:
            if isinstance(exc, RecipeError):
                raise
            raise RecipeError(f"{self.path}.{exc.field}", exc.value, exc.reason) from exc
        return spec, TensorNames(**top["tensor_names"])

    def layers_named(self) -> int:
        """How many layers a model needs for every index the parts list (0: none listed)."""
        selections = [self.attention["sliding_layers"], self.top["nope_layers"]]
        if self.moe is not None:
            selections.append(self.moe["layers"])
        listed = [i for s in selections if not isinstance(s, str) for i in s]
        return max(listed) + 1 if listed else 0

    def _layers(self, field: str, selection: LayerSelection, n: int) -> set[int]:
        if selection == "all":
            return set(range(n))
        if selection in ("even", "odd"):
            return set(range(0 if selection == "even" else 1, n, 2))
        indices = tuple(int(index) for index in selection)
        for i, index in enumerate(indices):
            if index >= n:
                _fail(f"{self.path}.{field}[{i}]", index, f"must be below num_hidden_layers={n}")
        return set(indices)

    def _ropes(self, cfg: HFConfig, model: Any) -> tuple[RopeSpec, ...]:
        main = hfparts.rope(cfg, model, partial=True)
        theta = self.top["sliding_rope_theta"]
        if theta is None:
            return (main,)
        local = read_rope_params(
            {"rope_type": "default", "rope_theta": theta},
            item=f"{self.path}.sliding_rope_theta",
            config=cfg,
            head_dim=model.head_dim,
            max_positions=model.max_position_embeddings,
        )
        return (main, local)

    def _mlp(self, cfg: HFConfig, *, n: int, moe_layers: set[int]) -> MLPSpec | None:
        if self.mlp is None:
            if len(moe_layers) < n:
                dense = min(set(range(n)) - moe_layers)
                _fail(f"{self.path}.mlp", None, f"layer {dense} is dense and needs an mlp part")
            return None
        if len(moe_layers) == n:
            return None
        return self._part(
            "mlp",
            MLPSpec,
            kind=self.mlp["kind"],
            activation=self.mlp["activation"],
            intermediate_size=cfg.positive_int("intermediate_size"),
            bias=self.mlp["bias"],
        )

    def _moe(self, cfg: HFConfig) -> MoESpec | None:
        if self.moe is None:
            return None
        experts = "num_experts" if cfg.has("num_experts") else "num_local_experts"
        shared = None
        if self.moe["shared_expert"]:
            shared = cfg.positive_int("shared_expert_intermediate_size")
        return self._part(
            "moe",
            MoESpec,
            num_experts=cfg.positive_int(experts),
            top_k=cfg.positive_int("num_experts_per_tok"),
            intermediate_size=cfg.positive_int(
                "moe_intermediate_size", cfg.raw.get("intermediate_size")
            ),
            activation=self.moe["activation"],
            routing=self.moe["routing"],
            shared_intermediate_size=shared,
            shared_gate=self.moe["shared_gate"],
        )

    def _part(self, section: str, make: Callable[..., Any], *args: Any, **options: Any) -> Any:
        """``make(...)``, its ``ConfigError`` re-raised under ``model.parts.<section>``."""
        try:
            return make(*args, **options)
        except ConfigError as exc:
            field = exc.field if exc.field.startswith(f"{section}.") else f"{section}.{exc.field}"
            raise RecipeError(f"{self.path}.{field}", exc.value, exc.reason) from exc


def parse_parts(raw: Any, *, path: str = PARTS_PATH) -> DeclaredParts:
    """Validate a ``model.parts`` section (``RecipeError`` naming ``<path>.<field>``)."""
    if not isinstance(raw, dict):
        _fail(path, raw, "must be a mapping of parts")
    sections = set(_SECTIONS)
    top = _read_fields({k: v for k, v in raw.items() if k not in sections}, path=path, fields=_TOP)
    values: dict[str, dict[str, Any] | None] = {
        name: None
        if raw.get(name, {}) is None or (name == "moe" and name not in raw)
        else _read_fields(raw.get(name, {}), path=f"{path}.{name}", fields=fields)
        for name, fields in _SECTIONS.items()
    }
    norm, attention = values["norm"], values["attention"]
    if norm is None:
        raise RecipeError(f"{path}.norm", None, "every decoder has a norm part")
    if attention is None:
        raise RecipeError(f"{path}.attention", None, "every decoder has an attention part")
    if values["mlp"] is None and values["moe"] is None:
        _fail(f"{path}.mlp", None, "a decoder needs an mlp or a moe part")
    if attention["sliding_window"] is None and raw.get("attention", {}).get("sliding_layers"):
        _fail(
            f"{path}.attention.sliding_layers",
            attention["sliding_layers"],
            "needs attention.sliding_window",
        )
    if top["sliding_rope_theta"] is not None and attention["sliding_window"] is None:
        _fail(
            f"{path}.sliding_rope_theta",
            top["sliding_rope_theta"],
            "applies to sliding layers; set attention.sliding_window",
        )
    if top["positions"] != "rope" and top["sliding_rope_theta"] is not None:
        _fail(f"{path}.sliding_rope_theta", top["sliding_rope_theta"], "needs positions=rope")
    if top["positions"] != "rope" and top["nope_layers"]:
        _fail(f"{path}.nope_layers", list(top["nope_layers"]), "needs positions=rope")
    return DeclaredParts(
        norm=norm,
        attention=attention,
        mlp=values["mlp"],
        moe=values["moe"],
        top=top,
        path=path,
    )


def declared_family(parts: DeclaredParts, *, model_type: str) -> DecoderFamily:
    """The family a recipe's ``model.parts`` declares, for checkpoints of ``model_type``."""
    return DecoderFamily(
        name=DECLARED_FAMILY,
        model_types=(model_type,),
        read=parts.read,
        required_keys=hfparts.DECODER_KEYS,
        ignored_suffixes=(".rotary_emb.inv_freq",),
    )
