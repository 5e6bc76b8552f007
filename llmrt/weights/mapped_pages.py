"""Giving back the resident pages of a checkpoint file's private mapping.

Why: a GGUF checkpoint is read through one private (copy-on-write) mapping, and every page a
model build reads stays in the process's resident set for as long as the mapping lives (the
checkpoint lives with the container, for the lanes it builds). Once a CPU model has copied
its weights out (onto huge pages, interleaved), those pages are a second resident copy of
the weights: SmolLM2's 93 MB file stayed resident beside them.

``madvise(MADV_DONTNEED)`` on a private file mapping drops the process's pages; a later read
faults the file's bytes back in from the page cache (nothing is lost for the file's own
bytes, and the next process still finds them cached). A page written through the mapping
(copy-on-write) would be discarded with it, so a mapping with any such page is left alone.
"""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import attrs
import numpy as np

SMAPS = Path("/proc/self/smaps")

_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")
_FIELD = re.compile(r"^(\w+):\s+(\d+) kB")


@attrs.frozen(kw_only=True)
class PageRelease:
    """What ``release_clean_pages`` did: bytes it gave back (the mapping's resident set
    before), or why it gave back none."""

    released_bytes: int
    skipped: str | None = None


def mapping_address(mapping: mmap.mmap) -> int:
    """The address ``mapping`` starts at (read-only mappings too)."""
    view = np.frombuffer(mapping, dtype=np.uint8, count=1)
    try:
        return int(view.ctypes.data)
    finally:
        del view  # the buffer export, so the mapping can still be closed


def mapping_usage(address: int, *, smaps: Path = SMAPS) -> dict[str, int] | None:
    """The ``smaps`` fields (in bytes) of the mapping that starts at ``address``; None when
    the file is unreadable or lists no such mapping."""
    try:
        lines = smaps.read_text().splitlines()
    except OSError:
        return None
    fields: dict[str, int] | None = None
    for line in lines:
        header = _HEADER.match(line)
        if header is not None:
            if fields is not None:
                break
            if int(header.group(1), 16) == address:
                fields = {}
            continue
        field = _FIELD.match(line)
        if fields is not None and field is not None:
            fields[field.group(1)] = int(field.group(2)) * 1024
    return fields


def release_clean_pages(mapping: mmap.mmap, *, smaps: Path = SMAPS) -> PageRelease:
    """Drop the resident pages of private file mapping ``mapping`` when none of them was
    written through it (``Anonymous``, the copied-on-write pages, 0 in ``smaps``); see the
    module doc."""
    if mapping.closed:
        return PageRelease(released_bytes=0, skipped="the mapping is closed")
    usage = mapping_usage(mapping_address(mapping), smaps=smaps)
    if usage is None:
        return PageRelease(released_bytes=0, skipped=f"{smaps} does not list the mapping")
    written = usage.get("Anonymous", 0)  # Private_Dirty also counts a freshly written file
    if written:
        return PageRelease(released_bytes=0, skipped=f"{written} bytes were written through it")
    mapping.madvise(mmap.MADV_DONTNEED)
    return PageRelease(released_bytes=usage.get("Rss", 0))
