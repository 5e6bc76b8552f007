"""Best-effort release of device tensors nested in runtime objects.

A failed deallocation does not stop the release; it becomes a ``TensorResourceOrphan`` the
owner keeps and retries later. A caller-owned ``ReleaseLedger`` remembers what was released,
so no tensor is deallocated twice, however often it appears or however often cleanup runs.

Device tensors are torch tensors or another backend's (``is_device_tensor``: a ttnn tensor).
Traversal follows tuples, lists, sets, dicts, attrs instances and objects exposing
``owned_tensors()`` (which takes precedence over attrs fields, so an object holding borrowed
tensors can say which ones it owns). Anything else is skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import attrs
import torch
from structlog.typing import FilteringBoundLogger

from llmrt.device.base import Device, is_device_tensor
from llmrt.device.identity import IdentitySet
from llmrt.lifecycle.events import component_logger, emit


@attrs.frozen(kw_only=True, eq=False)
class TensorResourceOrphan:
    """A tensor whose deallocation failed; ``path`` says where it was found."""

    tensor: torch.Tensor = attrs.field(repr=False)
    path: str
    error: Exception


class ReleaseLedger:
    """Tensors a cleanup root has already deallocated (by identity; does not keep them alive)."""

    def __init__(self) -> None:
        self._released = IdentitySet()

    def __contains__(self, tensor: object) -> bool:
        return tensor in self._released

    def __len__(self) -> int:
        return len(self._released)

    def record(self, tensor: torch.Tensor) -> None:
        """Mark ``tensor`` as deallocated."""
        self._released.add(tensor)


def iter_tensors(obj: object, *, path: str = "resources") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``obj`` with its path; shared containers are visited once."""
    yield from _walk(obj, path=path, visited={})


def release_tensors(
    obj: object,
    *,
    device: Device,
    ledger: ReleaseLedger,
    path: str = "resources",
    logger: FilteringBoundLogger | None = None,
) -> list[TensorResourceOrphan]:
    """Deallocate every tensor in ``obj`` not yet in ``ledger``; return the ones that failed."""
    log = logger if logger is not None else component_logger("tensor_resources")
    orphans: list[TensorResourceOrphan] = []
    attempted = IdentitySet()
    for where, tensor in iter_tensors(obj, path=path):
        if tensor in ledger or tensor in attempted:
            continue
        attempted.add(tensor)
        orphan = _release_one(tensor, path=where, device=device, ledger=ledger, log=log)
        if orphan is not None:
            orphans.append(orphan)
    return orphans


def retry_orphans(
    orphans: Iterable[TensorResourceOrphan],
    *,
    device: Device,
    ledger: ReleaseLedger,
    logger: FilteringBoundLogger | None = None,
) -> list[TensorResourceOrphan]:
    """Retry the orphans not released since; return those that failed again (with new errors)."""
    log = logger if logger is not None else component_logger("tensor_resources")
    remaining: list[TensorResourceOrphan] = []
    attempted = IdentitySet()
    for orphan in orphans:
        if orphan.tensor in ledger or orphan.tensor in attempted:
            continue
        attempted.add(orphan.tensor)
        again = _release_one(orphan.tensor, path=orphan.path, device=device, ledger=ledger, log=log)
        if again is None:
            emit(log, "resource.recovered", path=orphan.path, tensor=_tensor_id(orphan.tensor))
        else:
            remaining.append(again)
    return remaining


def _release_one(
    tensor: torch.Tensor,
    *,
    path: str,
    device: Device,
    ledger: ReleaseLedger,
    log: FilteringBoundLogger,
) -> TensorResourceOrphan | None:
    try:
        device.deallocate(tensor)
    except Exception as exc:
        emit(
            log,
            "resource.orphaned",
            path=path,
            tensor=_tensor_id(tensor),
            error=f"{type(exc).__name__}: {exc}",
        )
        return TensorResourceOrphan(tensor=tensor, path=path, error=exc)
    ledger.record(tensor)
    return None


def _tensor_id(tensor: object) -> str:
    """The orphan's identity in the log: paths repeat across owners, tensors do not."""
    return f"{id(tensor):#x}"


def _walk(
    obj: object, *, path: str, visited: dict[int, object]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Depth-first; ``visited`` holds the containers seen (strongly, so ids are not reused)."""
    if is_device_tensor(obj):
        yield path, cast(torch.Tensor, obj)
        return
    if isinstance(obj, (str, bytes)) or obj is None:
        return
    owned = getattr(obj, "owned_tensors", None)
    sequence = isinstance(obj, (tuple, list, set, frozenset))
    if not (callable(owned) or sequence or isinstance(obj, Mapping) or attrs.has(type(obj))):
        return
    if id(obj) in visited:
        return
    visited[id(obj)] = obj
    if callable(owned):
        result = owned()
        if isinstance(result, Iterator):
            result = list(result)
        yield from _walk(result, path=f"{path}.owned_tensors()", visited=visited)
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _walk(value, path=f"{path}[{key!r}]", visited=visited)
    elif isinstance(obj, (tuple, list, set, frozenset)):
        for i, item in enumerate(obj):
            yield from _walk(item, path=f"{path}[{i}]", visited=visited)
    else:
        for field in attrs.fields(cast(Any, type(obj))):
            yield from _walk(getattr(obj, field.name), path=f"{path}.{field.name}", visited=visited)


def allocate_many(
    *, device: Device, specs: Sequence[tuple[Sequence[int], torch.dtype]]
) -> list[torch.Tensor]:
    """Allocate one zeroed tensor per ``(shape, dtype)``; all or nothing.

    If an allocation fails, the tensors already made are released (failures to release
    are attached to the raised error as notes) so a half-built set never leaks.
    """
    made: list[torch.Tensor] = []
    try:
        for shape, dtype in specs:
            made.append(device.allocate(shape=tuple(shape), dtype=dtype))
    except BaseException as exc:
        for orphan in release_tensors(made, device=device, ledger=ReleaseLedger()):
            exc.add_note(f"also failed to release {orphan.path}: {orphan.error}")
        raise
    return made
