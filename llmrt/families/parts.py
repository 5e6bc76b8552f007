"""The parts catalogue: declarative specs of every piece a decoder-only model is built from.

A family maps a Hugging Face ``config.json`` onto a ``DecoderSpec`` (and tensor names onto
``TensorNames``); ``llmrt.families.decoder`` builds the one decoder every family shares from
it. What the catalogue lacks, a package adds from outside without editing llmrt: an
activation or a norm kind through ``llmrt.families.forms`` (name + torch form), any other
MLP-slot part as a ``CustomPart`` (its tensors and its module) in ``DecoderSpec.mlp``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args, runtime_checkable

import attrs

from llmrt.errors import ConfigError
from llmrt.families.base import ModelConfig
from llmrt.families.forms import HF_ACTIVATIONS, activation_names, norm_kinds
from llmrt.families.rope import RopeSpec

if TYPE_CHECKING:
    import torch
    from torch import nn

#: Built-in norm kinds (``forms.register_norm`` adds more): ``rms`` ``w * x``,
#: ``rms_one_plus`` ``(1 + w) * x``, ``layer`` LayerNorm, ``layer_one_plus`` LayerNorm
#: scaled by ``1 + w`` (Nemotron's LayerNorm1P).
NormKind = str
#: Built-in activations: silu, gelu, gelu_tanh, relu, relu2 (``forms.register_activation``
#: adds more).
Activation = str
MLPKind = Literal["gated", "plain"]
QKNorm = Literal["head", "proj"]
Residual = Literal["sequential", "parallel"]
Routing = Literal["softmax_topk", "softmax_topk_normalized"]
#: How RoPE pairs a head's channels: ``neox`` rotates channel i with i + d/2 (Llama, HF's
#: ``rotate_half``), ``interleaved`` rotates 2i with 2i + 1 (GPT-J, Cohere, GLM, Helium).
RopeStyle = Literal["neox", "interleaved"]
TensorInit = Literal["normal", "ones", "zeros"]

__all__ = ["HF_ACTIVATIONS"]


def _check_registered(path: str, value: Any, names: tuple[str, ...]) -> None:
    if value not in names:
        raise ConfigError(path, value, f"must be one of {list(names)}")


def _check_literal(path: str, value: Any, literal: Any) -> None:
    choices = get_args(literal)
    if value not in choices:
        raise ConfigError(path, value, f"must be one of {list(choices)}")


def _positive(path: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(path, value, "must be a positive integer")


def _positive_float(path: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(path, value, "must be a positive number")


@attrs.frozen(kw_only=True)
class NormSpec:
    """RMSNorm (``w * x``), Gemma's RMSNorm (``(1 + w) * x``), LayerNorm (``w``, ``1 + w``
    or no weight at all; optional bias) or a registered kind (``forms.register_norm``)."""

    kind: NormKind = "rms"
    eps: float = 1e-6
    bias: bool = False
    weight: bool = True

    def __attrs_post_init__(self) -> None:
        _check_registered("norm.kind", self.kind, norm_kinds())
        _positive_float("norm.eps", self.eps)
        if self.bias and self.kind.startswith("rms"):
            raise ConfigError("norm.bias", self.bias, f"an {self.kind} norm has no bias")
        if not self.weight and self.kind.endswith("one_plus"):
            raise ConfigError("norm.weight", False, f"a {self.kind} norm scales by 1 + weight")


@attrs.frozen(kw_only=True)
class MLPSpec:
    """Dense MLP: gated (``down(act(gate x) * up x)``) or plain (``down(act(up x))``)."""

    kind: MLPKind = "gated"
    activation: Activation = "silu"
    intermediate_size: int
    bias: bool = False

    def __attrs_post_init__(self) -> None:
        _check_literal("mlp.kind", self.kind, MLPKind)
        _check_registered("mlp.activation", self.activation, activation_names())
        _positive("mlp.intermediate_size", self.intermediate_size)


@attrs.frozen(kw_only=True)
class MoESpec:
    """Mixture of experts: a top-k router over gated experts, optional shared expert.

    ``softmax_topk`` weighs the chosen experts by their softmax probability over all
    experts; ``softmax_topk_normalized`` renormalizes those k weights to sum to one.
    The shared expert (``shared_intermediate_size``) runs on every token, scaled by
    ``sigmoid(shared_gate x)`` when ``shared_gate`` is set.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    activation: Activation = "silu"
    routing: Routing = "softmax_topk_normalized"
    shared_intermediate_size: int | None = None
    shared_gate: bool = False

    def __attrs_post_init__(self) -> None:
        _positive("moe.num_experts", self.num_experts)
        _positive("moe.top_k", self.top_k)
        if self.top_k > self.num_experts:
            raise ConfigError(
                "moe.top_k", self.top_k, f"must not exceed moe.num_experts={self.num_experts}"
            )
        _positive("moe.intermediate_size", self.intermediate_size)
        _check_registered("moe.activation", self.activation, activation_names())
        _check_literal("moe.routing", self.routing, Routing)
        if self.shared_intermediate_size is not None:
            _positive("moe.shared_intermediate_size", self.shared_intermediate_size)
        elif self.shared_gate:
            raise ConfigError(
                "moe.shared_gate", True, "needs moe.shared_intermediate_size (a shared expert)"
            )


