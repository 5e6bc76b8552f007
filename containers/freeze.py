"""One freeze for a whole container once it is built: no provider may change under live objects.

dependency-injector lets any provider be overridden, reset or un-overridden at any time; after
the runtime's objects exist that silently forks them (a ``with provider.override(...)`` block
that ends after build lets the next call open and own a second device). Every provider the
containers declare is one of the :class:`Frozen` kinds below; once the root scope records its
first object, :func:`freeze` marks the whole tree (nested containers and declared lanes
included), and from then on ``override``, ``reset_override``, ``reset_last_overriding`` (the
override context manager's exit) and ``reset``/``full_reset`` raise ``ContainerStateError``
naming the provider.
"""

from __future__ import annotations

from typing import Any

from dependency_injector import containers, providers

from llmrt.errors import ContainerStateError


class Frozen:
    """Mixin: refuses every change to the provider once :func:`freeze` marked it."""

    _frozen: str | None = None

    def _refuse(self, action: str) -> None:
        if self._frozen is not None:
            raise ContainerStateError(f"cannot {action}: {self._frozen}")

    def freeze_with(self, reason: str) -> None:
        """Refuse every later change, saying ``reason`` (the first reason given stays)."""
        if self._frozen is None:
            self._frozen = reason

    @property
    def frozen(self) -> bool:
        return self._frozen is not None

    def override(self, provider: Any) -> Any:
        self._refuse("override")
        return super().override(provider)  # type: ignore[misc]

    def reset_override(self) -> None:
        self._refuse("reset_override")
        super().reset_override()  # type: ignore[misc]

    def reset_last_overriding(self) -> None:
        self._refuse("reset its last override (the override block's exit)")
        super().reset_last_overriding()  # type: ignore[misc]

    def __deepcopy__(self, memo: dict[Any, Any] | None) -> Any:
        copied = super().__deepcopy__(memo)  # type: ignore[misc]
        copied._frozen = None
        return copied


class FrozenResettable(Frozen):
    """A singleton: ``reset`` would make the next call build a second object."""

    def reset(self) -> Any:
        self._refuse("reset")
        return super().reset()  # type: ignore[misc]

    def full_reset(self) -> Any:
        self._refuse("full_reset")
        return super().full_reset()  # type: ignore[misc]


class Singleton(FrozenResettable, providers.Singleton[Any]):
    """``providers.Singleton`` that freezes with its container."""


class Callable(Frozen, providers.Callable[Any]):
    """``providers.Callable`` that freezes with its container."""


class Object(Frozen, providers.Object[Any]):
    """``providers.Object`` that freezes with its container."""


class Dependency(Frozen, providers.Dependency[Any]):
    """``providers.Dependency`` that freezes with its container."""


class Container(Frozen, providers.Container[Any]):
    """``providers.Container`` that freezes with its container (and freezes what it holds)."""


def freeze(container: containers.Container, *, reason: str, prefix: str = "") -> None:
    """Freeze every provider of ``container`` and of the containers nested in it."""
    for name, provider in container.providers.items():
        path = f"{prefix}{name}"
        if isinstance(provider, Frozen):
            provider.freeze_with(f"{path} {reason}")
        if isinstance(provider, providers.Container):
            freeze(provider.container, reason=reason, prefix=f"{path}.")
