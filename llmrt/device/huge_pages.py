"""Host weights on transparent huge pages (2 MiB) where the kernel allows them.

Why: a batch-1 decode step streams every weight once (SmolLM2: 96 MB in ~5 ms). On 4 KiB
pages that stream crosses ~24,000 page boundaries per step: each one a TLB miss, and a point
where the CPU's stream prefetcher stops and has to learn the stream again. A 2-thread read of
96 MB on this machine ran 1.5-1.7x faster from huge pages than from 4 KiB pages, and
SmolLM2's batch-1 step 15% faster (5.32 -> 4.48 ms, in-process A/B, same weights).

Most kernels give huge pages only to mappings advised with ``MADV_HUGEPAGE``
(``/sys/kernel/mm/transparent_hugepage/enabled``: ``madvise``), and never to memory that was
touched before the advice. So a model's weights are copied, once at build, into one fresh
advised mapping (``place_module_weights``); the copy rebinds the tensors in place
(``Tensor.set_``), so every holder of a weight (tied modules, and the checkpoint's own views
of it, passed as ``followers``) sees the same placed storage and the old one is freed.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path

import attrs
import torch

from llmrt.device.host_memory import trim_freed_memory

#: The x86-64 / arm64 (4 KiB base page) transparent huge page size.
HUGE_PAGE = 2 << 20
#: Where Linux reports the system's transparent huge page mode.
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
#: Each placed storage starts on a cache line (and so on every dtype's alignment).
ALIGNMENT = 64
#: Bytes the placement copies between two give-backs of what it copied from (see
#: ``place_module_weights``): about what its resident memory may run above its start.
GIVE_BACK_BYTES = 64 << 20

_lock = threading.Lock()
#: [start, end) address ranges of this process's live placements (a range is dropped when its
#: mapping is freed); a storage inside one is already placed.
_placed: list[tuple[int, int]] = []


def huge_pages_refused(*, setting: str, enabled: bool) -> str | None:
    """Why memory governed by recipe field ``setting`` stays off huge pages (None: it goes
    on them): the field is false, or the system gives none."""
    return f"{setting} is false" if not enabled else huge_pages_unavailable()


def huge_pages_unavailable() -> str | None:
    """None when an advised anonymous mapping may get huge pages, else why not."""
    if not sys.platform.startswith("linux"):
        return f"{sys.platform} has no transparent huge pages"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "this Python's mmap has no MADV_HUGEPAGE"
    try:
        text = THP_ENABLED.read_text(encoding="ascii")
    except OSError:
        return f"transparent huge pages are not configured ({THP_ENABLED} is unreadable)"
    mode = text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()
    if mode == "never":
        return f"transparent huge pages are disabled ({THP_ENABLED}: never)"
    return None


def advised_mapping(nbytes: int, *, huge: bool) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes`` (zero-filled by the kernel on first touch),
    advised onto huge pages when ``huge`` (a no-op where the kernel refuses the advice)."""
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # an old kernel without THP: plain pages
            pages.madvise(mmap.MADV_HUGEPAGE)
    return pages


@attrs.frozen(kw_only=True)
class WeightPlacement:
    """What ``place_module_weights`` did: ``placed_bytes`` of ``storages`` copied into one
    advised mapping, ``huge_bytes`` of it on huge pages (from ``/proc/self/smaps``; None where
    unreadable), ``skipped`` storages already placed (shared with another lane's model), and
    ``pinned`` moved tensors that are views of another storage (their base keeps it resident;
    logged when there are any)."""

    placed_bytes: int
    storages: int
    skipped: int
    huge_bytes: int | None
    pinned: int = 0

    def log_fields(self) -> dict[str, object]:
        huge = "unknown" if self.huge_bytes is None else f"{self.huge_bytes >> 20} MiB"
        fields: dict[str, object] = {
            "weights_placed": f"{self.placed_bytes >> 20} MiB in {self.storages} storages",
            "weights_on_huge_pages": huge,
            "weights_shared": self.skipped,
        }
        if self.pinned:
            fields["weights_pinning_old_storage"] = (
                f"{self.pinned} tensors (views whose base is another storage, kept resident)"
            )
        return fields


