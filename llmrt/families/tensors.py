"""Checkpoint tensor validation shared by the families.

Everything is checked before a single parameter is built, so a bad checkpoint
never yields a half-built model.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from llmrt.errors import CheckpointError
from llmrt.kernels.formats import CheckpointTensor, QuantizedWeight


def check_tensors(
    *,
    tensors: Mapping[str, CheckpointTensor],
    expected: Mapping[str, tuple[int, ...]],
    optional: Collection[str],
    ignored_suffixes: tuple[str, ...] = (),
) -> dict[str, CheckpointTensor]:
    """Validate ``tensors`` against ``expected`` shapes and return the ones the family uses.

    Missing (non-optional) tensors, wrong shapes, non-floating dtypes, non-finite
    values and unexpected names raise ``CheckpointError`` naming the tensor. Names
    ending in ``ignored_suffixes`` (buffers older checkpoints carry, e.g. rotary
    ``inv_freq``) are dropped silently.
    """
    missing = sorted(name for name in expected if name not in tensors and name not in optional)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        )
        raise CheckpointError(missing[0], f"missing from checkpoint; missing tensors: {shown}")
    unexpected = sorted(
        name for name in tensors if name not in expected and not name.endswith(ignored_suffixes)
    )
    if unexpected:
        shown = ", ".join(unexpected[:5])
        raise CheckpointError(
            unexpected[0], f"unexpected tensor for this family/config; unexpected: {shown}"
        )
    used: dict[str, CheckpointTensor] = {}
    for name, shape in expected.items():
        tensor = tensors.get(name)
        if tensor is None:
            continue
        if isinstance(tensor, QuantizedWeight):
            if tuple(tensor.shape) != tuple(shape):
                reason = f"has shape {tuple(tensor.shape)}, expected {tuple(shape)}"
                raise CheckpointError(name, reason)
            used[name] = tensor
            continue
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(name, f"must be a torch.Tensor, got {type(tensor).__name__}")
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(name, f"has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
        if not tensor.is_floating_point():
            raise CheckpointError(name, f"must be a floating-point tensor, got {tensor.dtype}")
        if not _all_finite(tensor):
            raise CheckpointError(name, "contains non-finite values (nan/inf)")
        used[name] = tensor
    return used


def _all_finite(tensor: torch.Tensor) -> bool:
    """True when no element is nan or inf, without a tensor-sized temporary.

    ``torch.isfinite(t).all()`` allocates and writes a bool per element (seconds on a whole
    checkpoint); the extremes are finite exactly when every element is (nan propagates).
    """
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor.detach())
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))
