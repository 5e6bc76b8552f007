"""A copied weight's file pages are given back, and nothing else is (``llmrt.kernels.file_pages``
and its uses in ``formats``).

The contract, stated from the kernel's side (``smaps``): after a release the file mapping
under the tensor holds no resident pages and the tensor still reads the file's bytes; a
private page written through the mapping, or anonymous memory, is left alone with its data.
Fusing parts (``concat_rows``, ``StackedWeight.packed``) gives their file pages back and
leaves every holder of a part reading the fused copy; packing packed parts copies nothing.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from llmrt.kernels.file_pages import release_file_pages, released_bytes
from llmrt.kernels.formats import QuantizedWeight, StackedWeight, concat_rows
from llmrt.testing.gguf_blocks import random_quantized
from llmrt.weights.mapped_pages import mapping_address, mapping_usage

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/pagemap").is_file(), reason="needs /proc/self/pagemap (Linux)"
)
PAGE = mmap.PAGESIZE
ROW = 144  # one Q4_K block per row: 256 weights


@pytest.fixture
def mapped(tmp_path: Path) -> Iterator[tuple[mmap.mmap, np.ndarray]]:
    rows = 2 * (64 * PAGE // ROW // 2)  # whole rows, about 64 pages
    data = np.random.default_rng(0).integers(0, 256, rows * ROW, dtype=np.uint8)
    data[np.arange(rows) * ROW + 1] = 0  # fp16 d = tiny positive, no NaN/inf scales
    path = tmp_path / "weights.bin"
    path.write_bytes(data.tobytes())
    with path.open("rb") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    yield mapping, data
    with contextlib.suppress(BufferError):
        mapping.close()


def rss(mapping: mmap.mmap) -> int:
    usage = mapping_usage(mapping_address(mapping))
    assert usage is not None
    return usage["Rss"]


def blocks_of(mapping: mmap.mmap, rows: slice) -> torch.Tensor:
    view = np.frombuffer(mapping, dtype=np.uint8).reshape(-1, ROW)[rows]
    return torch.from_numpy(view)


def test_a_file_views_pages_are_given_back_and_still_read_the_file(
    mapped: tuple[mmap.mmap, np.ndarray],
) -> None:
    mapping, data = mapped
    tensor = blocks_of(mapping, slice(None))
    assert int(tensor.sum()) == int(data.sum())
    assert rss(mapping) >= 60 * PAGE
    before = released_bytes()
    released = release_file_pages(tensor)
    assert released >= 60 * PAGE and released_bytes() - before == released
    assert rss(mapping) <= 2 * PAGE  # at most the partial pages at either end
    assert np.array_equal(tensor.numpy().reshape(-1), data)


def test_a_written_private_page_keeps_the_mapping_as_it_is(
    mapped: tuple[mmap.mmap, np.ndarray],
) -> None:
    mapping, data = mapped
    tensor = blocks_of(mapping, slice(None))
    int(tensor.sum())
    flat = tensor.view(-1)
    flat[5 * PAGE] = data[5 * PAGE] ^ 0xFF  # copy-on-write: this page is the process's now
    before = rss(mapping)
    assert release_file_pages(tensor) == 0
    assert rss(mapping) == before
    assert int(flat[5 * PAGE]) == int(data[5 * PAGE] ^ 0xFF)


def test_anonymous_memory_is_left_alone() -> None:
    tensor = torch.arange(64 * PAGE, dtype=torch.int32).to(torch.uint8)
    expected = tensor.clone()
    assert release_file_pages(tensor) == 0
    assert torch.equal(tensor, expected)


def test_fused_parts_read_the_fused_copy_and_give_their_pages_back(
    mapped: tuple[mmap.mmap, np.ndarray],
) -> None:
    mapping, data = mapped
    rows = data.size // ROW
    half = rows // 2
    parts = [
        QuantizedWeight(kind="q4_k", shape=(n, 256), blocks=blocks_of(mapping, s))
        for n, s in ((half, slice(0, half)), (rows - half, slice(half, rows)))
    ]
    holder = parts[1].blocks  # e.g. a checkpoint's dict holding the part
    fused = concat_rows(parts)
    assert np.array_equal(fused.blocks.numpy().reshape(-1), data)
    base = fused.blocks.data_ptr()
    assert holder.data_ptr() == base + half * ROW  # the holder reads the fused copy
    assert np.array_equal(holder.numpy(), data.reshape(-1, ROW)[half:])
    assert rss(mapping) <= 4 * PAGE


def _mixed_parts(*, seed: int) -> tuple[QuantizedWeight, ...]:
    """A fused weight's parts in two block kinds (8 rows of Q4_K, 4 of Q6_K)."""
    return (
        random_quantized("q4_k", 8, 256, seed=seed),
        random_quantized("q6_k", 4, 256, seed=seed + 100),
    )


def test_packing_packed_parts_copies_nothing() -> None:
    stacked = StackedWeight(parts=_mixed_parts(seed=1))
    expected = stacked.dequantize()
    blob, code, viewed = stacked.packed()
    again, code_again, same = viewed.packed()
    assert again.data_ptr() == blob.data_ptr() and code_again == code and same is viewed
    assert torch.equal(viewed.dequantize(), expected)
    assert torch.equal(stacked.dequantize(), expected)  # the old parts read the blob too


def test_packed_parts_found_inside_a_larger_storage_are_not_copied_again() -> None:
    """The weight placement moves every storage of a model into one mapping; packing its
    parts again there finds the blob where it was moved (the same bytes) instead of a copy."""
    blob, code, viewed = StackedWeight(parts=_mixed_parts(seed=2)).packed()
    expected = viewed.dequantize()
    arena = torch.zeros(blob.numel() + 4096, dtype=torch.uint8)
    at = 1024  # the blob at an offset of a larger storage, as the placement leaves it
    arena[at : at + blob.numel()] = blob.view(-1)
    for part in viewed.parts:
        offset = part.blocks.data_ptr() - blob.data_ptr()
        part.blocks.set_(
            arena.untyped_storage(), at + offset, part.blocks.size(), part.blocks.stride()
        )
    again, code_again, same = viewed.packed()
    assert again.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
    assert again.data_ptr() == arena.data_ptr() + at and again.shape == blob.shape
    assert code_again == code and same is viewed
    assert torch.equal(viewed.dequantize(), expected)
    # Moved elsewhere with a header that does not match: packed again into a new blob.
    arena[at] ^= 0xFF
    fresh, _, _ = viewed.packed()
    assert fresh.untyped_storage().data_ptr() != arena.untyped_storage().data_ptr()
