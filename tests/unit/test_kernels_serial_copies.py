"""Build-time copies of weight blocks up to ``SERIAL_COPY_BYTES`` run on the calling thread.

Fusing parts (``concat_rows``), permuting rows (``select_rows``) and packing a stacked weight
copy blocks without torch's parallel copy ops up to that size (each parallel region wakes the
thread team: a scheduler time slice per call where the cores are busy), and give the same
bytes as torch's ops, which still take larger copies. The reference here is gguf-py's
dequantization of the parts, independent of the code under test.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmrt.kernels import formats
from llmrt.kernels.formats import (
    BLOCK_BYTES,
    GGML_TYPE,
    QuantizedWeight,
    StackedWeight,
    concat_rows,
)


def _weight(kind: str, *, rows: int, seed: int, cols: int = 256) -> QuantizedWeight:
    rng = np.random.default_rng(seed)
    per = 256 if kind.endswith("_k") else 32
    nblocks = rows * cols // per
    raw = rng.integers(0, 256, size=(nblocks, BLOCK_BYTES[kind]), dtype=np.uint8)
    scale = rng.uniform(1e-3, 5e-2, size=nblocks).astype(np.float16).view(np.uint8)
    at = BLOCK_BYTES[kind] - 2 if kind == "q6_k" else 0  # where the block's fp16 scale sits
    raw[:, at : at + 2] = scale.reshape(nblocks, 2)
    blocks = torch.from_numpy(raw.reshape(rows, -1).copy())
    return QuantizedWeight(kind=kind, shape=(rows, cols), blocks=blocks)  # type: ignore[arg-type]


def _values(weight: QuantizedWeight) -> np.ndarray:
    """gguf-py's float dequantization of ``weight``'s blocks."""
    kind = gguf.GGMLQuantizationType(GGML_TYPE[weight.kind])
    flat = gguf.quants.dequantize(weight.blocks.numpy().reshape(-1), kind)
    return np.asarray(flat, dtype=np.float64).reshape(weight.shape)


@pytest.fixture
def no_parallel_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's copy ops fail the test when called."""

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("a small build-time copy entered torch's parallel copy ops")

    for name in ("copy_", "index_select"):
        monkeypatch.setattr(torch.Tensor, name, refused)
    monkeypatch.setattr(torch, "cat", refused)


def _fuse_permute_pack(parts: list[QuantizedWeight], order: torch.Tensor) -> tuple:
    fused = concat_rows(parts)
    picked = fused.select_rows(order)
    blob, code, stacked = StackedWeight(parts=(picked, _weight("q6_k", rows=3, seed=9))).packed()
    return fused, picked, blob, code, stacked


def test_small_copies_stay_off_torchs_parallel_ops(no_parallel_copies: None) -> None:
    parts = [_weight("q4_k", rows=5, seed=1), _weight("q4_k", rows=3, seed=2)]
    expected = np.concatenate([_values(p) for p in parts])
    order = torch.tensor([7, 0, 3, 3, 5])
    fused, picked, blob, _, stacked = _fuse_permute_pack(parts, order)
    np.testing.assert_array_equal(_values(fused), expected)
    np.testing.assert_array_equal(_values(picked), expected[order.numpy()])
    np.testing.assert_array_equal(_values(stacked.parts[0]), expected[order.numpy()])
    assert stacked.parts[0].blocks.untyped_storage().data_ptr() == blob.data_ptr()


def test_the_parallel_path_gives_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    parts = [_weight("q4_k", rows=5, seed=1), _weight("q4_k", rows=3, seed=2)]
    order = torch.tensor([7, 0, 3, 3, 5])
    serial = _fuse_permute_pack(parts, order)
    again = [_weight("q4_k", rows=5, seed=1), _weight("q4_k", rows=3, seed=2)]
    monkeypatch.setattr(formats, "SERIAL_COPY_BYTES", 0)
    parallel = _fuse_permute_pack(again, order)
    for a, b in zip(serial[:2], parallel[:2], strict=True):
        assert torch.equal(a.blocks, b.blocks)
    assert torch.equal(serial[2], parallel[2]) and serial[3] == parallel[3]


def test_a_row_index_out_of_range_is_refused() -> None:
    weight = _weight("q4_k", rows=4, seed=3)
    for bad in ([0, 4], [-1]):
        with pytest.raises(IndexError, match="out of range"):
            weight.select_rows(torch.tensor(bad))
