"""The runtime's error types.

Each error carries the facts a caller needs to act on it as attributes, and its
message names the offending field, row or object so a log line alone is enough.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class LLMRTError(Exception):
    """Base class of every error llmrt raises on purpose."""


class ConfigError(LLMRTError, ValueError):
    """A static configuration value is invalid.

    ``field`` is the dotted path of the bad value (``kv_cache.block_size``),
    ``value`` the value that was given; ``MISSING`` where nothing was (the message then
    says only what is needed).
    """

    def __init__(self, field: str, value: Any, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        shown = "" if value is MISSING else f", got {value!r}"
        super().__init__(f"{field}: {reason}{shown}")


#: ``ConfigError``'s value where the field was not given at all.
MISSING: Any = type("Missing", (), {"__repr__": lambda self: "MISSING"})()


class RecipeError(ConfigError):
    """A recipe file or override does not validate; ``field`` is the path inside the recipe."""


class RequestError(LLMRTError, ValueError):
    """A prefill/decode/sampling request is malformed.

    Raised before any device work or KV write. ``row`` is the source row (or None
    when the whole request is at fault) and ``field`` the argument at fault.
    """

    def __init__(
        self, field: str, reason: str, *, row: int | None = None, value: Any = None
    ) -> None:
        self.field = field
        self.row = row
        self.value = value
        self.reason = reason
        where = f"row {row}: " if row is not None else ""
        shown = f", got {value!r}" if value is not None else ""
        super().__init__(f"{where}{field}: {reason}{shown}")


class CheckpointError(LLMRTError):
    """A checkpoint cannot be loaded; ``item`` names the tensor, file or config field."""

    def __init__(self, item: str, reason: str) -> None:
        self.item = item
        self.reason = reason
        super().__init__(f"{item}: {reason}")


class FamilyError(LLMRTError, LookupError):
    """An unknown or unusable model family."""


class ContainerStateError(LLMRTError, RuntimeError):
    """A container was used out of order (e.g. a provider overridden after it was built)."""


class KVCacheStateError(LLMRTError, RuntimeError):
    """An illegal paged-KV manager transition or a foreign/stale KV handle."""

    def __init__(
        self, message: str, *, current: str | None = None, requested: str | None = None
    ) -> None:
        self.current = current
        self.requested = requested
        super().__init__(message)


class CompileGateClosed(LLMRTError, RuntimeError):
    """A program signature was not compiled before the compile gate closed."""

    def __init__(self, key: str, description: str) -> None:
        self.key = key
        self.description = description
        super().__init__(
            f"compile gate is closed (traces are captured or active); "
            f"program {description} [{key[:12]}] was never compiled during warmup"
        )


class TraceCoverageError(LLMRTError, RuntimeError):
    """A selected traced operation has no captured trace for a prepared request.

    Raised during preflight, before any device work or KV write.
    """

    def __init__(self, operation: str, missing: Sequence[str]) -> None:
        self.operation = operation
        self.missing = tuple(missing)
        listed = "; ".join(self.missing)
        super().__init__(
            f"{operation}: no captured trace covers {len(self.missing)} prepared "
            f"request(s): {listed}. Add the geometry to the recipe's warmup section "
            f"or select trace.mode=none/decode_only for this operation."
        )


class TraceStateError(LLMRTError, RuntimeError):
    """A trace operation was called in the wrong state (nested capture, replay after release...)."""


class DeviceError(LLMRTError, RuntimeError):
    """A device-port operation failed or was used illegally (e.g. upload during capture)."""


class IdentityError(LLMRTError, ValueError):
    """Two collaborators that must be the same object are not; the message names both."""

    def __init__(self, constraint: str, left: object, right: object) -> None:
        self.constraint = constraint
        self.left = left
        self.right = right
        super().__init__(
            f"identity constraint violated: {constraint}: "
            f"{_describe(left)} is not {_describe(right)}"
        )


class CleanupError(LLMRTError, RuntimeError):
    """One or more cleanup steps failed.

    ``primary`` is the error that started the teardown (or None), ``failures``
    every cleanup failure in the order it happened, as ``(step, exception)``.
    """

    def __init__(
        self,
        failures: Sequence[tuple[str, BaseException]],
        *,
        primary: BaseException | None = None,
    ) -> None:
        self.failures = tuple(failures)
        self.primary = primary
        lines = [f"{step}: {type(exc).__name__}: {exc}" for step, exc in self.failures]
        head = f"{len(self.failures)} cleanup step(s) failed"
        if primary is not None:
            head += f" while handling {type(primary).__name__}: {primary}"
        super().__init__(head + ("\n  " + "\n  ".join(lines) if lines else ""))


class UnsupportedError(LLMRTError, NotImplementedError):
    """A request asks for a capability that is rejected explicitly (not silently degraded)."""


def _describe(obj: object) -> str:
    return f"{type(obj).__name__}@{id(obj):#x}"
