"""A set of objects by identity that does not keep them alive.

Tensors compare element-wise, so ``set``/``WeakSet`` membership is unreliable for them;
this set keys on ``id()`` and drops an entry when its object is collected, so a recycled
``id()`` never reads as a member.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator


class IdentitySet:
    """Weak identity set: ``obj in s`` is true only for the very object that was added."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[object]] = {}

    def add(self, obj: object) -> None:
        """Add ``obj``; no-op if present."""
        key = id(obj)
        if key in self:
            return
        refs = self._refs

        def forget(ref: weakref.ref[object], key: int = key) -> None:
            if refs.get(key) is ref:
                del refs[key]

        refs[key] = weakref.ref(obj, forget)

    def discard(self, obj: object) -> None:
        """Remove ``obj`` if present."""
        if obj in self:
            del self._refs[id(obj)]

    def __contains__(self, obj: object) -> bool:
        ref = self._refs.get(id(obj))
        return ref is not None and ref() is obj

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __iter__(self) -> Iterator[object]:
        for ref in list(self._refs.values()):
            obj = ref()
            if obj is not None:
                yield obj
