"""Post-processing after a program: argmax or sampling over its logits.

Programs (eager or traced) always return logits; choosing tokens runs after them,
outside any trace (as vLLM samples outside CUDA graphs), so seeds and per-request
filters are never baked into a captured program and one program serves every
output path.
"""

from __future__ import annotations

import torch

from llmrt.sampling import SamplingTensors, sample


def sample_outputs(
    raw: dict[str, torch.Tensor],
    *,
    path: str,
    sampling: SamplingTensors | None,
    step_offsets: torch.Tensor,
    generator: torch.Generator | None,
) -> dict[str, torch.Tensor]:
    """``logits`` passes through; ``argmax`` and ``sample`` turn logits into tokens."""
    if path == "logits":
        return raw
    if path == "argmax" or sampling is None:
        return {"tokens": torch.argmax(raw["logits"], dim=-1)}
    result = sample(raw["logits"], sampling, step_offsets=step_offsets, generator=generator)
    out = {"tokens": result.tokens}
    if result.logprobs is not None:
        out["logprobs"] = result.logprobs
    if result.top_logprobs is not None:
        out["top_logprob_values"], out["top_logprob_ids"] = result.top_logprobs
    return out
