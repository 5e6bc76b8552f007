"""Giving back a private file mapping's resident pages (``llmrt.weights.mapped_pages``).

The contract, stated from the kernel's side: after the release the mapping holds no resident
pages (``smaps`` Rss 0) and still reads the file's bytes; a mapping with a page written
through it (copy-on-write) is left alone, the write kept.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from llmrt.weights.mapped_pages import mapping_address, mapping_usage, release_clean_pages

SMAPS = Path("/proc/self/smaps")
pytestmark = pytest.mark.skipif(not SMAPS.is_file(), reason="needs /proc/self/smaps (Linux)")
SIZE = 64 * mmap.PAGESIZE


@pytest.fixture
def mapped(tmp_path: Path) -> Iterator[tuple[mmap.mmap, np.ndarray]]:
    data = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    path.write_bytes(data.tobytes())
    with path.open("rb") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    yield mapping, data
    if not mapping.closed:
        # A failed test may leave a view of it: then the collector unmaps it.
        with contextlib.suppress(BufferError):
            mapping.close()


def rss(mapping: mmap.mmap) -> int:
    usage = mapping_usage(mapping_address(mapping))
    assert usage is not None
    return usage["Rss"]


def test_read_pages_are_given_back_and_still_read_the_file(
    mapped: tuple[mmap.mmap, np.ndarray],
) -> None:
    mapping, data = mapped
    view = np.frombuffer(mapping, dtype=np.uint8)
    assert int(view.sum()) == int(data.sum())  # every page read: resident
    assert rss(mapping) == SIZE
    release = release_clean_pages(mapping)
    assert release.skipped is None and release.released_bytes == SIZE
    assert rss(mapping) == 0
    assert np.array_equal(view, data)  # faulted back in from the file
    del view


def test_a_written_mapping_is_left_alone(mapped: tuple[mmap.mmap, np.ndarray]) -> None:
    mapping, data = mapped
    mapping[5] = (int(data[5]) + 1) % 256  # copy-on-write: only this process sees it
    bytes(mapping[:])  # read the rest too
    release = release_clean_pages(mapping)
    assert release.released_bytes == 0
    assert release.skipped is not None and "written" in release.skipped
    assert mapping[5] == (int(data[5]) + 1) % 256
    assert rss(mapping) == SIZE


def test_a_closed_mapping_or_no_smaps_releases_nothing(
    mapped: tuple[mmap.mmap, np.ndarray], tmp_path: Path
) -> None:
    mapping, _ = mapped
    missing = release_clean_pages(mapping, smaps=tmp_path / "none")
    assert missing.released_bytes == 0 and "does not list" in str(missing.skipped)
    mapping.close()
    closed = release_clean_pages(mapping)
    assert closed.released_bytes == 0 and closed.skipped == "the mapping is closed"
