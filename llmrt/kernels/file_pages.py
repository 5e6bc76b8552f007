"""Giving back the file pages under a weight's bytes once a copy of them was made.

Why: GGUF blocks are views of the file's mapping, so every page a model build copies out of
(fused gate/up and q/k/v, unpermuted Q/K rows, repacked layouts) stays resident beside its
copy until the build ends and the whole mapping is released: a 3B Q4_K_M build peaked at
the file's size plus everything it copied. Releasing each source right after its copy
keeps the build's peak at one resident copy of each weight.

``madvise(MADV_DONTNEED)`` is safe only where it loses nothing: on pages that are file
pages or shared memory (a later read faults the same bytes back from the page cache or the
shared object). On a private page that was written (copy-on-write) or anonymous memory it
would discard data, so ``release_file_pages`` first reads the range's entries in
``/proc/self/pagemap`` (bit 63: present, bit 61: file page or shared anonymous) and does
nothing when any present page is private anonymous memory. Linux only; elsewhere it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys

import numpy as np
import torch

PAGEMAP = "/proc/self/pagemap"
_PRESENT = np.uint64(1 << 63)
_FILE_OR_SHARED = np.uint64(1 << 61)
_PAGE = mmap.PAGESIZE
_libc: ctypes.CDLL | None = None
_released = 0


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    global _libc
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def only_file_pages(start: int, length: int, *, pagemap: str = PAGEMAP) -> bool:
    """Whether no present page of the page-aligned range [start, start + length) is private
    anonymous memory (so dropping the range loses nothing); False when unreadable."""
    pages = length // _PAGE
    if pages <= 0:
        return False
    try:
        fd = os.open(pagemap, os.O_RDONLY)
    except OSError:
        return False
    try:
        raw = os.pread(fd, 8 * pages, 8 * (start // _PAGE))
    except OSError:
        return False
    finally:
        os.close(fd)
    if len(raw) != 8 * pages:
        return False
    entries = np.frombuffer(raw, dtype=np.uint64)
    present = (entries & _PRESENT) != 0
    return bool(np.all((entries[present] & _FILE_OR_SHARED) != 0))


def release_file_pages(tensor: torch.Tensor, *, again: bool = False) -> int:
    """Drop the resident pages wholly inside a CPU ``tensor``'s bytes when they are file (or
    shared) pages; returns the bytes of the range advised (0: nothing done). The tensor
    stays valid: a later read faults its bytes back in. ``again``: a second sweep of a range
    already given back (not counted twice in ``released_bytes``)."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return 0
    begin = tensor.data_ptr()
    end = begin + tensor.numel() * tensor.element_size()
    start = -(-begin // _PAGE) * _PAGE
    length = (end // _PAGE) * _PAGE - start
    if length <= 0 or not only_file_pages(start, length):
        return 0
    if madvise(start, length, mmap.MADV_DONTNEED) != 0:
        return 0
    global _released
    if not again:
        _released += length
    return length


def released_bytes() -> int:
    """Bytes ``release_file_pages`` advised away in this process so far (what a build gave
    back as it copied, before the placement's own release of the whole mapping)."""
    return _released
