"""Prefill post-processing: the program head and the sampling step after it."""

from __future__ import annotations

import torch

from llmrt.sampling import SamplingTensors, sample


def program_head(logits: torch.Tensor, *, head: str) -> dict[str, torch.Tensor]:
    """What the (traceable) program returns: raw logits or argmax tokens."""
    if head == "argmax":
        return {"tokens": torch.argmax(logits, dim=-1)}
    return {"logits": logits}


def sample_outputs(
    raw: dict[str, torch.Tensor],
    *,
    path: str,
    sampling: SamplingTensors | None,
    step_offsets: torch.Tensor,
    generator: torch.Generator | None,
) -> dict[str, torch.Tensor]:
    """Run the sampling step on the device outputs when the request samples."""
    if path != "sample" or sampling is None:
        return raw
    result = sample(raw["logits"], sampling, step_offsets=step_offsets, generator=generator)
    out = {"tokens": result.tokens}
    if result.logprobs is not None:
        out["logprobs"] = result.logprobs
    if result.top_logprobs is not None:
        out["top_logprob_values"], out["top_logprob_ids"] = result.top_logprobs
    return out
