"""Synchronized readback of prefill outputs, restored to the caller's source-row order."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from llmrt.runtime.output_reader import OutputReader
from llmrt.runtime.prefill.postprocess import Finished, HostFinish


@attrs.frozen(kw_only=True)
class PrefillOutput:
    """Host outputs in source-row order; fields a call did not ask for are None."""

    tokens: torch.Tensor | None
    logits: torch.Tensor | None
    logprobs: torch.Tensor | None = None
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None


class ResultCollector:
    """Reads each finished request's outputs as soon as it completes (streaming)."""

    def __init__(self, *, output_reader: OutputReader, num_rows: int) -> None:
        self.borrowed_reader = output_reader
        self.num_rows = num_rows
        self._rows: dict[str, dict[int, torch.Tensor]] = {}

    def collect(
        self,
        raw: Finished,
        *,
        source_rows: tuple[int, ...],
        batch_rows: tuple[int, ...],
    ) -> None:
        """Read ``raw`` now (completing a ``HostFinish``) and file each active batch row under
        its source row."""
        host: dict[str, Any] = (
            raw.result(self.borrowed_reader)
            if isinstance(raw, HostFinish)
            else self.borrowed_reader.read(raw)
        )
        for name, value in host.items():
            per_row = self._rows.setdefault(name, {})
            for src, b in zip(source_rows, batch_rows, strict=True):
                per_row[src] = value[b]

    def result(self) -> PrefillOutput:
        def stacked(name: str) -> torch.Tensor | None:
            rows = self._rows.get(name)
            if rows is None:
                return None
            missing = [r for r in range(self.num_rows) if r not in rows]
            if missing:
                raise RuntimeError(f"prefill produced no {name} for source rows {missing}")
            return torch.stack([rows[r] for r in range(self.num_rows)])

        tops = None
        values, ids = stacked("top_logprob_values"), stacked("top_logprob_ids")
        if values is not None and ids is not None:
            tops = (values, ids)
        return PrefillOutput(
            tokens=stacked("tokens"),
            logits=stacked("logits"),
            logprobs=stacked("logprobs"),
            top_logprobs=tops,
        )
