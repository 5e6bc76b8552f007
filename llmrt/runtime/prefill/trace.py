"""Prefill trace capture plans and replay-time input refresh.

A prefill trace is keyed by its program signature (padded batch, padded length,
width, variant). Every replay rewrites all persistent inputs (tokens,
offsets, lengths, page table), so one chunk trace serves every chunk of a long
request and every wave with the same padded geometry. Capture fills all physical
rows; padding rows carry ``-1`` page tables and write nothing. Sampling runs
after replay, outside the trace (as vLLM samples outside CUDA graphs), so seeds
and per-request filters are never baked into a captured program.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmrt.device.base import Device
from llmrt.runtime.prefill.inputs import PrefillInputs, allocate_like, refresh
from llmrt.runtime.prefill.plan import PrefillChunk
from llmrt.runtime.prefill.signatures import PrefillSignature
from llmrt.runtime.trace_compiler import TraceCapturePlan

ProgramBody = Callable[[PrefillInputs, PrefillSignature], dict[str, torch.Tensor]]


def capture_plan(
    *,
    program_key: str,
    signature: PrefillSignature,
    chunk: PrefillChunk,
    device: Device,
    body: ProgramBody,
) -> TraceCapturePlan:
    """How to capture ``signature`` over persistent inputs primed from ``chunk``."""

    def allocate_inputs() -> PrefillInputs:
        return allocate_like(chunk, device=device)

    def prime(inputs: PrefillInputs) -> None:
        refresh(inputs, chunk, device=device)

    def program(inputs: PrefillInputs) -> dict[str, torch.Tensor]:
        return body(inputs, signature)

    return TraceCapturePlan(
        program_key=program_key,
        operation="prefill",
        batch_size=signature.padded_batch,
        material=signature.material(),
        description=signature.describe(),
        allocate_inputs=allocate_inputs,
        prime_inputs=prime,
        program=program,
    )
