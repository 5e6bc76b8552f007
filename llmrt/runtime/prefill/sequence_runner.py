"""Run one prepared request's chunk steps eagerly with failure-safe ownership.

Each step's staged inputs are released as soon as the step ran, also when the
step fails; only the final chunk's outputs are handed to the caller (earlier
chunks exist to fill KV, their outputs are dropped).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmrt.device.base import Device
from llmrt.runtime.prefill.inputs import PrefillInputs, stage
from llmrt.runtime.prefill.signatures import PrefillSignature, PreparedPrefillRequest
from llmrt.runtime.tensor_resources import ReleaseLedger, TensorResourceOrphan, release_tensors

StepBody = Callable[[PrefillInputs, PrefillSignature], dict[str, torch.Tensor]]
StepHook = Callable[[PrefillSignature, dict[str, torch.Tensor]], object]


def run_sequence(
    prepared: PreparedPrefillRequest,
    *,
    device: Device,
    body: StepBody,
    on_step: StepHook | None = None,
    orphans: list[TensorResourceOrphan],
) -> dict[str, torch.Tensor]:
    """Run every chunk of ``prepared``; return the final chunk's raw outputs (caller owns)."""
    ledger = ReleaseLedger()
    result: dict[str, torch.Tensor] | None = None
    for chunk, signature in prepared.steps:
        inputs = stage(chunk, device=device, orphans=orphans)
        try:
            out = body(inputs, signature)
        finally:
            orphans.extend(release_tensors(inputs, device=device, ledger=ledger))
        if on_step is not None:
            on_step(signature, out)
        if chunk.is_last:
            result = out
    if result is None:
        raise RuntimeError("prefill request has no final chunk")
    return result
