"""Which kernels run a prefill's causal attention and RoPE (``device.attention_kernel``).

``native`` is ``llmrt_kernels.causal_attention`` (padded rows) and ``varlen_causal_attention``
(a packed wave, cached prefixes included): float32 flash-style attention in C++ where each
task holds one KV head's whole query group (see ``csrc/prefill_attention.cpp``), and
``llmrt_kernels.rope`` for the rotary embedding; ``sdpa`` is torch's
``scaled_dot_product_attention`` and torch's RoPE ops. ``auto`` takes the native kernels on
the CPU where they load and the running level has AVX2 (AVX-512 and AVX2 code per level).
Either way a call the native kernels do not cover (not float32, another head_dim, under
``torch.compile``) runs torch's; sliding windows and soft-capping take the masked paths in
``paged_attention`` as before.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import nn

from llmrt.errors import ConfigError
from llmrt.kernels.native import kernels_available

AttentionKernel = Literal["auto", "native", "sdpa"]
ATTENTION_KERNELS: tuple[str, ...] = get_args(AttentionKernel)
#: head_dim values the native kernel is compiled for.
NATIVE_HEAD_DIMS = (16, 32, 64, 128)


def native_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether this call can take the native kernel (checked per call: cheap, no host sync)."""
    return (
        q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.float32
        and q.shape[-1] in NATIVE_HEAD_DIMS
        and not torch.compiler.is_compiling()
    )


def native_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q`` ``[B, H, S, D]``, ``k``/``v`` ``[B, Hkv, S, D]`` -> ``[B, H, S, D]`` (a view of
    ``[B, S, H, D]`` storage)."""
    out: torch.Tensor = torch.ops.llmrt_kernels.causal_attention(q, k, v, scale)
    return out


def native_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_starts: torch.Tensor,
    k_starts: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Packed ragged sequences: ``q`` ``[T, H, D]``, ``k``/``v`` ``[Tk, Hkv, D]``, sequence b's
    rows from ``q_starts[b]``/``k_starts[b]`` (CPU int64 ``[B + 1]``); each sequence's queries
    are its last keys. Returns ``[T, H, D]``."""
    out: torch.Tensor = torch.ops.llmrt_kernels.varlen_causal_attention(
        q, k, v, q_starts, k_starts, scale
    )
    return out


def select_attention_kernel(model: object, *, choice: str, device: torch.device) -> str | None:
    """Point every attention of ``model`` (the modules with a ``native_causal`` flag) at
    ``choice``; returns why the native kernel is not used (None when it is). ``native``
    where it cannot run is a ``ConfigError``."""
    field = "device.attention_kernel"
    if choice not in ATTENTION_KERNELS:
        raise ConfigError(field, choice, f"must be one of {list(ATTENTION_KERNELS)}")
    why = _why_not_native(device) if choice != "sdpa" else "device.attention_kernel is sdpa"
    if choice == "native" and why is not None:
        raise ConfigError(field, choice, f"the native causal attention cannot run: {why}")
    if isinstance(model, nn.Module):
        for module in model.modules():
            if hasattr(module, "native_causal"):
                setattr(module, "native_causal", why is None)  # noqa: B010
    return why


def _why_not_native(device: torch.device) -> str | None:
    if device.type != "cpu":
        return f"runs on {device.type}, not the CPU"
    ok, why = kernels_available()
    if not ok:
        return why
    if not bool(torch.ops.llmrt_kernels.causal_attention_supported(64)):
        return "this CPU (or the forced LLMRT_KERNELS_ISA level) has no AVX2"
    return None
