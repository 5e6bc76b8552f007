"""Keep freed host memory in the process for reuse (glibc ``mallopt``).

Why: glibc serves allocations above its mmap threshold (128 KiB, raised as such blocks are
freed, up to 32 MiB) from fresh mappings, and hands the top of the heap back to the kernel
once more than twice that threshold is free. A prefill allocates the same large
temporaries in every layer (SmolLM2, 512 tokens: the 6 MiB float32 MLP output, 30 times),
and every one of them came back from the kernel page by page: ~1,300 page faults and
~1.7 ms per conversion, against 0.1 ms in reused memory. Fixing both thresholds keeps
blocks up to ``MMAP_THRESHOLD`` on the heap and lets up to ``TRIM_THRESHOLD`` of free heap
stay mapped, so the next layer reuses what the last one freed. The cost is resident
memory: what a step freed stays counted in RSS instead of being returned at once (up to
``TRIM_THRESHOLD`` at the top of each arena; holes below it were never returned anyway), so
resident memory follows the peak of heap use rather than its current level. This is what
jemalloc or tcmalloc, which CPU inference guides preload under torch, do by default.

The setting is process-wide and has no inverse (glibc has no getter for the values it
replaces), so it is applied once, when a CPU device is opened with
``device.retain_freed_memory`` (the default), and never undone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import threading

#: Allocations up to this size come from the heap (glibc's largest mmap threshold).
MMAP_THRESHOLD = 32 << 20
#: Free heap kept mapped before glibc trims it (returns it to the kernel).
TRIM_THRESHOLD = 512 << 20
#: ``mallopt`` parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_lock = threading.Lock()
_applied: bool | None = None


def retain_freed_memory() -> str | None:
    """Apply the thresholds once per process; None when applied, else why not."""
    global _applied
    with _lock:
        if _applied is not None:
            return None if _applied else _unavailable()
        mallopt = _mallopt()
        settings = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        ok = mallopt is not None and all(mallopt(p, v) == 1 for p, v in settings)
        _applied = ok
        return None if ok else _unavailable()


def freed_memory_retained() -> bool:
    """Whether this process runs with the thresholds applied."""
    return bool(_applied)


def _unavailable() -> str:
    libc, version = platform.libc_ver()
    if libc != "glibc":
        return f"the C library is {libc or 'unknown'}, not glibc"
    return f"glibc {version} refused mallopt"


def _mallopt() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        fn = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def trim_freed_memory() -> bool:
    """Give the free heap back to the kernel now (glibc ``malloc_trim(0)``: the free pages
    inside the heap too, not only its top); True when some was. Why: a model build frees
    its transients (row-permuted copies fused into one weight, the GGUF parse) into a heap
    that keeps up to ``TRIM_THRESHOLD`` of it, so before this call a 3B Q4_K_M build held
    ~150 MiB it would never reuse at the start of decoding. Called once a build is done;
    the thresholds stay as they were for the steps that follow."""
    if platform.libc_ver()[0] != "glibc":
        return False
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return False
    fn.argtypes = (ctypes.c_size_t,)
    fn.restype = ctypes.c_int
    return bool(fn(0))
