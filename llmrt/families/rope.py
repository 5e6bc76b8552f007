"""Rotary position embeddings (HF "rotate half" layout): default, linear and Llama-3 scaling."""

from __future__ import annotations

import math
from typing import Any, Literal

import attrs
import torch

from llmrt.errors import CheckpointError
from llmrt.families.hfconfig import HFConfig, positive_number

RopeKind = Literal["default", "linear", "llama3"]


@attrs.frozen(kw_only=True)
class RopeSpec:
    """RoPE parameters; the Llama-3 fields are only used when ``kind == "llama3"``."""

    head_dim: int
    theta: float
    kind: RopeKind = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def read_rope(config: HFConfig, *, head_dim: int) -> RopeSpec:
    """RoPE parameters from ``rope_parameters`` (HF 5) or ``rope_theta``/``rope_scaling``."""
    raw = config.raw
    params: dict[str, Any] = {}
    source = "rope_scaling"
    for key in ("rope_scaling", "rope_parameters"):
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise CheckpointError(f"config.{key}", f"must be a mapping, got {value!r}")
        params.update(value)
        source = key
    theta = positive_number(
        f"config.{source}.rope_theta" if "rope_theta" in params else "config.rope_theta",
        params.get("rope_theta", raw.get("rope_theta", 10000.0)),
    )
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise CheckpointError(
            "config.partial_rotary_factor",
            f"partial rotary embeddings are unsupported, got {partial!r}",
        )

    def number(name: str) -> float:
        if name not in params:
            raise CheckpointError(f"config.{source}.{name}", f"required for rope_type {kind!r}")
        return positive_number(f"config.{source}.{name}", params[name])

    if kind == "default":
        return RopeSpec(head_dim=head_dim, theta=theta)
    if kind == "linear":
        return RopeSpec(head_dim=head_dim, theta=theta, kind="linear", factor=number("factor"))
    if kind == "llama3":
        low, high = number("low_freq_factor"), number("high_freq_factor")
        if high <= low:
            raise CheckpointError(
                f"config.{source}.high_freq_factor",
                f"must be greater than low_freq_factor={low}, got {high}",
            )
        original = params.get("original_max_position_embeddings")
        if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
            raise CheckpointError(
                f"config.{source}.original_max_position_embeddings",
                f"must be a positive integer, got {original!r}",
            )
        return RopeSpec(
            head_dim=head_dim,
            theta=theta,
            kind="llama3",
            factor=number("factor"),
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=original,
        )
    raise CheckpointError(
        f"config.{source}.rope_type",
        f"unsupported RoPE scaling {kind!r} (supported: default, linear, llama3)",
    )


def inverse_frequencies(spec: RopeSpec) -> torch.Tensor:
    """float32 ``[head_dim // 2]`` inverse frequencies, computed exactly as transformers does."""
    dim = spec.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    inv_freq = 1.0 / (spec.theta**exponent)
    if spec.kind == "linear":
        return inv_freq / spec.factor
    if spec.kind == "default":
        return inv_freq
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


def rope_lookup(
    *, cos_cache: torch.Tensor, sin_cache: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[*positions.shape, 1, head_dim]`` from ``rope_cache`` tables.

    Positions past the cache (only padding tokens reach them) read its last row.
    """
    index = positions.long().clamp(0, cos_cache.shape[0] - 1)
    cos, sin = cos_cache[index], sin_cache[index]
    return torch.cat((cos, cos), dim=-1)[..., None, :], torch.cat((sin, sin), dim=-1)[..., None, :]


def apply_rope(x: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., heads, head_dim]`` by the tables from ``rope_lookup``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
