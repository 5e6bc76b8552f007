"""Ownership declared in the container: whatever a lifetime provider yields, its scope owns.

Factories build objects and know nothing about scopes. Each provider whose object has a
lifetime is an :class:`Owned` provider declared with ``.owned_by(scope, name, close=...)``:
when it first yields an object (built by its factory, or injected by an override the
dependency-injector way), it records that object in its
:class:`~llmrt.lifecycle.scope.LifetimeScope` with the teardown ``close(obj)`` returns. So an
override is torn down exactly like the default it replaces, at its own place in the reverse
creation order.

An override whose object the caller owns is declared with :class:`Borrowed`
(``provider.override(Borrowed(device))``): the scope records it as borrowed
(``scope.owned`` with ``borrowed: true``) and teardown leaves it alone, visibly
(``cleanup.step`` with ``action: "borrowed: left alone"``). A component the lane's model
executor tears down as one of its eight steps cannot be borrowed (the executor would release
it anyway), nor can the executor itself (the lane's parts are released only through it):
``Borrowed`` on either raises ``ContainerStateError``.

Components the lane's model executor cleans up in the spec's eight steps are declared
``governed_by(model_executor)``: once the executor exists, their own scope entries are no-ops
(``action: "cleaned by model_executor"``), so the eight steps run once, in the spec's order,
with the executor's guards (KV whose release it deferred is never freed behind its back).

Overriding an :class:`Owned` provider after it yielded its object raises
``ContainerStateError`` instead of silently doing nothing; so does changing any provider once
the container is built (``containers/freeze.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import attrs
from dependency_injector import providers

from llmrt.errors import ContainerStateError
from llmrt.lifecycle.scope import LifetimeScope

from .freeze import Singleton

T = TypeVar("T")

#: ``close(obj)`` -> what to run at teardown (None: nothing to release).
CloseFor = Callable[[Any], Callable[[], object] | None]


class Borrowed(providers.Object[Any]):
    """An override whose object the caller owns: recorded as borrowed, never torn down."""


@attrs.frozen(kw_only=True)
class _Lifetime:
    scope: providers.Provider[LifetimeScope]
    name: str
    close: CloseFor | None
    governor: Owned | None = None

    def copied(self, memo: dict[int, Any]) -> _Lifetime:
        governor = self.governor
        return attrs.evolve(
            self,
            scope=providers.deepcopy(self.scope, memo),
            governor=providers.deepcopy(governor, memo) if governor is not None else None,
        )


class Owned(Singleton):
    """A Singleton whose object, built or injected, is owned by (or borrowed into) a scope."""

    def __init__(self, provides: Any = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(provides, *args, **kwargs)
        self._lifetime: _Lifetime | None = None
        self._yielded: list[Any] = []
        self._governs = False  # a cleanup root (govern(self, ...)): it cannot be borrowed

    def owned_by(
        self, scope: providers.Provider[LifetimeScope], name: str, *, close: CloseFor | None = None
    ) -> Owned:
        """Declare the scope that owns this provider's object and how it is torn down."""
        self._lifetime = _Lifetime(scope=scope, name=name, close=close)
        return self

    def governed_by(self, executor: Owned) -> None:
        """Once ``executor`` exists, this object's teardown is one of its cleanup steps."""
        if self._lifetime is None:
            raise ContainerStateError("declare owned_by(...) before governed_by(...)")
        self._lifetime = attrs.evolve(self._lifetime, governor=executor)

    @property
    def lifetime_name(self) -> str | None:
        return self._lifetime.name if self._lifetime is not None else None

    @property
    def built(self) -> bool:
        """Whether this provider has yielded its object (overriding is then an error)."""
        return bool(self._yielded)

    def __deepcopy__(self, memo: dict[Any, Any] | None) -> Owned:
        memo = {} if memo is None else memo
        found = memo.get(id(self))
        if found is not None:
            return cast(Owned, found)
        copied = cast(Owned, super().__deepcopy__(memo))
        copied._lifetime = self._lifetime.copied(memo) if self._lifetime is not None else None
        copied._yielded = []
        copied._governs = self._governs
        return copied

    def override(self, provider: Any) -> Any:
        name = self._lifetime.name if self._lifetime is not None else repr(self)
        if self._yielded:
            raise ContainerStateError(
                f"{name} was already built ({type(self._yielded[0]).__name__}); override "
                "providers before the runtime is built (before lane_group() / startup())"
            )
        if isinstance(provider, (providers.Factory, providers.Callable)):
            # Each call would build another object: a second device, KV pool, ... each
            # recorded as owned, the lanes built from one and the container serving another.
            raise ContainerStateError(
                f"{name} is one object per container; override it with providers.Singleton"
                f"(...) or providers.Object(...), not {type(provider).__name__} (a new object "
                "at every call)"
            )
        governor = self._lifetime.governor if self._lifetime is not None else None
        if isinstance(provider, Borrowed) and governor is not None:
            raise ContainerStateError(
                f"{name} cannot be Borrowed: {governor.lifetime_name} tears it down as one of "
                "the lane's cleanup steps; inject an object the runtime may own "
                "(providers.Object(...)) or keep yours out of the lane"
            )
        if isinstance(provider, Borrowed) and self._governs:
            raise ContainerStateError(
                f"{name} cannot be Borrowed: it is the lane's cleanup root (the lane's KV, "
                "traces and transients are released only by its cleanup); inject an object "
                "the runtime may own (providers.Object(...))"
            )
        return super().override(provider)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        lifetime = self._lifetime
        # Open the owning scope before building, so its entry precedes what it will own.
        scope = lifetime.scope() if lifetime is not None else None
        obj = super().__call__(*args, **kwargs)
        if scope is not None and not any(o is obj for o in self._yielded):
            self._yielded.append(obj)
            self._register(scope, obj)
        return obj

    def _register(self, scope: LifetimeScope, obj: Any) -> None:
        lifetime = self._lifetime
        assert lifetime is not None
        if isinstance(self.last_overriding, Borrowed):
            scope.own(lifetime.name, obj, None, borrowed=True)
            return
        close = lifetime.close(obj) if lifetime.close is not None else None
        governor = lifetime.governor
        if governor is not None and close is not None:
            close = _governed(governor, close)
        scope.own(lifetime.name, obj, close)


def _governed(governor: Owned, close: Callable[[], object]) -> Callable[[], object]:
    """Close directly only while no executor governs the object; else a visible no-op."""

    def run() -> object:
        if governor.built:
            return f"cleaned by {governor.lifetime_name}"
        return close()

    return run


def govern(executor: Owned, *governed: Owned) -> None:
    """Declare (in a container body) the components ``executor``'s cleanup steps tear down."""
    executor._governs = True
    for provider in governed:
        provider.governed_by(executor)
