"""Validation and binding of the borrowed paged KV cache a model computes over."""

from __future__ import annotations

import attrs
import torch

from llmrt.errors import ConfigError, KVCacheStateError
from llmrt.families.base import SUPPORTED_DTYPES, AttentionMetadata, KVCacheView


@attrs.frozen(kw_only=True)
class BoundKV:
    """Per-layer K/V tensors borrowed from the runtime (the runtime owns and frees them)."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    block_size: int


def check_kv_cache(
    *, cache: KVCacheView, metadata: AttentionMetadata, device: torch.device
) -> BoundKV:
    """Validate every layer's K/V shape, dtype and device; return the binding or raise.

    The KV dtype may differ from ``metadata.kv_dtypes`` (the model's preference, e.g. a
    bfloat16 cache under a float32 model): K/V are cast on write and read. Raises
    ``ConfigError`` naming the first offending tensor; nothing is bound on failure.
    """
    block_size = cache.block_size
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ConfigError("kv_cache.block_size", block_size, "must be a positive integer")
    keys, values = tuple(cache.keys), tuple(cache.values)
    for field, tensors in (("kv_cache.keys", keys), ("kv_cache.values", values)):
        if len(tensors) != metadata.num_layers:
            raise ConfigError(
                field, len(tensors), f"needs one tensor per layer ({metadata.num_layers})"
            )
    first = keys[0]
    if not isinstance(first, torch.Tensor) or first.dim() != 4 or first.shape[0] <= 0:
        shown = tuple(first.shape) if isinstance(first, torch.Tensor) else type(first).__name__
        raise ConfigError("kv_cache.keys[0]", shown, "must be a 4-d tensor with >= 1 block")
    expected = metadata.kv_shape(first.shape[0], block_size)
    for layer in range(metadata.num_layers):
        for field, tensor in (
            (f"kv_cache.keys[{layer}]", keys[layer]),
            (f"kv_cache.values[{layer}]", values[layer]),
        ):
            if not isinstance(tensor, torch.Tensor):
                raise ConfigError(field, type(tensor).__name__, "must be a torch.Tensor")
            if tuple(tensor.shape) != expected:
                raise ConfigError(field, tuple(tensor.shape), f"expected shape {expected}")
            if tensor.dtype not in SUPPORTED_DTYPES or tensor.dtype != keys[layer].dtype:
                raise ConfigError(
                    field,
                    tensor.dtype,
                    f"expected one of {', '.join(map(str, SUPPORTED_DTYPES))}, the same for "
                    f"K and V of a layer (the model prefers {metadata.kv_dtypes[layer]})",
                )
            if not _same_device(tensor.device, device):
                raise ConfigError(field, str(tensor.device), f"expected device {device}")
    return BoundKV(keys=keys, values=values, block_size=block_size)


def require_bound(bound: BoundKV | None) -> BoundKV:
    """The bound cache, or ``KVCacheStateError`` when the model has none."""
    if bound is None:
        raise KVCacheStateError("no KV cache is bound to the model; call set_kv_cache() first")
    return bound


def _same_device(actual: torch.device, expected: torch.device) -> bool:
    if actual.type != expected.type:
        return False
    if actual.index is None or expected.index is None:
        return True
    return actual.index == expected.index
