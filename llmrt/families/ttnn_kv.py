"""The check every ttnn model runs on the KV cache it is handed, before binding any of it.

A ttnn model keeps K/V as one device tensor per layer and side on its own mesh; a cache built
for another mesh, shape or dtype would fail deep inside a paged kernel (or, on a chip, write
another allocation), so ``set_kv_cache`` validates the whole cache first and binds nothing
when any tensor is wrong.
"""

from __future__ import annotations

from typing import Any

from llmrt.errors import ConfigError
from llmrt.families.base import AttentionMetadata, KVCacheView


def checked_kv_cache(
    tt: Any,
    cache: KVCacheView,
    *,
    meta: AttentionMetadata,
    mesh_id: int,
    tiles: bool,
) -> tuple[tuple[Any, ...], tuple[Any, ...], int]:
    """``cache``'s keys, values and block size once every layer's K/V is a float ttnn device
    tensor on mesh ``mesh_id`` with the shape ``meta`` expects (in tile layout when ``tiles``);
    otherwise a ``ConfigError`` naming the first wrong tensor."""
    block_size = cache.block_size
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ConfigError("kv_cache.block_size", block_size, "must be a positive integer")
    keys, values = tuple(cache.keys), tuple(cache.values)
    for field, tensors in (("kv_cache.keys", keys), ("kv_cache.values", values)):
        if len(tensors) != meta.num_layers:
            raise ConfigError(
                field, len(tensors), f"needs one tensor per layer ({meta.num_layers})"
            )
    floats = (tt.float32, tt.bfloat16, tt.bfloat8_b)
    expected: tuple[int, ...] | None = None
    for layer in range(meta.num_layers):
        for field, tensor in (
            (f"kv_cache.keys[{layer}]", keys[layer]),
            (f"kv_cache.values[{layer}]", values[layer]),
        ):
            if not isinstance(tensor, tt.Tensor):
                raise ConfigError(field, type(tensor).__name__, "must be a ttnn.Tensor")
            mesh = tensor.device()
            if (
                tensor.storage_type() != tt.StorageType.DEVICE
                or mesh is None
                or mesh.id() != mesh_id
            ):
                raise ConfigError(field, repr(tensor), f"must be on mesh {mesh_id}")
            shape = tuple(int(d) for d in tensor.shape)
            if expected is None:
                if len(shape) != 4 or shape[0] <= 0:
                    raise ConfigError(field, shape, "must be 4-d with >= 1 block")
                expected = meta.kv_shape(shape[0], block_size)
            if shape != expected:
                raise ConfigError(field, shape, f"expected shape {expected}")
            if tensor.dtype not in floats or (tiles and tensor.layout != tt.TILE_LAYOUT):
                where = " in tiles" if tiles else ""
                raise ConfigError(field, tensor.dtype, f"expected one of {floats}{where}")
    return keys, values, block_size
