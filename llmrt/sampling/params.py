"""Per-request sampling parameters (vLLM field names), validated once at construction.

Every invalid value raises :class:`~llmrt.errors.RequestError` whose ``field`` is the
parameter name and whose message shows the value, so a log line alone is enough.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeGuard

import attrs

from llmrt.errors import RequestError
from llmrt.sampling.structured import StructuredOutput, TokenConstraint

#: Most top log-probabilities one request may ask for (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20
#: Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``); dividing by them overflows.
GREEDY_TEMPERATURE = 1e-5

_Validator = Callable[[object, "attrs.Attribute[Any]", object], None]


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> TypeGuard[float]:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _int_at_least(low: int) -> _Validator:
    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not _is_int(value):
            raise RequestError(attribute.name, "must be an integer", value=value)
        if int(value) < low:
            raise RequestError(attribute.name, f"must be >= {low}", value=value)

    return check


def _real_in(
    low: float | None, high: float | None, *, low_open: bool = False, high_open: bool = False
) -> _Validator:
    if low is None:
        reason = f"must be a finite number {'<' if high_open else '<='} {high:g}"
    elif high is None:
        reason = f"must be a finite number {'>' if low_open else '>='} {low:g}"
    else:
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        reason = f"must be a finite number in {left}{low:g}, {high:g}{right}"

    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not _is_real(value):
            raise RequestError(attribute.name, "must be a real number", value=value)
        x = float(value)
        ok = math.isfinite(x)
        if ok and low is not None:
            ok = x > low if low_open else x >= low
        if ok and high is not None:
            ok = x < high if high_open else x <= high
        if not ok:
            raise RequestError(attribute.name, reason, value=value)

    return check


def _check_top_k(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not _is_int(value):
        raise RequestError(attribute.name, "must be an integer", value=value)
    if int(value) < -1:
        raise RequestError(attribute.name, "must be >= 1, or 0 / -1 to disable", value=value)


def _check_seed(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not _is_int(value):
        raise RequestError(attribute.name, "must be an integer or None", value=value)


def _check_bool(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise RequestError(attribute.name, "must be a bool", value=value)


def _check_logprobs(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if not _is_int(value) or not 0 <= int(value) <= MAX_LOGPROBS:
        raise RequestError(
            attribute.name, f"must be None or an integer in [0, {MAX_LOGPROBS}]", value=value
        )


def _check_structured(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, StructuredOutput):
        raise RequestError(attribute.name, "must be a StructuredOutput or None", value=value)


def _check_constraint(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not all(
        callable(getattr(value, name, None)) for name in ("fill_bitmask", "accept")
    ):
        raise RequestError(attribute.name, "must be a TokenConstraint or None", value=value)


def _to_stop(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """Normalise ``stop`` (a string, an iterable of strings, or None) to a tuple."""
    if value is None:
        return ()
    items: tuple[object, ...]
    if isinstance(value, str):
        items = (value,)
    elif isinstance(value, Iterable) and not isinstance(value, (bytes, bytearray, Mapping)):
        items = tuple(value)
    else:
        raise RequestError("stop", "must be a string or a list of strings", value=value)
    if not all(isinstance(s, str) and s for s in items):
        raise RequestError("stop", "every entry must be a non-empty string", value=value)
    return items  # type: ignore[return-value]


def _to_stop_token_ids(value: Iterable[int] | None) -> tuple[int, ...]:
    """Normalise ``stop_token_ids`` (an iterable of non-negative ints, or None) to a tuple."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Iterable):
        raise RequestError("stop_token_ids", "must be a list of token ids", value=value)
    items = tuple(value)
    if not all(_is_int(t) and int(t) >= 0 for t in items):
        raise RequestError(
            "stop_token_ids", "every entry must be a non-negative integer", value=value
        )
    return tuple(int(t) for t in items)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How one request samples: vLLM names and semantics.

    ``temperature`` below ``GREEDY_TEMPERATURE`` (0 in practice) means greedy argmax;
    ``top_k`` of 0 or -1 disables top-k; ``logprobs=N`` returns the chosen token's
    log-probability plus the top ``N`` (``0``: the chosen one only, ``None``: none).
    ``stop``, ``stop_token_ids``, ``ignore_eos`` and ``max_tokens`` are read by the
    scheduler and detokenizer, not by the sampler.

    ``structured_output`` constrains the text (JSON, a JSON schema, a regex) during
    decoding. The engine binds each request's live ``constraint`` (compiled from it, owned
    by the request, excluded from equality); the sampler masks the logits with it.
    """

    max_tokens: int = attrs.field(default=16, validator=_int_at_least(1))
    temperature: float = attrs.field(default=1.0, validator=_real_in(0.0, None))
    top_k: int = attrs.field(default=0, validator=_check_top_k)
    top_p: float = attrs.field(default=1.0, validator=_real_in(0.0, 1.0, low_open=True))
    min_p: float = attrs.field(default=0.0, validator=_real_in(0.0, 1.0))
    seed: int | None = attrs.field(default=None, validator=_check_seed)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_to_stop)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_to_stop_token_ids)
    ignore_eos: bool = attrs.field(default=False, validator=_check_bool)
    logprobs: int | None = attrs.field(default=None, validator=_check_logprobs)
    repetition_penalty: float = attrs.field(
        default=1.0, validator=_real_in(0.0, None, low_open=True)
    )
    presence_penalty: float = attrs.field(default=0.0, validator=_real_in(-2.0, 2.0))
    frequency_penalty: float = attrs.field(default=0.0, validator=_real_in(-2.0, 2.0))
    structured_output: StructuredOutput | None = attrs.field(
        default=None, validator=_check_structured
    )
    constraint: TokenConstraint | None = attrs.field(
        default=None, eq=False, repr=False, validator=_check_constraint
    )

    @property
    def greedy(self) -> bool:
        """True when the token is the argmax (temperature ~ 0); seeds and filters are moot."""
        return float(self.temperature) < GREEDY_TEMPERATURE

    @property
    def top_k_enabled(self) -> bool:
        return int(self.top_k) > 0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> SamplingParams:
        """Build from request keyword arguments, rejecting unknown names (all of them, sorted)."""
        known = sorted(a.name for a in attrs.fields(cls))
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise RequestError(
                "sampling_params",
                f"unknown parameter(s) {', '.join(unknown)} (known: {', '.join(known)})",
                value=tuple(unknown),
            )
        return cls(**kwargs)
