"""Lifetime scopes: objects are torn down in exact reverse order of creation.

dependency-injector's ``shutdown_resources()`` only orders direct
Resource->Resource edges, so a Singleton or a sub-container between two resources
loses the ordering. A :class:`LifetimeScope` instead records every owned object
as it is created, with one creation sequence shared by the whole scope tree, and
closes them in exact reverse order of that sequence across scopes: an object
created late in an outer scope (a tokenizer loaded after the lanes) is closed
before the lanes created earlier. Reverse creation order is always a safe
teardown order, since an object's dependencies exist before it does.

A step that fails stops the teardown, as an unwinding stack must: everything created
before it may still be in use by it (a lane's live trace on the device), so nothing
created earlier is closed until that step succeeds. The failed step stays in place as an
orphan; the next ``close()`` retries it first and, once it succeeds, carries on from
there. A step that succeeded never runs again. An interrupt (``KeyboardInterrupt``,
``SystemExit``, any ``BaseException``) inside a step is recorded the same way (the step
is an orphan with its cause, logged as ``cleanup.failed``) and then re-raised untouched,
so Ctrl-C never loses a step.

Only the containers register objects (``containers/ownership.py``): each ``own`` logs
``scope.owned`` with the object's name, scope, creation index and root, so ``llmrt audit``
can check that every owned object is closed, and never while one created after it is open.
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
    close: Callable[[], object] | None
    scope: LifetimeScope | None = None
    borrowed: bool = False
    failed: BaseException | None = None  # the cause of the last failed attempt (an orphan)


class LifetimeScope:
    """An ordered record of owned objects and nested scopes, closed in reverse creation order."""

    def __init__(
        self,
        name: str,
        *,
        parent: LifetimeScope | None = None,
        lane: int | None = None,
        on_first_own: Callable[[], object] | None = None,
    ) -> None:
        """``on_first_own`` (a root's) runs once, before the tree records its first object
        (the containers freeze their providers there)."""
        self.name = name
        self.parent = parent
        self.lane = lane
        self.root: LifetimeScope = parent.root if parent is not None else self
        self._sequence: Iterator[int] = (
            parent._sequence if parent is not None else itertools.count()
        )
        self._opened_at = -1  # the sequence of this scope's opening in its parent
        self._entries: list[_Entry] = []
        self._closed = False
        self._failures = 0
        self._on_first_own = on_first_own
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
        first, self.root._on_first_own = self.root._on_first_own, None
        if first is not None:
            first()
        entry = _Entry(
            sequence=next(self._sequence),
            name=name,
            close=None if borrowed else close,
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
        scope._opened_at = sequence
        self._entries.append(_Entry(sequence=sequence, name=name, close=None, scope=scope))
        return scope

    def names(self) -> list[str]:
        """Names of this scope's open entries (objects and child scopes), in creation order."""
        return [e.name for e in self._entries]

    def creation_order(self) -> list[str]:
        """Paths of every open owned object in this subtree, in creation order."""
        return [f"{scope.path}/{entry.name}" for scope, entry in self._steps() if not entry.scope]

    def orphans(self) -> list[str]:
        """Paths of the steps in this subtree whose close failed (the next ``close`` retries)."""
        return [
            f"{scope.path}/{entry.name}"
            for scope, entry in reversed(self._steps())
            if entry.failed is not None
        ]

    def orphan_causes(self) -> dict[str, BaseException]:
        """Each orphan's path -> the error (or interrupt) its last attempt raised."""
        return {
            f"{scope.path}/{entry.name}": entry.failed
            for scope, entry in reversed(self._steps())
            if entry.failed is not None
        }

    def close(self, *, primary: BaseException | None = None) -> None:
        """Tear down in reverse creation order, stopping at the first step that fails.

        Raises ``CleanupError`` with that step's failures (and ``primary``, the error that
        started the teardown, if any); an interrupt is re-raised as it is. Idempotent: a step
        that succeeded never runs again; the next call retries the failed step first, then
        carries on. A child scope closes alone only when nothing created after it opened is
        still open elsewhere in the tree (else ``RuntimeError``: close the root).
        """
        if self._closed:
            return
        self._check_unwindable()
        for owner, entry in reversed(self._steps()):
            if entry.scope is not None:
                # Every object of the child was created after it opened: all are closed now.
                owner._entries.remove(entry)
                entry.scope._exit()
                continue
            failures = owner._run(entry)
            if failures:
                raise CleanupError(failures, primary=primary)
        self._exit()

    # -- internals -----------------------------------------------------------------------

    def _steps(self) -> list[tuple[LifetimeScope, _Entry]]:
        """Every open (scope, entry) pair of this subtree, child openings included, by sequence."""
        found: list[tuple[LifetimeScope, _Entry]] = []
        pending: list[LifetimeScope] = [self]
        while pending:
            scope = pending.pop()
            for entry in scope._entries:
                found.append((scope, entry))
                if entry.scope is not None and not entry.scope._closed:
                    pending.append(entry.scope)
        found.sort(key=lambda pair: pair[1].sequence)
        return found

    def _check_unwindable(self) -> None:
        if self.parent is None:
            return
        mine = {id(entry) for _, entry in self._steps()}
        later = [
            f"{scope.path}/{entry.name}"
            for scope, entry in self.root._steps()
            if entry.sequence > self._opened_at and id(entry) not in mine and entry.scope is None
        ]
        if later:
            raise RuntimeError(
                f"scope {self.path} cannot close while {later[-1]} (created after it opened) "
                "is open; close the root scope"
            )

    def _run(self, entry: _Entry) -> list[tuple[str, BaseException]]:
        """Run one step; on success it leaves the scope, on failure it stays as an orphan."""
        step = f"{self.path}/{entry.name}"
        where = {"step": step, "index": entry.sequence, "root": self.root_id}
        try:
            note = entry.close() if entry.close is not None else None
        except CleanupError as exc:
            # A component's own multi-step cleanup: report each of its failures.
            self._fail(entry, exc, count=max(1, len(exc.failures)))
            emit(self._log, "cleanup.failed", **where, error=str(exc).splitlines()[0])
            return list(exc.failures) or [(step, exc)]
        except Exception as exc:
            self._fail(entry, exc, count=1)
            emit(self._log, "cleanup.failed", **where, error=f"{type(exc).__name__}: {exc}")
            return [(step, exc)]
        except BaseException as exc:
            self._fail(entry, exc, count=1)
            emit(
                self._log,
                "cleanup.failed",
                **where,
                error=f"{type(exc).__name__}: {exc}",
                interrupted=True,
            )
            exc.add_note(
                f"teardown interrupted at {step}: it and everything created before it are "
                "still open; close again to retry from there"
            )
            raise
        self._entries.remove(entry)
        if entry.borrowed:
            action = "borrowed: left alone"
        elif isinstance(note, str):
            action = note
        elif entry.close is None:
            action = "nothing to close"
        else:
            action = "closed"
        emit(self._log, "cleanup.step", **where, action=action)
        return []

    def _fail(self, entry: _Entry, cause: BaseException, *, count: int) -> None:
        entry.failed = cause
        scope: LifetimeScope | None = self
        while scope is not None:
            scope._failures += count
            scope = scope.parent

    def _exit(self) -> None:
        if self._closed:
            return
        self._closed = True
        emit(self._log, "scope.exited", scope=self.path, failures=self._failures, root=self.root_id)
