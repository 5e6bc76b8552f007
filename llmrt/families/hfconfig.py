"""Typed, validated reads from a Hugging Face ``config.json`` mapping.

Every failure is a ``CheckpointError`` whose item is ``config.<field>`` so a bad or
unsupported checkpoint is rejected before any tensor is touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from llmrt.errors import CheckpointError

_REQUIRED: Any = object()


@attrs.frozen(kw_only=True)
class HFConfig:
    """A read-only view of an HF config mapping with typed, named-field accessors."""

    raw: Mapping[str, Any]

    def has(self, name: str) -> bool:
        """True when ``name`` is present and not null."""
        return self.raw.get(name) is not None

    def positive_int(self, name: str, default: Any = _REQUIRED) -> int:
        """A positive integer field (``default`` when absent or null)."""
        value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CheckpointError(f"config.{name}", f"must be a positive integer, got {value!r}")
        return value

    def positive_float(self, name: str, default: Any = _REQUIRED) -> float:
        """A positive, finite number field."""
        value = self._get(name, default)
        return positive_number(f"config.{name}", value)

    def optional_positive_float(self, name: str, default: float | None) -> float | None:
        """A positive, finite number field, or None where the config sets null (or leaves it
        out with no default): the off switch of an optional part (a soft-cap)."""
        if self.raw.get(name, default) is None:
            return None
        return self.positive_float(name, default)

    def flag(self, name: str, default: bool) -> bool:
        """A boolean field."""
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise CheckpointError(f"config.{name}", f"must be true or false, got {value!r}")
        return value

    def text(self, name: str, default: Any = _REQUIRED) -> str:
        """A string field."""
        value = self._get(name, default)
        if not isinstance(value, str):
            raise CheckpointError(f"config.{name}", f"must be a string, got {value!r}")
        return value

    def token_id(self, name: str) -> int | None:
        """An optional non-negative token id."""
        value = self.raw.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"config.{name}", f"must be a token id, got {value!r}")
        return value

    def token_ids(self, name: str) -> tuple[int, ...]:
        """An int, list of ints or null, as a tuple of token ids."""
        value = self.raw.get(name)
        if value is None:
            return ()
        items = value if isinstance(value, list | tuple) else [value]
        for item in items:
            if isinstance(item, bool) or not isinstance(item, int) or item < 0:
                raise CheckpointError(f"config.{name}", f"must be token id(s), got {value!r}")
        return tuple(items)

    def reject_if(self, name: str, *, present: bool, reason: str) -> None:
        """Raise for a field whose value asks for something this family does not implement."""
        if present:
            raise CheckpointError(f"config.{name}", f"{reason}, got {self.raw.get(name)!r}")

    def _get(self, name: str, default: Any) -> Any:
        value = self.raw.get(name)
        if value is None:
            if default is _REQUIRED:
                raise CheckpointError(f"config.{name}", "required field is missing")
            return default
        return value


def positive_number(item: str, value: Any) -> float:
    """``value`` as a positive finite float, else ``CheckpointError`` naming ``item``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CheckpointError(item, f"must be a positive number, got {value!r}")
    number = float(value)
    if not (0.0 < number < float("inf")):
        raise CheckpointError(item, f"must be a positive number, got {value!r}")
    return number
