"""``checked_kv_cache``: the check both ttnn models (the decoder families' and the toy) run on
a KV cache before binding it; each wrong tensor is named, and the right cache passes whole."""

from __future__ import annotations

import re
from typing import Any

import attrs
import pytest
import torch

from llmrt.errors import ConfigError
from llmrt.families.base import AttentionMetadata
from llmrt.families.ttnn_kv import checked_kv_cache
from llmrt.testing.fake_ttnn import FakeTtnn

META = AttentionMetadata(num_layers=2, num_kv_heads=2, head_dim=32, kv_dtypes=(torch.bfloat16,) * 2)


@attrs.frozen
class Cache:
    keys: tuple[Any, ...]
    values: tuple[Any, ...]
    block_size: Any = 32


def _setup() -> tuple[FakeTtnn, Any, Any]:
    tt = FakeTtnn(system_mesh_shape=(1, 2))
    mesh = tt.open_mesh_device(tt.MeshShape(1, 1))
    other = tt.open_mesh_device(tt.MeshShape(1, 1))

    def kv(*, device: Any = mesh, shape: tuple[int, ...] = (4, 2, 32, 32), **kw: Any) -> Any:
        layout = kw.pop("layout", tt.TILE_LAYOUT)
        dtype = kw.pop("dtype", tt.bfloat16)
        return tt.from_torch(torch.zeros(shape), dtype, layout=layout, device=device)

    return tt, (mesh, other), kv


def test_a_right_cache_passes_and_each_wrong_tensor_is_named() -> None:
    tt, (mesh, other), kv = _setup()
    good = Cache(keys=(kv(), kv()), values=(kv(), kv()))
    keys, values, block_size = checked_kv_cache(tt, good, meta=META, mesh_id=mesh.id(), tiles=True)
    assert keys == good.keys and values == good.values and block_size == 32
    wrong = {
        "kv_cache.block_size": attrs.evolve(good, block_size=0),
        "kv_cache.keys": attrs.evolve(good, keys=(kv(),)),
        "kv_cache.values[1]": attrs.evolve(good, values=(kv(), torch.zeros(4, 2, 32, 32))),
        "kv_cache.keys[0]": attrs.evolve(good, keys=(kv(device=other), kv())),
        "kv_cache.values[0]": attrs.evolve(good, values=(kv(shape=(4, 2, 16, 32)), kv())),
        "kv_cache.keys[1]": attrs.evolve(good, keys=(kv(), kv(layout=tt.ROW_MAJOR_LAYOUT))),
    }
    for field, cache in wrong.items():
        with pytest.raises(ConfigError, match="^" + re.escape(field) + ":"):
            checked_kv_cache(tt, cache, meta=META, mesh_id=mesh.id(), tiles=True)
    # A row-major cache is accepted where the model does not need tiles (the toy model).
    row_major = attrs.evolve(good, keys=(kv(), kv(layout=tt.ROW_MAJOR_LAYOUT)))
    checked_kv_cache(tt, row_major, meta=META, mesh_id=mesh.id(), tiles=False)
    host = attrs.evolve(good, keys=(tt.from_torch(torch.zeros(4, 2, 32, 32), tt.bfloat16), kv()))
    with pytest.raises(ConfigError, match=r"must be on mesh"):
        checked_kv_cache(tt, host, meta=META, mesh_id=mesh.id(), tiles=False)


@pytest.mark.parametrize(
    ("kv_heads", "chips", "per_chip"),
    [(8, 8, 1), (16, 8, 2), (2, 8, 1), (1, 8, 1), (4, 2, 2)],
)
def test_each_chip_holds_the_plugins_kv_heads(kv_heads: int, chips: int, per_chip: int) -> None:
    """Split when the chips divide the heads, one replicated head when the heads divide the
    chips: the vLLM TT plugin's ``num_kv_heads // min(devices, num_kv_heads)``."""
    meta = AttentionMetadata(
        num_layers=1,
        num_kv_heads=kv_heads,
        head_dim=32,
        kv_dtypes=(torch.bfloat16,),
        tensor_parallel=chips,
    )
    assert meta.kv_shape(5, 16) == (5, per_chip, 16, 32)


@pytest.mark.parametrize(("kv_heads", "chips"), [(3, 8), (12, 8), (2, 3)])
def test_kv_heads_that_neither_split_nor_replicate_evenly_are_refused(
    kv_heads: int, chips: int
) -> None:
    with pytest.raises(ConfigError, match=rf"^num_kv_heads: must divide over the {chips} "):
        AttentionMetadata(
            num_layers=1,
            num_kv_heads=kv_heads,
            head_dim=32,
            kv_dtypes=(torch.bfloat16,),
            tensor_parallel=chips,
        )
