"""Structured output: what a request's text must match, and the per-request constraint that
enforces it while decoding.

:class:`StructuredOutput` is declarative (frozen, shareable by many requests):
``json_object`` (any JSON object), ``json_schema`` (an instance of a JSON schema) or
``regex``. The engine compiles it into one :class:`TokenConstraint` per request
(:mod:`llmrt.sampling.guided`), which the sampler reads through
``SamplingParams.constraint``: before each token it fills the bitmask of the tokens that
keep the text valid, the sampler sends every other logit to -inf (host and device path
alike), and the engine hands it each chosen token.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Protocol

import attrs
import numpy as np

from llmrt.errors import RequestError

StructuredKind = Literal["json_object", "json_schema", "regex"]
_KINDS = ("json_object", "json_schema", "regex")


def _check_kind(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in _KINDS:
        raise RequestError(
            "structured_output.kind", f"must be one of {', '.join(_KINDS)}", value=value
        )


@attrs.frozen(kw_only=True)
class StructuredOutput:
    """The form a request's output must take.

    ``spec`` is the JSON schema's text for ``json_schema`` (validated as JSON once here),
    the pattern for ``regex``, and unused for ``json_object``.
    """

    kind: StructuredKind = attrs.field(validator=_check_kind)
    spec: str = ""

    def __attrs_post_init__(self) -> None:
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except (TypeError, ValueError) as exc:
                raise RequestError("structured_output.schema", f"is not JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise RequestError(
                    "structured_output.schema", "must be a JSON object", value=type(schema).__name__
                )
        elif self.kind == "regex" and not self.spec:
            raise RequestError("structured_output.regex", "is empty")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | str) -> StructuredOutput:
        """Output that validates against ``schema`` (a dict, or its JSON text)."""
        # Key order is kept: a schema's property order is the order the output writes them.
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls(kind="json_schema", spec=text)

    @classmethod
    def json_object(cls) -> StructuredOutput:
        """Output that is one JSON object (OpenAI's JSON mode)."""
        return cls(kind="json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        """Output that matches ``pattern`` whole."""
        return cls(kind="regex", spec=pattern)


class TokenConstraint(Protocol):
    """One request's live constraint (owned by the engine's request; the sampler borrows it)."""

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write row ``row`` of ``bitmask`` (int32 ``[rows, ceil(vocab / 32)]``, bit ``t % 32``
        of word ``t // 32`` set where token ``t`` is allowed next)."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advance past the chosen token; False when the constraint refuses it."""
        ...

    @property
    def finished(self) -> bool:
        """Whether the output is complete (nothing but the end of text may follow)."""
        ...

    @property
    def error(self) -> str | None:
        """Why the constraint failed, once it did."""
        ...


def bitmask_to_allowed(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Bool ``[rows, vocab_size]`` of an int32 bitmask ``[rows, words]``; tokens past the
    mask's width are not allowed."""
    bits = np.unpackbits(
        np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little"
    ).astype(bool)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    out = np.zeros((bits.shape[0], vocab_size), dtype=bool)
    out[:, : bits.shape[1]] = bits
    return out
