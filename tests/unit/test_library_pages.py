"""``release_library_pages``: read-only file mappings give their resident pages back and
still read the same bytes; a private mapping written through (anonymous pages) and a
writable one keep theirs."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import numpy as np
import pytest

from llmrt.device import library_pages
from llmrt.device.library_pages import release_import_pages, release_library_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs smaps")


def _rss(mapping: mmap.mmap) -> int:
    view = np.frombuffer(mapping, dtype=np.uint8, count=1)
    start = int(view.ctypes.data)
    del view
    found = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            found = int(head.split("-")[0], 16) == start
        elif found and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("mapping not listed")


def test_clean_read_only_pages_go_back_and_written_ones_stay(tmp_path: Path) -> None:
    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    path = tmp_path / "blob"
    path.write_bytes(data)
    with path.open("rb") as fh:
        clean = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        written = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        assert clean[:] == data  # every page resident
        written[:] = data[::-1]  # every page copied on write (anonymous)
        assert _rss(clean) == len(data) and _rss(written) == len(data)

        done = release_library_pages()

        assert done.skipped is None and done.released_bytes >= len(data) and done.mappings >= 1
        assert _rss(clean) == 0
        assert clean[:] == data  # faulted back from the page cache
        assert _rss(written) == len(data) and written[:] == data[::-1]
    finally:
        clean.close()
        written.close()


def test_an_unreadable_smaps_is_named(tmp_path: Path) -> None:
    done = release_library_pages(smaps=tmp_path / "missing")
    assert done.released_bytes == 0 and done.skipped is not None and "missing" in done.skipped
    assert done.log_field() == f"0 ({done.skipped})"


def test_the_imports_pages_go_back_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(library_pages, "_done", False)
    first = release_import_pages()
    assert first.skipped is None
    again = release_import_pages()
    assert again.released_bytes == 0 and again.skipped == "given back once in this process"
