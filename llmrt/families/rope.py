"""Rotary position embeddings (HF "rotate half" layout), full or partial, with every
``rope_type`` transformers defines for these architectures: default, linear, dynamic
(NTK), llama3, yarn and longrope.

Angles come from per-position cos/sin tables (``rope_cache``); scalings that multiply
the tables (yarn's and longrope's attention factor) are folded into them, and longrope's
long factors serve the positions at or past ``original_max_position_embeddings``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import attrs
import torch

from llmrt.errors import CheckpointError
from llmrt.families.hfconfig import HFConfig, positive_number

RopeKind = Literal["default", "linear", "dynamic", "llama3", "yarn", "longrope"]
ROPE_KINDS: tuple[str, ...] = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@attrs.frozen(kw_only=True)
class RopeSpec:
    """RoPE parameters; fields beyond ``theta`` matter only for the kinds that read them.

    ``head_dim`` is the rotated width (``int(head_dim * partial_rotary_factor)``): the
    first ``head_dim`` channels of each head rotate, the rest pass through.
    """

    head_dim: int
    theta: float
    kind: RopeKind = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


def rope_parameters(config: HFConfig) -> tuple[str, dict[str, Any]]:
    """The merged ``rope_scaling``/``rope_parameters`` mapping and the key it came from."""
    params: dict[str, Any] = {}
    source = "rope_scaling"
    for key in ("rope_scaling", "rope_parameters"):
        value = config.raw.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise CheckpointError(f"config.{key}", f"must be a mapping, got {value!r}")
        params.update(value)
        source = key
    return source, params


def read_rope(
    config: HFConfig,
    *,
    head_dim: int,
    max_positions: int | None = None,
    default_theta: float = 10000.0,
    default_partial: float = 1.0,
) -> RopeSpec:
    """RoPE parameters from ``rope_parameters`` (HF 5) or ``rope_theta``/``rope_scaling``;
    ``default_theta`` / ``default_partial`` are the architecture's transformers defaults for
    a config that gives no ``rope_theta`` / ``partial_rotary_factor``."""
    source, params = rope_parameters(config)
    return read_rope_params(
        params,
        item=f"config.{source}",
        config=config,
        head_dim=head_dim,
        max_positions=max_positions,
        default_theta=default_theta,
        default_partial=default_partial,
    )


def read_rope_params(
    params: Mapping[str, Any],
    *,
    item: str,
    config: HFConfig,
    head_dim: int,
    max_positions: int | None,
    default_theta: float = 10000.0,
    default_partial: float = 1.0,
) -> RopeSpec:
    """One RoPE variant from a ``rope_parameters``-style mapping (``item`` names it in errors).

    Top-level ``rope_theta``/``partial_rotary_factor`` are the fallbacks older configs use.
    """
    raw = config.raw
    theta = positive_number(
        f"{item}.rope_theta" if "rope_theta" in params else "config.rope_theta",
        params.get("rope_theta", raw.get("rope_theta", default_theta)),
    )
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", default_partial))
    partial_item = (
        f"{item}.partial_rotary_factor"
        if "partial_rotary_factor" in params
        else "config.partial_rotary_factor"
    )
    if positive_number(partial_item, partial) > 1.0:
        raise CheckpointError(partial_item, f"must be in (0, 1], got {partial!r}")
    dim = int(head_dim * float(partial))
    if dim < 2 or dim % 2:
        raise CheckpointError(
            partial_item, f"rotates {dim} of {head_dim} channels; needs an even count >= 2"
        )

    def number(name: str, default: float | None = None) -> float:
        if params.get(name) is None:
            if default is not None:
                return default
            raise CheckpointError(f"{item}.{name}", f"required for rope_type {kind!r}")
        return positive_number(f"{item}.{name}", params[name])

    def original(default: int | None = None) -> int:
        value = params.get("original_max_position_embeddings")
        if value is None:
            value = raw.get("original_max_position_embeddings", default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CheckpointError(
                f"{item}.original_max_position_embeddings",
                f"must be a positive integer, got {value!r}",
            )
        return value

    def make(**fields: Any) -> RopeSpec:
        return RopeSpec(head_dim=dim, theta=theta, **fields)

    if kind == "default":
        return make()
    if kind == "linear":
        return make(kind="linear", factor=number("factor"))
    if kind == "dynamic":
        # Dynamic NTK rescales only positions past max_position_embeddings, which the
        # runtime never serves (the KV cache spans at most that many): default angles.
        number("factor")
        return make(kind="dynamic")
    if kind == "llama3":
        low, high = number("low_freq_factor"), number("high_freq_factor")
        if high <= low:
            raise CheckpointError(
                f"{item}.high_freq_factor",
                f"must be greater than low_freq_factor={low}, got {high}",
            )
        return make(
            kind="llama3",
            factor=number("factor"),
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=original(),
        )
    if kind == "yarn":
        old = original()
        factor = number("factor", (max_positions or old) / old)
        attention = params.get("attention_factor")
        if attention is None:
            mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
            if mscale and mscale_all:
                attention = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(
                    factor, float(mscale_all)
                )
            else:
                attention = _yarn_mscale(factor, 1.0)
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise CheckpointError(f"{item}.truncate", f"must be true or false, got {truncate!r}")
        return make(
            kind="yarn",
            factor=factor,
            original_max_position_embeddings=old,
            attention_factor=positive_number(f"{item}.attention_factor", attention),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            truncate=truncate,
        )
    if kind == "longrope":
        old = original(max_positions)
        factor = number("factor", (max_positions or old) / old)
        attention = params.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
        factors = {}
        for name in ("short_factor", "long_factor"):
            value = params.get(name)
            if not isinstance(value, list | tuple) or len(value) != dim // 2:
                raise CheckpointError(
                    f"{item}.{name}", f"must list {dim // 2} numbers, got {value!r}"
                )
            factors[name] = tuple(positive_number(f"{item}.{name}", v) for v in value)
        return make(
            kind="longrope",
            factor=factor,
            original_max_position_embeddings=old,
            attention_factor=positive_number(f"{item}.attention_factor", attention),
            short_factor=factors["short_factor"],
            long_factor=factors["long_factor"],
        )
    raise CheckpointError(
        f"{item}.rope_type",
        f"unsupported RoPE scaling {kind!r} (supported: {', '.join(ROPE_KINDS)})",
    )


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim


def inverse_frequencies(spec: RopeSpec, *, long: bool = False) -> torch.Tensor:
    """float32 ``[head_dim // 2]`` inverse frequencies, computed exactly as transformers does.

    ``long`` selects longrope's long factors (positions past the original context).
    """
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.theta ** _exponents(dim))
    if spec.kind in ("default", "dynamic"):
        return inv_freq
    if spec.kind == "linear":
        return inv_freq / spec.factor
    if spec.kind == "longrope":
        factors = torch.tensor(spec.long_factor if long else spec.short_factor)
        return 1.0 / (factors * spec.theta ** _exponents(dim))
    if spec.kind == "yarn":
        return _yarn_inverse_frequencies(spec)
    old_context = spec.original_max_position_embeddings
    low_wavelen = old_context / spec.low_freq_factor
    high_wavelen = old_context / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (old_context / wavelen - spec.low_freq_factor) / (
        spec.high_freq_factor - spec.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inverse_frequencies(spec: RopeSpec) -> torch.Tensor:
    dim, base = spec.head_dim, spec.theta
    old = spec.original_max_position_embeddings

    def correction(rotations: float) -> float:
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction(spec.beta_fast), correction(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (spec.factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def rope_cache(
    *, inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[max_positions, head_dim // 2]`` of every position, computed once.

    Looking angles up instead of computing them per step keeps ``cos``/``sin`` out of
    compiled kernels: inductor otherwise inlines them into every consumer, recomputing the
    query's rotation for each key it is scored against. vLLM keeps the same cache.
    """
    positions = torch.arange(max_positions, device=inv_freq.device)
    freqs = positions[:, None].float() * inv_freq
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def rope_tables(
    spec: RopeSpec, *, max_positions: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for ``spec`` (attention factor folded in, longrope's two ranges)."""
    inv_freq = inverse_frequencies(spec).to(device)
    positions = torch.arange(max_positions, device=device)
    freqs = positions[:, None].float() * inv_freq
    if spec.kind == "longrope":
        long = positions[:, None].float() * inverse_frequencies(spec, long=True).to(device)
        past = (positions >= spec.original_max_position_embeddings)[:, None]
        freqs = torch.where(past, long, freqs)
    cos, sin = freqs.cos(), freqs.sin()
    if spec.attention_factor != 1.0:
        cos, sin = cos * spec.attention_factor, sin * spec.attention_factor
    return cos.to(dtype), sin.to(dtype)


def rope_lookup(
    *, cos_cache: torch.Tensor, sin_cache: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[*positions.shape, 1, head_dim]`` from ``rope_cache`` tables.

    Positions past the cache (only padding tokens reach them) read its last row.
    """
    index = positions.long().clamp(0, cos_cache.shape[0] - 1)
    cos, sin = cos_cache[index], sin_cache[index]
    return torch.cat((cos, cos), dim=-1)[..., None, :], torch.cat((sin, sin), dim=-1)[..., None, :]


def apply_rope(
    x: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor, native: bool = False
) -> torch.Tensor:
    """Rotate ``x`` ``[..., heads, head_dim]`` by the tables from ``rope_lookup``.

    Tables narrower than ``head_dim`` (partial rotary) rotate the leading channels only.
    ``native`` (the kernels are loaded): a float32 CPU call over the full head_dim takes
    ``llmrt_kernels.rope``, one pass instead of torch's five, with equal results.
    """
    if native and _native_rope_usable(x, cos, sin):
        lead = x.shape[:-2]
        out: torch.Tensor = torch.ops.llmrt_kernels.rope(
            x.flatten(0, -3), cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
        )
        return out.view(*lead, *x.shape[-2:])
    width = cos.shape[-1]
    if width < x.shape[-1]:
        rotated = apply_rope(x[..., :width], cos=cos, sin=sin)
        return torch.cat((rotated, x[..., width:]), dim=-1)
    half = width // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


def _native_rope_usable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == cos.dtype == sin.dtype == torch.float32
        and x.dim() >= 3
        and x.stride(-1) == 1
        and cos.shape == sin.shape
        and cos.shape[-1] == x.shape[-1]
        and cos.shape[:-2] == x.shape[:-2]
        and cos.shape[-2] == 1
        and not torch.compiler.is_compiling()
    )
