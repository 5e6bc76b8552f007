"""Padded prefill sequence lengths: the bucket policy shared by planning and warmup.

A bucket policy maps an actual new-token length to the padded length a prefill
program is compiled for. Fewer distinct lengths mean fewer programs and traces;
finer lengths waste less compute on padding. Padding never exceeds ``max_len``
(the regular prefill chunk size): longer sequences are chunked, not padded.
"""

from __future__ import annotations

from typing import Literal

import attrs

from llmrt.errors import ConfigError, RequestError

BucketKind = Literal["tile", "fine"]
BUCKET_KINDS: tuple[str, ...] = ("tile", "fine")

#: Smallest padded length of the ``tile`` policy (the spec's Q128 tile-friendly start).
TILE_MIN_LEN = 128

#: Default ``fine`` step; the CPU runtime owner tunes it by measurement.
FINE_DEFAULT_STEP = 32


def _require(ok: bool, field: str, value: object, reason: str) -> None:
    if not ok:
        raise ConfigError(field, value, reason)


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@attrs.frozen(kw_only=True)
class SeqLenBuckets:
    """How actual prefill lengths round up to compiled lengths.

    ``tile``: powers of two starting at 128 (128, 256, 512, ...), capped at ``max_len``
    (the spec's tile-friendly default). ``fine``: round up to a multiple of ``step``,
    capped at ``max_len`` (a CPU default where padding costs real FLOPs).
    """

    kind: str
    max_len: int
    step: int = FINE_DEFAULT_STEP

    def __attrs_post_init__(self) -> None:
        _require(
            self.kind in BUCKET_KINDS,
            "prefill.buckets.kind",
            self.kind,
            f"must be one of {BUCKET_KINDS}",
        )
        _require(
            _is_positive_int(self.max_len),
            "prefill.buckets.max_len",
            self.max_len,
            "must be a positive integer",
        )
        _require(
            _is_positive_int(self.step) and self.step % 8 == 0,
            "prefill.buckets.step",
            self.step,
            "must be a positive multiple of 8",
        )

    @classmethod
    def tile(cls, *, max_len: int) -> SeqLenBuckets:
        """Powers of two from 128, capped at ``max_len``."""
        return cls(kind="tile", max_len=max_len)

    @classmethod
    def fine(cls, *, max_len: int, step: int = FINE_DEFAULT_STEP) -> SeqLenBuckets:
        """Multiples of ``step``, capped at ``max_len``."""
        return cls(kind="fine", max_len=max_len, step=step)

    @classmethod
    def named(cls, kind: str, *, max_len: int, step: int = FINE_DEFAULT_STEP) -> SeqLenBuckets:
        """The named default ``kind`` (``tile`` or ``fine``) for ``max_len``."""
        return cls(kind=kind, max_len=max_len, step=step)

    def pad(self, n: int) -> int:
        """Padded length for ``n`` new tokens; ``1 <= n <= max_len`` (longer ones are chunked)."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.max_len:
            raise RequestError(
                "seq_len",
                f"must be an integer in [1, {self.max_len}] (longer prefills are "
                "chunked, never padded)",
                value=n,
            )
        if self.kind == "tile":
            padded = max(TILE_MIN_LEN, 1 << (n - 1).bit_length())
        else:
            padded = -(-n // self.step) * self.step
        return min(padded, self.max_len)

    def lengths(self) -> tuple[int, ...]:
        """Every padded length this policy can produce, increasing (warmup coverage)."""
        if self.kind == "tile":
            out: list[int] = []
            n = TILE_MIN_LEN
            while n < self.max_len:
                out.append(n)
                n *= 2
            out.append(self.max_len)
            return tuple(out)
        return (*range(self.step, self.max_len, self.step), self.max_len)
