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

Only the containers register objects (``containers/ownership.py``): each ``own`` logs
``scope.owned`` with the object's name, scope, creation index and root, so ``llmrt audit``
can check the reverse order per object. A step that fails stays with its scope as an
orphan: the next ``close()`` retries exactly the failed steps (in reverse creation order),
never one that succeeded.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import TypeVar

import attrs

from llmrt.errors import CleanupError
from llmrt.lifecycle.events import component_logger, emit

T = TypeVar("T")


@attrs.define(kw_only=True, eq=False)
class _Entry:
    """One owned object (``scope`` None) or the opening of a child scope."""

    sequence: int
    name: str
    close: Callable[[], object]
    scope: LifetimeScope | None = None
    borrowed: bool = False


class LifetimeScope:
    """An ordered record of owned objects and nested scopes, closed in reverse creation order."""

    def __init__(
        self, name: str, *, parent: LifetimeScope | None = None, lane: int | None = None
    ) -> None:
        self.name = name
        self.parent = parent
        self.lane = lane
        self.root: LifetimeScope = parent.root if parent is not None else self
        self._sequence: Iterator[int] = (
            parent._sequence if parent is not None else itertools.count()
        )
        self._entries: list[_Entry] = []
        self._failed: list[_Entry] = []
        self._children: list[LifetimeScope] = []
        self._closed = False
        self._failures = 0
        self._log = component_logger("scope", lane=lane, object_id=name)
        emit(self._log, "scope.entered", scope=self.path, root=self.root_id)

    @property
    def path(self) -> str:
        return self.name if self.parent is None else f"{self.parent.path}/{self.name}"

    @property
    def root_id(self) -> str:
        """Identity of this scope tree in the log (one creation sequence per root)."""
        return f"{id(self.root):#x}"

    @property
    def closed(self) -> bool:
        return self._closed

    def own(
        self,
        name: str,
        obj: T,
        close: Callable[[], object] | None = None,
        *,
        borrowed: bool = False,
    ) -> T:
        """Record ``obj`` as created now; ``close`` runs at teardown (None: nothing to release).

        A ``borrowed`` object belongs to the caller: it keeps its place in the order and
        teardown visibly leaves it alone.
        """
        if self._closed:
            raise RuntimeError(f"scope {self.path} is closed; cannot own {name}")
        entry = _Entry(
            sequence=next(self._sequence),
            name=name,
            close=_nothing if borrowed or close is None else close,
            borrowed=borrowed,
        )
        self._entries.append(entry)
        emit(
            self._log,
            "scope.owned",
            scope=self.path,
            object=name,
            index=entry.sequence,
            root=self.root_id,
            type=type(obj).__name__,
            borrowed=borrowed,
        )
        return obj

    def child(self, name: str, *, lane: int | None = None) -> LifetimeScope:
        """Open a nested scope; its objects join this tree's creation order."""
        if self._closed:
            raise RuntimeError(f"scope {self.path} is closed; cannot open {name}")
        sequence = next(self._sequence)
        scope = LifetimeScope(name, parent=self, lane=self.lane if lane is None else lane)
        self._entries.append(_Entry(sequence=sequence, name=name, close=_nothing, scope=scope))
        self._children.append(scope)
        return scope

    def names(self) -> list[str]:
        """Names of this scope's open entries (objects and child scopes), in creation order."""
        return [e.name for e in self._entries]

    def creation_order(self) -> list[str]:
        """Paths of every open owned object in this subtree, in creation order."""
        return [f"{scope.path}/{entry.name}" for scope, entry in self._open_entries()]

    def orphans(self) -> list[str]:
        """Paths of the steps in this subtree whose close failed (the next ``close`` retries)."""
        found = []
        for scope in self._subtree():
            found += [(e.sequence, f"{scope.path}/{e.name}") for e in scope._failed]
        return [path for _, path in sorted(found, reverse=True)]

    def close(self, *, primary: BaseException | None = None) -> None:
        """Tear down in reverse creation order; raise ``CleanupError`` listing every failure.

        Idempotent: a step that succeeded never runs again; a step that failed is retried
        by the next ``close()`` (and reported again if it fails again).
        """
        failures = self._close_all()
        if failures:
            raise CleanupError(failures, primary=primary)

    # -- internals -----------------------------------------------------------------------

    def _subtree(self) -> list[LifetimeScope]:
        scopes: list[LifetimeScope] = []
        pending: list[LifetimeScope] = [self]
        while pending:
            scope = pending.pop()
            scopes.append(scope)
            pending.extend(scope._children)
        return scopes

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
            return self._retry_failed()
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
            failures += owner._run(entry)
        self._exit()
        return failures

    def _retry_failed(self) -> list[tuple[str, BaseException]]:
        """The failed steps of this subtree, retried in reverse creation order."""
        pending = [(e.sequence, scope, e) for scope in self._subtree() for e in scope._failed]
        failures: list[tuple[str, BaseException]] = []
        for _, owner, entry in sorted(pending, key=lambda t: t[0], reverse=True):
            owner._failed.remove(entry)
            failures += owner._run(entry)
        return failures

    def _run(self, entry: _Entry) -> list[tuple[str, BaseException]]:
        step = f"{self.path}/{entry.name}"
        where = {"step": step, "index": entry.sequence, "root": self.root_id}
        try:
            note = entry.close()
        except CleanupError as exc:
            # A component's own multi-step cleanup: report each of its failures.
            self._failed.append(entry)
            self._note_failures(len(exc.failures))
            emit(self._log, "cleanup.failed", **where, error=str(exc).splitlines()[0])
            return list(exc.failures)
        except Exception as exc:
            self._failed.append(entry)
            self._note_failures(1)
            emit(self._log, "cleanup.failed", **where, error=f"{type(exc).__name__}: {exc}")
            return [(step, exc)]
        if entry.borrowed:
            action = "borrowed: left alone"
        elif isinstance(note, str):
            action = note
        else:
            action = "closed"
        emit(self._log, "cleanup.step", **where, action=action)
        return []

    def _note_failures(self, count: int) -> None:
        scope: LifetimeScope | None = self
        while scope is not None:
            scope._failures += count
            scope = scope.parent

    def _exit(self) -> None:
        if self._closed:
            return
        self._closed = True
        emit(self._log, "scope.exited", scope=self.path, failures=self._failures, root=self.root_id)


def _nothing() -> None:
    return None