@attrs.frozen(kw_only=True)
class AttentionSpec:
    """Grouped-query attention over the paged KV cache and its options.

    ``scale`` multiplies the scores (``head_dim ** -0.5`` unless a family pre-scales the
    query differently); ``qk_norm`` normalizes q and k per head (``head``) or over the
    whole projection (``proj``); ``qk_norm_per_head_weights`` gives each head its own
    norm weight (``[heads, head_dim]``); ``softcap`` bounds the scores; ``clip_qkv`` clamps
    the q/k/v projections to ``[-clip_qkv, clip_qkv]`` (OLMo); ``rope_style`` says how RoPE
    pairs channels (``interleaved``: GPT-J style, computed by loading q/k rows in the
    ``neox`` order, so every kernel serves it).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: QKNorm | None = None
    qk_norm_spec: NormSpec = attrs.Factory(NormSpec)
    qk_norm_per_head_weights: bool = False
    softcap: float | None = None
    clip_qkv: float | None = None
    rope_style: RopeStyle = "neox"

    def __attrs_post_init__(self) -> None:
        _check_literal("attention.rope_style", self.rope_style, RopeStyle)
        if self.clip_qkv is not None:
            _positive_float("attention.clip_qkv", self.clip_qkv)
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            _positive(f"attention.{name}", getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                "attention.num_kv_heads",
                self.num_kv_heads,
                f"must divide attention.num_heads={self.num_heads}",
            )
        _positive_float("attention.scale", self.scale)
        if self.qk_norm is not None:
            _check_literal("attention.qk_norm", self.qk_norm, QKNorm)
        if self.qk_norm_per_head_weights and self.qk_norm != "head":
            raise ConfigError(
                "attention.qk_norm_per_head_weights", True, "needs attention.qk_norm=head"
            )
        if self.softcap is not None:
            _positive_float("attention.softcap", self.softcap)


@runtime_checkable
class CustomPart(Protocol):
    """A part from outside the catalogue, in a layer's MLP slot (``DecoderSpec.mlp``): it
    names its checkpoint tensors and builds its module. ``tensors(prefix, hidden)`` maps each
    full tensor name (``prefix``: the layer's, e.g. ``model.layers.3.``) to its shape and
    random initialisation; ``build(prefix, linear, take)`` returns the module
    (``[..., hidden] -> [..., hidden]``), making every matmul with ``linear(*prefixes,
    bias=...)`` (the linear factory: weight formats and kernels apply; several prefixes are
    stacked into one matmul) and reading any other tensor with ``take(name)``."""

    def tensors(
        self, *, prefix: str, hidden: int
    ) -> Mapping[str, tuple[tuple[int, ...], TensorInit]]: ...

    def build(
        self,
        *,
        prefix: str,
        linear: Callable[..., nn.Module],
        take: Callable[[str], torch.Tensor],
    ) -> nn.Module: ...


@runtime_checkable
class CustomAttention(Protocol):
    """A part from outside the catalogue in a layer's attention slot
    (``DecoderSpec.attention_part``), declared as ``CustomPart`` is: ``tensors(prefix,
    hidden)`` names its checkpoint tensors (shape, random init), ``build(prefix, linear,
    take, window)`` returns its module, with ``window`` the layer's sliding window (None:
    full). ``DecoderSpec.attention`` still gives the heads and head size the KV cache and
    the RoPE tables are made for.

    The module is called as ``module(x, rope=, plan=, k_cache=, v_cache=)`` with ``x``
    ``[B, S, hidden]``, ``rope`` the layer's ``(cos, sin)`` or None, and returns
    ``[B, S, hidden]``; it writes its K/V and attends through
    ``llmrt.families.paged_attention.attend`` (``llmrt.families.rope.apply_rope`` rotates
    q and k), so paging, prefix caching and padding behave as in every other family. The
    fused CPU decode op has no phase for it: such a model decodes through the torch ops
    (``fused_decode_status()``: ``not fused: attention part <its class> (layers.N)``)."""

    def tensors(
        self, *, prefix: str, hidden: int
    ) -> Mapping[str, tuple[tuple[int, ...], TensorInit]]: ...

    def build(
        self,
        *,
        prefix: str,
        linear: Callable[..., nn.Module],
        take: Callable[[str], torch.Tensor],
        window: int | None,
    ) -> nn.Module: ...


#: ``AttentionSpec`` options the built-in attention computes, which a custom attention part
#: would silently ignore (its own module decides), with their defaults.
_BUILTIN_ATTENTION_OPTIONS = {
    "qkv_bias": False,
    "o_bias": False,
    "qk_norm": None,
    "softcap": None,
    "clip_qkv": None,
    "rope_style": "neox",
}


@attrs.frozen(kw_only=True)
class LayerSpec:
    """What varies between layers: sliding window, which RoPE variant (None: no
    positional encoding in this layer), and a dense or mixture-of-experts MLP."""

    window: int | None = None
    rope: int | None = 0
    moe: bool = False


@attrs.frozen(kw_only=True)
class DecoderSpec:
    """A whole decoder-only model, part by part.

    ``residual``: ``sequential`` is ``h = x + post_attn_norm(attn(attn_norm(x)))`` then
    ``h + post_mlp_norm(mlp(mlp_norm(h)))``, where each norm slot may be absent (pre-norm:
    the input norms; Gemma-2: all four; OLMo-2's post-norm: the output norms only).
    ``parallel`` is ``x + attn(attn_norm(x)) + mlp(mlp_norm(x))`` (``mlp_norm`` None: the
    MLP reads the attention norm's output). ``positions``: ``rope`` (the ``ropes``
    variants, chosen per layer), ``learned`` (an absolute position table) or ``none``.
    """

    model: ModelConfig
    attention: AttentionSpec
    mlp: MLPSpec | CustomPart | None
    moe: MoESpec | None = None
    norm: NormSpec
    layers: tuple[LayerSpec, ...]
    residual: Residual = "sequential"
    attn_norm: bool = True
    post_attn_norm: bool = False
    mlp_norm: bool = True
    post_mlp_norm: bool = False
    final_norm: bool = True
    positions: Literal["rope", "learned", "none"] = "rope"
    ropes: tuple[RopeSpec, ...] = ()
    embedding_scale: float = 1.0
    residual_multiplier: float = 1.0
    logit_scale: float = 1.0
    final_softcap: float | None = None
    tie_word_embeddings: bool = False
    lm_head_bias: bool = False
    #: A package's attention module in every layer's attention slot (``CustomAttention``).
    attention_part: CustomAttention | None = None

    def __attrs_post_init__(self) -> None:
        m = self.model
        if self.mlp is not None and not isinstance(self.mlp, MLPSpec | CustomPart):
            raise ConfigError("mlp", self.mlp, "must be an MLPSpec or a CustomPart")
        if self.attention_part is not None:
            if not isinstance(self.attention_part, CustomAttention):
                raise ConfigError(
                    "attention_part",
                    type(self.attention_part).__name__,
                    "must have tensors(prefix=, hidden=) and build(prefix=, linear=, take=, "
                    "window=) (CustomAttention)",
                )
            for option, default in _BUILTIN_ATTENTION_OPTIONS.items():
                if getattr(self.attention, option) != default:
                    raise ConfigError(
                        f"attention.{option}",
                        getattr(self.attention, option),
                        "is computed by the built-in attention, which attention_part "
                        "replaces (the part's module must do it)",
                    )
        if len(self.layers) != m.num_layers:
            raise ConfigError(
                "layers", len(self.layers), f"needs one entry per layer ({m.num_layers})"
            )
        _check_literal("residual", self.residual, Residual)
        if self.residual == "parallel" and (self.post_attn_norm or self.post_mlp_norm):
            raise ConfigError("residual", "parallel", "has no post-attention/post-MLP norms")
        if self.positions == "rope":
            if not self.ropes:
                raise ConfigError("ropes", (), "positions=rope needs at least one RoPE variant")
            for r in self.ropes:
                if r.head_dim > self.attention.head_dim:
                    raise ConfigError(
                        "ropes.head_dim", r.head_dim, "must not exceed attention.head_dim"
                    )
        for i, layer in enumerate(self.layers):
            rope = layer.rope
            if rope is not None and self.positions == "rope" and not 0 <= rope < len(self.ropes):
                raise ConfigError(f"layers[{i}].rope", layer.rope, "names no RoPE variant")
            if layer.window is not None:
                _positive(f"layers[{i}].window", layer.window)
            if layer.moe and self.moe is None:
                raise ConfigError(f"layers[{i}].moe", True, "needs a moe part")
            if not layer.moe and self.mlp is None:
                raise ConfigError(f"layers[{i}].moe", False, "needs an mlp part")
        for name in ("embedding_scale", "residual_multiplier", "logit_scale"):
            _positive_float(name, getattr(self, name))
        if self.final_softcap is not None:
            _positive_float("final_softcap", self.final_softcap)
        if (m.num_heads, m.num_kv_heads, m.head_dim) != (
            self.attention.num_heads,
            self.attention.num_kv_heads,
            self.attention.head_dim,
        ):
            raise ConfigError("attention", self.attention, "must match the model's head geometry")
