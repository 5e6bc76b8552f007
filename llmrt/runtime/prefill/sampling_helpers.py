"""Stateless prefill sampling helpers: per-request parameter rows and output-path choice."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmrt.errors import RequestError
from llmrt.sampling.params import SamplingParams
from llmrt.sampling.sampler import SamplingTensors, token_counts


def normalize_params(
    params: SamplingParams | Sequence[SamplingParams | None] | None, *, num_rows: int
) -> tuple[SamplingParams | None, ...] | None:
    """One entry per source row; a single value broadcasts to every row."""
    if params is None:
        return None
    if isinstance(params, SamplingParams):
        return (params,) * num_rows
    rows = tuple(params)
    if len(rows) == 1 and num_rows > 1:
        return rows * num_rows
    if len(rows) != num_rows:
        raise RequestError("sampling_params", f"has {len(rows)} entries for {num_rows} rows")
    for i, p in enumerate(rows):
        if p is not None and not isinstance(p, SamplingParams):
            raise RequestError(
                "sampling_params", "must be SamplingParams or None", row=i, value=type(p)
            )
    return rows


def plain_argmax(params: SamplingParams | None) -> bool:
    """Whether a row's token is the argmax of the raw logits (greedy, no logprobs or penalties).

    Penalties change greedy tokens too (vLLM applies them before the argmax), and so does a
    structured-output mask, so such greedy rows take the sampling path.
    """
    return params is None or (
        params.greedy
        and params.logprobs is None
        and not params.has_penalties
        and params.structured_output is None
    )


def output_path(params: Sequence[SamplingParams | None] | None) -> str:
    """``logits`` without params, ``argmax`` when every row is a plain argmax, else ``sample``."""
    if params is None:
        return "logits"
    if all(plain_argmax(p) for p in params):
        return "argmax"
    return "sample"


def request_tensors(
    params: Sequence[SamplingParams | None],
    *,
    source_rows: Sequence[int],
    padded_batch: int,
    vocab_size: int,
    device: torch.device,
) -> SamplingTensors:
    """Sampling tensors for one request's physical rows (padding rows greedy)."""
    return SamplingTensors.from_params(
        [params[r] for r in source_rows],
        batch_size=padded_batch,
        vocab_size=vocab_size,
        device=device,
    )


def history_counts(
    histories: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    batch: int,
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt and output token counts ``[batch, vocab]`` of each row's ``(prompt, output)``
    history, on ``device`` (the logits'); rows past ``histories`` (padding) count nothing."""
    rows = [*histories, *([((), ())] * (batch - len(histories)))]
    return (
        counts_of([prompt for prompt, _ in rows], vocab_size=vocab_size, device=device),
        counts_of([output for _, output in rows], vocab_size=vocab_size, device=device),
    )


def counts_of(
    rows: Sequence[Sequence[int]], *, vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Per-row token occurrence counts ``[len(rows), vocab]`` on ``device`` (for penalties):
    the ids go there, so the ``[rows, vocab]`` counts are made there, not copied."""
    width = max(1, max((len(r) for r in rows), default=0))
    ids = torch.full((len(rows), width), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.int64)
    return token_counts(ids.to(device), vocab_size=vocab_size)
