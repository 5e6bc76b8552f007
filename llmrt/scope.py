"""Lifetime scopes: objects are torn down in exact reverse order of creation.

dependency-injector's ``shutdown_resources()`` only orders direct
Resource->Resource edges, so a Singleton or a sub-container between two resources
loses the ordering. A :class:`LifetimeScope` instead records every owned object
as it is created, with one creation sequence shared by the whole scope tree, and
closes them in exact reverse order of that sequence across scopes: an object
created late in an outer scope (a tokenizer loaded after the lanes) is closed
before the lanes created earlier. Reverse creation order is always a safe
teardown order, since an object's dependencies exist before it does. Closing
continues past a failed step and raises every failure together, with the
primary error preserved.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import TypeVar

import attrs

from llmrt.errors import CleanupError
from llmrt.lifecycle import component_logger, emit

T = TypeVar("T")


@attrs.define(kw_only=True, eq=False)
class _Entry:
    """One owned object (``scope`` None) or the opening of a child scope."""

    sequence: int
    name: str
    close: Callable[[], object]
    scope: LifetimeScope | None = None


class LifetimeScope:
    """An ordered record of owned objects and nested scopes, closed in reverse creation order."""

    def __init__(
        self, name: str, *, parent: LifetimeScope | None = None, lane: int | None = None
    ) -> None:
        self.name = name
        self.parent = parent
        self.lane = lane
        self._sequence: Iterator[int] = (
            parent._sequence if parent is not None else itertools.count()
        )
        self._entries: list[_Entry] = []
        self._closed = False
        self._failures = 0
        self._log = component_logger("scope", lane=lane, object_id=name)
        emit(self._log, "scope.entered", scope=self.path)

    @property
    def path(self) -> str:
        return self.name if self.parent is None else f"{self.parent.path}/{self.name}"

    @property
    def closed(self) -> bool:
        return self._closed

    def own(self, name: str, obj: T, close: Callable[[], object] | None = None) -> T:
        """Record ``obj`` as created now; ``close`` runs at teardown (None: nothing to release)."""
        if self._closed:
            raise RuntimeError(f"scope {self.path} is closed; cannot own {name}")
        self._entries.append(
            _Entry(sequence=next(self._sequence), name=name, close=close or _nothing)
        )
        return obj

    def child(self, name: str, *, lane: int | None = None) -> LifetimeScope:
        """Open a nested scope; its objects join this tree's creation order."""
        if self._closed:
            raise RuntimeError(f"scope {self.path} is closed; cannot open {name}")
        sequence = next(self._sequence)
        scope = LifetimeScope(name, parent=self, lane=self.lane if lane is None else lane)
        self._entries.append(_Entry(sequence=sequence, name=name, close=_nothing, scope=scope))
        return scope

    def names(self) -> list[str]:
        """Names of this scope's open entries (objects and child scopes), in creation order."""
        return [e.name for e in self._entries]

    def creation_order(self) -> list[str]:
        """Paths of every open owned object in this subtree, in creation order."""
        return [f"{scope.path}/{entry.name}" for scope, entry in self._open_entries()]

    def close(self, *, primary: BaseException | None = None) -> None:
        """Tear down in reverse creation order; raise ``CleanupError`` listing every failure.

        Idempotent: a closed scope (or one whose parent closed it) does nothing.
        """
        failures = self._close_all()
        if failures:
            raise CleanupError(failures, primary=primary)

    # -- internals -----------------------------------------------------------------------

    def _open_entries(self) -> list[tuple[LifetimeScope, _Entry]]:
        """Every open (scope, entry) pair of this subtree, sorted by creation sequence."""
        found: list[tuple[LifetimeScope, _Entry]] = []
        pending: list[LifetimeScope] = [self]
        while pending:
            scope = pending.pop()
            if scope._closed:
                continue
            for entry in scope._entries:
                if entry.scope is not None:
                    pending.append(entry.scope)
                else:
                    found.append((scope, entry))
        found.sort(key=lambda pair: pair[1].sequence)
        return found

    def _close_all(self) -> list[tuple[str, BaseException]]:
        if self._closed:
            return []
        markers: list[tuple[LifetimeScope, _Entry]] = []
        pending: list[LifetimeScope] = [self]
        while pending:
            scope = pending.pop()
            if scope._closed:
                continue
            for entry in scope._entries:
                if entry.scope is not None:
                    markers.append((scope, entry))
                    pending.append(entry.scope)
        steps = sorted([*self._open_entries(), *markers], key=lambda p: p[1].sequence, reverse=True)
        failures: list[tuple[str, BaseException]] = []
        for owner, entry in steps:
            owner._entries.remove(entry)
            if entry.scope is not None:
                # Every object of the child was created after it opened: all are closed now.
                entry.scope._exit()
                continue
            step = f"{owner.path}/{entry.name}"
            try:
                entry.close()
            except CleanupError as exc:
                # A component's own multi-step cleanup: report each of its failures.
                failures.extend(exc.failures)
                owner._note_failures(len(exc.failures))
                emit(owner._log, "cleanup.failed", step=step, error=str(exc).splitlines()[0])
            except Exception as exc:
                failures.append((step, exc))
                owner._note_failures(1)
                emit(owner._log, "cleanup.failed", step=step, error=f"{type(exc).__name__}: {exc}")
            else:
                emit(owner._log, "cleanup.step", step=step)
        self._exit()
        return failures

    def _note_failures(self, count: int) -> None:
        scope: LifetimeScope | None = self
        while scope is not None:
            scope._failures += count
            scope = scope.parent

    def _exit(self) -> None:
        if self._closed:
            return
        self._closed = True
        emit(self._log, "scope.exited", scope=self.path, failures=self._failures)


def _nothing() -> None:
    return None
