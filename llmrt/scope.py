"""Lifetime scopes: objects are torn down in exact reverse order of creation.

dependency-injector's ``shutdown_resources()`` only orders direct
Resource->Resource edges, so a Singleton or a sub-container between two resources
loses the ordering. A :class:`LifetimeScope` instead records every owned object
as it is created (child scopes included, at the point they were opened) and
closes them in exact reverse order, continuing past a failed step and raising
every failure together with the primary error preserved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import attrs

from llmrt.errors import CleanupError
from llmrt.lifecycle import component_logger, emit

T = TypeVar("T")


@attrs.define(kw_only=True, eq=False)
class _Entry:
    name: str
    close: Callable[[], object]
    scope: LifetimeScope | None = None


class LifetimeScope:
    """An ordered stack of owned objects and nested scopes."""

    def __init__(
        self, name: str, *, parent: LifetimeScope | None = None, lane: int | None = None
    ) -> None:
        self.name = name
        self.parent = parent
        self.lane = lane
        self._entries: list[_Entry] = []
        self._closed = False
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
        self._entries.append(_Entry(name=name, close=close or _nothing))
        return obj

    def child(self, name: str, *, lane: int | None = None) -> LifetimeScope:
        """Open a nested scope, closed in its creation slot relative to this scope's objects."""
        scope = LifetimeScope(name, parent=self, lane=self.lane if lane is None else lane)
        self._entries.append(_Entry(name=name, close=scope._close_collecting, scope=scope))
        return scope

    def names(self) -> list[str]:
        return [e.name for e in self._entries]

    def close(self, *, primary: BaseException | None = None) -> None:
        """Tear down in reverse creation order; raise ``CleanupError`` listing every failure."""
        failures = self._close_all()
        if failures:
            raise CleanupError(failures, primary=primary)

    def _close_collecting(self) -> None:
        failures = self._close_all()
        if failures:
            raise CleanupError(failures)

    def _close_all(self) -> list[tuple[str, BaseException]]:
        if self._closed:
            return []
        self._closed = True
        failures: list[tuple[str, BaseException]] = []
        while self._entries:
            entry = self._entries.pop()
            step = f"{self.path}/{entry.name}"
            try:
                entry.close()
            except CleanupError as exc:
                if entry.scope is not None:
                    failures.extend(exc.failures)
                else:
                    failures.append((step, exc))
                emit(self._log, "cleanup.failed", step=step, error=str(exc).splitlines()[0])
            except Exception as exc:
                failures.append((step, exc))
                emit(self._log, "cleanup.failed", step=step, error=f"{type(exc).__name__}: {exc}")
            else:
                if entry.scope is None:
                    emit(self._log, "cleanup.step", step=step)
        emit(self._log, "scope.exited", scope=self.path, failures=len(failures))
        return failures


def _nothing() -> None:
    return None
