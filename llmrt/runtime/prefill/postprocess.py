"""Post-processing after a program: argmax or sampling over its logits.

Programs (eager or traced) always return logits; choosing tokens runs after them,
outside any trace (as vLLM samples outside CUDA graphs), so seeds and per-request
filters are never baked into a captured program and one program serves every
output path.

Post-processing is torch code. It runs on the program's outputs when they are torch
tensors; a backend whose tensors torch cannot compute on (ttnn) has them read first and
post-processed on the host (``HostFinish``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from llmrt.device.base import is_device_tensor
from llmrt.runtime.output_reader import OutputReader, PendingRead
from llmrt.sampling.sampler import SamplingTensors, greedy_argmax, sample

HostOutputs = dict[str, torch.Tensor]


def runs_on_host(raw: Mapping[str, Any]) -> bool:
    """Whether ``raw`` holds device tensors torch cannot compute on (post-process on the host)."""
    return any(is_device_tensor(v) and not isinstance(v, torch.Tensor) for v in raw.values())


@attrs.frozen(kw_only=True, eq=False)
class HostFinish:
    """A program's device outputs with their read already submitted, and the post-processing
    (argmax, sampling) that turns the host copy into the call's outputs.

    The read is submitted as soon as the program ran, so it is queued ahead of any replay that
    would rewrite a trace's outputs (no device copy is needed). ``is_tokens`` says what
    ``apply`` returns: tokens, or the logits unchanged.
    """

    raw: Mapping[str, Any]
    pending: PendingRead
    apply: Callable[[HostOutputs], HostOutputs]
    is_tokens: bool

    @classmethod
    def submit(
        cls,
        raw: Mapping[str, Any],
        *,
        reader: OutputReader,
        apply: Callable[[HostOutputs], HostOutputs],
        is_tokens: bool,
    ) -> HostFinish:
        return cls(raw=raw, pending=reader.submit(raw), apply=apply, is_tokens=is_tokens)

    def result(self, reader: OutputReader) -> HostOutputs:
        """Complete the read (its event is synchronized first) and post-process it."""
        return self.apply(reader.complete(self.pending))


Finished = dict[str, torch.Tensor] | HostFinish
"""What a runtime's ``finish`` returns: post-processed outputs, or a ``HostFinish``."""


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
        return {"tokens": greedy_argmax(raw["logits"])}
    result = sample(raw["logits"], sampling, step_offsets=step_offsets, generator=generator)
    out = {"tokens": result.tokens}
    if result.logprobs is not None:
        out["logprobs"] = result.logprobs
    if result.top_logprobs is not None:
        out["top_logprob_values"], out["top_logprob_ids"] = result.top_logprobs
    return out
