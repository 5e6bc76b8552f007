"""vLLM TT plugin sampling columns as llmrt ``SamplingParams`` rows.

The plugin sends sampling as one object of per-field columns (its ``TTSamplingParams``:
``temperature``, ``top_k``, ``top_p``, ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``seed``, ``num_logprobs``, ``enable_log_probs``), each a list or
tensor with one entry per row, or a scalar for every row. Its conventions, read from the
plugin's input batch: ``top_k`` at or above the vocabulary (or <= 0) disables top-k and
``top_k == 1`` is argmax (the plugin then sends ``top_p = 0``); a seed of ``None`` or ``-1``
is unseeded; a row samples log-probabilities when ``enable_log_probs`` is true (or,
without that column, when ``num_logprobs >= 0``). Padding rows carry greedy defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from llmrt.errors import RequestError
from llmrt.sampling.params import SamplingParams

#: The plugin's "no seed" value in tensor columns.
SEED_NONE = -1

COLUMNS = (
    "temperature",
    "top_k",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "num_logprobs",
    "enable_log_probs",
)

SamplingArg = SamplingParams | Sequence[SamplingParams | None] | Any | None


def is_columns(value: object) -> bool:
    """True for a TTSamplingParams-shaped object (per-field columns, not llmrt params)."""
    return not isinstance(value, (SamplingParams, Sequence, torch.Tensor)) and all(
        hasattr(value, name) for name in ("temperature", "top_k", "top_p")
    )


def _column(columns: object, name: str, rows: int) -> list[Any] | None:
    value = getattr(columns, name, None)
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.reshape(-1).tolist() if value.dim() else value.item()
    if isinstance(value, (list, tuple)):
        if len(value) == 1 and rows > 1:
            return list(value) * rows
        if len(value) < rows:
            raise RequestError(
                f"sampling_params.{name}", f"has {len(value)} entries for {rows} rows"
            )
        return list(value[:rows])
    return [value] * rows


def params_from_columns(columns: object, rows: int, *, vocab_size: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per row from the plugin's sampling columns."""
    col = {name: _column(columns, name, rows) for name in COLUMNS}
    out = []
    for i in range(rows):

        def get(name: str, default: Any, i: int = i) -> Any:
            values = col[name]
            return default if values is None or values[i] is None else values[i]

        temperature = float(get("temperature", 1.0))
        top_k = int(get("top_k", 0))
        top_p = float(get("top_p", 1.0))
        greedy = temperature <= 0.0 or top_k == 1 or top_p <= 0.0
        seed = get("seed", None)
        seed = None if seed is None or int(seed) == SEED_NONE else int(seed)
        enabled = col["enable_log_probs"]
        numbers = col["num_logprobs"]
        if enabled is not None:
            wants_logprobs = bool(enabled[i])
        else:
            wants_logprobs = numbers is not None and int(numbers[i]) >= 0
        try:
            out.append(
                SamplingParams(
                    temperature=0.0 if greedy else temperature,
                    top_k=0 if greedy or not 0 < top_k < vocab_size else top_k,
                    top_p=1.0 if greedy else top_p,
                    seed=None if greedy else seed,
                    presence_penalty=float(get("presence_penalty", 0.0)),
                    frequency_penalty=float(get("frequency_penalty", 0.0)),
                    repetition_penalty=float(get("repetition_penalty", 1.0)),
                    logprobs=0 if wants_logprobs else None,
                )
            )
        except RequestError as exc:
            raise RequestError(
                f"sampling_params.{exc.field}", exc.reason, row=i, value=exc.value
            ) from exc
    return out


def per_row_params(
    params: SamplingArg, rows: int, *, vocab_size: int
) -> list[SamplingParams | None] | None:
    """Plugin columns, one ``SamplingParams`` for all rows, or one per row; None: logits."""
    if params is None:
        return None
    if is_columns(params):
        return list(params_from_columns(params, rows, vocab_size=vocab_size))
    if isinstance(params, SamplingParams):
        return [params] * rows
    listed = list(params)
    if len(listed) == 1 and rows > 1:
        listed = listed * rows
    if len(listed) != rows:
        raise RequestError("sampling_params", f"has {len(listed)} entries for {rows} rows")
    for i, p in enumerate(listed):
        if p is not None and not isinstance(p, SamplingParams):
            raise RequestError(
                "sampling_params",
                "must be TTSamplingParams columns, a SamplingParams or None",
                row=i,
                value=type(p).__name__,
            )
    return listed