def place_module_weights(
    module: torch.nn.Module,
    *,
    followers: Iterable[torch.Tensor] = (),
    give_back: Callable[[torch.Tensor], object] | None = None,
    trim: Callable[[], object] = trim_freed_memory,
) -> WeightPlacement:
    """Copy every CPU parameter and buffer storage of ``module`` into one mapping advised onto
    huge pages and rebind the tensors to it in place (values, shapes, strides and aliasing
    between tensors of one storage are kept). Storages an earlier call placed are skipped.
    ``followers`` (borrowed: a checkpoint's own views of weights the module fused or
    repacked) are rebound too where they view one of the module's storages, so they do not
    keep the old storage alive beside the copy.

    What was copied is given back as the copy goes, every ``GIVE_BACK_BYTES``: ``give_back``
    (e.g. ``llmrt.kernels.file_pages.release_file_pages``) drops the file pages of each
    copied range of a source, and ``trim`` returns the heap that freed sources (the old
    storages, released once rebound) left to the C library. Why: a copy made beside its
    sources held both until it ended, and the freed heap stayed resident after it (glibc
    keeps it, ``host_memory``): a 3B Q4_K_M's 1.9 GiB placement peaked at 4.0 GiB resident
    and held 3.2 GiB after, against 2.2 GiB without it.

    The caller checks ``huge_pages_unavailable()`` first; the module must not be running."""
    # ``todo`` alone holds the old storages (no other local names one): each is freed as soon
    # as it is rebound.
    todo, skipped = _storages_to_place(module, followers=followers)
    offsets: dict[int, int] = {}
    total = 0
    for ptr in todo:
        offsets[ptr] = total
        total += -(-todo[ptr][0].nbytes() // ALIGNMENT) * ALIGNMENT
    if total == 0:
        return WeightPlacement(placed_bytes=0, storages=0, skipped=skipped, huge_bytes=None)
    pages = advised_mapping(total + HUGE_PAGE, huge=True)
    whole = torch.frombuffer(pages, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE  # the first byte on a huge-page boundary
    arena = whole[start : start + total]
    target = arena.untyped_storage()
    base = arena.storage_offset()
    placed, since_trim, pinned = len(todo), 0, 0
    with torch.inference_mode():
        for ptr in list(todo):
            storage, tensors = todo.pop(ptr)
            at, size = offsets[ptr], storage.nbytes()
            source = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,), (1,))
            for lo in range(0, size, GIVE_BACK_BYTES):
                hi = min(size, lo + GIVE_BACK_BYTES)
                arena[at + lo : at + hi].copy_(source[lo:hi])
                if give_back is not None:
                    give_back(source[lo:hi])
            moved, elsewhere = _with_view_bases(tensors=tensors, ptr=ptr)
            pinned += elsewhere
            for tensor in moved:
                item = tensor.element_size()
                tensor.set_(
                    target,
                    (base + at) // item + tensor.storage_offset(),
                    tensor.size(),
                    tensor.stride(),
                )
            # The old storage is freed here unless something outside holds it.
            del source, storage, tensors, moved
            since_trim += size
            if since_trim >= GIVE_BACK_BYTES:
                trim()
                since_trim = 0
    if since_trim:
        trim()
    span = (whole.data_ptr(), whole.data_ptr() + whole.numel())
    with _lock:  # a placed tensor's storage starts where the mapping does
        _placed.append(span)
    weakref.finalize(pages, _forget, span)  # unmapped once no tensor holds it
    return WeightPlacement(
        placed_bytes=total,
        storages=placed,
        skipped=skipped,
        huge_bytes=_at_most(huge_resident_bytes(arena.data_ptr(), total), total),
        pinned=pinned,
    )


def _storages_to_place(
    module: torch.nn.Module, *, followers: Iterable[torch.Tensor]
) -> tuple[dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]], int]:
    """The module's storages not placed yet, each with its tensors and the ``followers``
    that view it, and how many were placed already. A function of its own so that none of
    its locals outlives it holding an old storage."""
    groups = _storage_groups(module)
    for tensor in followers:
        if tensor.device.type == "cpu" and tensor.layout == torch.strided and tensor.numel():
            group = groups.get(tensor.untyped_storage().data_ptr())
            if group is not None and not any(tensor is held for held in group[1]):
                group[1].append(tensor)
    todo = {ptr: group for ptr, group in groups.items() if not _is_placed(ptr)}
    return todo, len(groups) - len(todo)


def _with_view_bases(*, tensors: list[torch.Tensor], ptr: int) -> tuple[list[torch.Tensor], int]:
    """``tensors`` and, once each, the autograd view bases (``_base``) among them that hold
    the same storage (at ``ptr``); and how many of them have a base on another storage (the
    move leaves that storage held). Why: ``set_`` rebinds a view's storage but keeps its
    base, and the base kept the old storage alive: a fused weight's parts, sliced from the
    blob they were packed into, held the whole blob resident beside its placed copy."""
    out, elsewhere = list(tensors), 0
    for tensor in tensors:
        root = tensor._base
        if root is None or any(root is held for held in out):
            continue
        if root.untyped_storage().data_ptr() == ptr:
            out.append(root)
        else:
            elsewhere += 1
    return out, elsewhere


def _at_most(value: int | None, bound: int) -> int | None:
    return None if value is None else min(value, bound)


def _storage_groups(
    module: torch.nn.Module,
) -> dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]]:
    """The module's CPU tensors (each parameter and buffer once) grouped by storage."""
    groups: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if (
            tensor.device.type == "cpu"
            and tensor.layout == torch.strided  # sparse tensors have no one storage
            and tensor.numel() > 0
        ):
            storage = tensor.untyped_storage()
            groups.setdefault(storage.data_ptr(), (storage, []))[1].append(tensor)
    return groups


def _forget(span: tuple[int, int]) -> None:
    with _lock:
        _placed.remove(span)


def _is_placed(address: int) -> bool:
    with _lock:
        return any(begin <= address < end for begin, end in _placed)


def huge_resident_bytes(address: int, length: int) -> int | None:
    """Bytes of the mappings overlapping [address, address + length) that sit on huge pages
    (``AnonHugePages`` in ``/proc/self/smaps``), or None where that file is unreadable."""
    try:
        text = Path("/proc/self/smaps").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    total, inside = 0, False
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, _, hi = head.partition("-")
            try:
                inside = int(lo, 16) < address + length and int(hi, 16) > address
            except ValueError:
                inside = False
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total
