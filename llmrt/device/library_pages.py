"""Giving back the resident pages of read-only file mappings (loaded libraries' code).

Why: ``import torch`` runs libtorch's static initializers (thousands of operator
registrations), which read ~80 MiB of its code and read-only data once; those pages stay in
the process's resident set for its whole life although a model build and its steps run a
small part of them. Given back once the imports are done (the CPU device is opened before any
weight is read), a 3B Q4_K_M one-shot ``generate`` peaked at 2199 instead of 2261 MiB (file:
1921 MiB) and SmolLM2's at 354 instead of 451 MiB. They are clean page-cache pages like the
GGUF's own (``llmrt.weights.mapped_pages``): a page used later faults back in. Not later:
a release after the build dropped pages its steps run again, and each came back at ~0.1 ms
on this VM (a SmolLM2 one-shot took seconds longer).

``madvise(MADV_DONTNEED)`` would discard a written private page, so only mappings that are
not writable and hold no anonymous page (``Anonymous`` in ``/proc/self/smaps``: a page
copied on write, e.g. relocated data made read-only afterwards) are advised. Linux only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import re
import sys
import threading
from pathlib import Path

import attrs

SMAPS = Path("/proc/self/smaps")
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")
_lock = threading.Lock()
_done = False  # process-wide: the imports' pages go back once


@attrs.frozen(kw_only=True)
class LibraryPageRelease:
    """What ``release_library_pages`` did: ``released_bytes`` (the advised mappings'
    resident bytes before) over ``mappings`` mappings, or why it did nothing."""

    released_bytes: int
    mappings: int
    skipped: str | None = None

    def log_field(self) -> int | str:
        return f"0 ({self.skipped})" if self.skipped else self.released_bytes


@attrs.frozen(kw_only=True)
class _Mapping:
    start: int
    end: int
    perms: str
    path: str
    rss: int
    anonymous: int


def release_library_pages(*, smaps: Path = SMAPS) -> LibraryPageRelease:
    """Drop the resident pages of every read-only file mapping that holds only file pages
    (see the module doc); a page read again faults back in."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return LibraryPageRelease(released_bytes=0, mappings=0, skipped=f"{sys.platform}")
    try:
        text = smaps.read_text(encoding="ascii", errors="replace")
    except OSError:
        return LibraryPageRelease(released_bytes=0, mappings=0, skipped=f"{smaps} is unreadable")
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    released = count = 0
    for mapping in _mappings(text):
        if not _clean_file_mapping(mapping):
            continue
        if madvise(mapping.start, mapping.end - mapping.start, mmap.MADV_DONTNEED) == 0:
            released += mapping.rss
            count += 1
    return LibraryPageRelease(released_bytes=released, mappings=count)


def release_import_pages() -> LibraryPageRelease:
    """``release_library_pages`` the first time a process calls it (the pages only its
    imports touched); later calls give nothing back and say so. Why once: a later release
    would drop the pages a running model's steps use (a second device, a test session)."""
    global _done
    with _lock:
        if _done:
            return LibraryPageRelease(
                released_bytes=0, mappings=0, skipped="given back once in this process"
            )
        _done = True
        return release_library_pages()


def _clean_file_mapping(mapping: _Mapping) -> bool:
    """A mapping of a file (not ``[vdso]`` and the like), not writable, with resident pages
    and none of them anonymous."""
    return (
        mapping.path.startswith("/")
        and "w" not in mapping.perms
        and mapping.rss > 0
        and mapping.anonymous == 0
    )


def _mappings(text: str) -> list[_Mapping]:
    """The mappings ``smaps`` lists, with their ``Rss`` and ``Anonymous`` bytes."""
    found: list[tuple[re.Match[str], dict[str, int]]] = []
    for line in text.splitlines():
        match = _HEADER.match(line)
        if match is not None:
            found.append((match, {}))
            continue
        name, _, value = line.partition(":")
        if found and name in ("Rss", "Anonymous"):
            found[-1][1][name] = int(value.split()[0]) * 1024
    return [
        _Mapping(
            start=int(match.group(1), 16),
            end=int(match.group(2), 16),
            perms=match.group(3),
            path=match.group(4),
            rss=fields["Rss"],
            anonymous=fields["Anonymous"],
        )
        for match, fields in found
        if "Rss" in fields and "Anonymous" in fields
    ]
