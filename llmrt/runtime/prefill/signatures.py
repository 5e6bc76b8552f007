"""Prepared prefill requests and their pure eager-program and trace identities.

Identities omit the active batch size: they use the padded batch, sequence and
page geometry, the operation variant and the sampling material, so a wave of 5
rows and a wave of 7 rows padded to 8 share one program and one trace.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from llmrt.runtime.prefill.plan import PrefillChunk, PrefillPlan, PrefillRequest
from llmrt.sampling.sampler import SamplingTensors


@attrs.frozen(kw_only=True)
class PrefillSignature:
    """One prefill program: variant, padded geometry and output path."""

    variant: str  # "regular" (no cached prefix read) or "chunked" (reads a cached prefix)
    padded_batch: int
    padded_seq_len: int
    page_table_width: int

    @property
    def operation(self) -> str:
        return "prefill"

    def material(self) -> Mapping[str, Any]:
        return {
            "variant": self.variant,
            "padded_batch": self.padded_batch,
            "padded_seq_len": self.padded_seq_len,
            "page_table_width": self.page_table_width,
        }

    def describe(self) -> str:
        return (
            f"prefill[{self.variant} b{self.padded_batch} s{self.padded_seq_len} "
            f"w{self.page_table_width}]"
        )


@attrs.frozen(kw_only=True, eq=False)
class PreparedPrefillRequest:
    """One planned request plus the program signature of each of its chunk steps."""

    request: PrefillRequest
    signatures: tuple[PrefillSignature, ...]
    path: str  # "logits" | "argmax" | "sample"
    sampling: SamplingTensors | None
    step_offsets: torch.Tensor

    @property
    def steps(self) -> tuple[tuple[PrefillChunk, PrefillSignature], ...]:
        return tuple(zip(self.request.chunks, self.signatures, strict=True))


@attrs.frozen(kw_only=True, eq=False)
class PreparedPrefill:
    """A whole public prefill call, planned once."""

    plan: PrefillPlan
    requests: tuple[PreparedPrefillRequest, ...]
    num_rows: int
    want_logits: bool

    def signatures(self) -> tuple[PrefillSignature, ...]:
        seen: dict[PrefillSignature, None] = {}
        for prepared in self.requests:
            for sig in prepared.signatures:
                seen.setdefault(sig, None)
        return tuple(seen)


def chunk_signature(request: PrefillRequest, chunk: PrefillChunk, *, path: str) -> PrefillSignature:
    # A step reads cached KV when some row starts after position 0 (a prefix hit, also in a
    # wave, or a later chunk).
    reads_cache = request.kind == "chunked" or any(request.cached_tokens)
    variant = "chunked" if reads_cache else "regular"
    return PrefillSignature(
        variant=variant,
        padded_batch=request.padded_batch_size,
        padded_seq_len=chunk.padded_len,
        page_table_width=request.page_table_width,
    )
