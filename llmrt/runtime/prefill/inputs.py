"""Prefill input values: host chunk tensors staged to the device, refreshed in place on replay."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from llmrt.device.base import Device
from llmrt.errors import RequestError
from llmrt.runtime.prefill.plan import PrefillChunk
from llmrt.runtime.tensor_resources import (
    ReleaseLedger,
    TensorResourceOrphan,
    allocate_many,
    release_tensors,
)


@attrs.frozen(kw_only=True, eq=False)
class PrefillInputs:
    """Device tensors of one prefill step (transient when eager, persistent when traced).

    Positions (and hence rotary phases) are derived on device from ``start_pos``, so a
    chunk trace replays for any absolute offset once ``start_pos`` is refreshed.
    ``chunk_start``/``active_rows`` are the chunk's host values for a model whose prefill
    reads them from the host (``prefill_from_host``, as tt_transformers' per-user prefill):
    the start position the step's rows share and how many leading rows are real.
    """

    tokens: torch.Tensor
    start_pos: torch.Tensor
    seq_lens: torch.Tensor
    page_table: torch.Tensor
    last_token_index: torch.Tensor
    chunk_start: int = 0
    active_rows: int = 0

    def owned_tensors(self) -> tuple[Any, ...]:
        return (self.tokens, self.start_pos, self.seq_lens, self.page_table, self.last_token_index)


def host_geometry(chunk: PrefillChunk) -> dict[str, int]:
    """``chunk_start`` and ``active_rows`` of a chunk whose real rows share one start (ttnn's
    wave rules: cached rows never join a wave); ``RequestError`` when they do not."""
    real = chunk.seq_lens > 0
    active = int(real.sum())
    starts = chunk.start_positions[real]
    if active == 0 or not bool(real[:active].all()) or bool((starts != chunk.start_pos).any()):
        raise RequestError(
            "start_pos",
            "a host-geometry prefill step needs leading real rows sharing one start position",
            value=chunk.start_positions.tolist(),
        )
    return {"chunk_start": int(chunk.start_pos), "active_rows": active}


def _host_fields(chunk: PrefillChunk) -> tuple[torch.Tensor, ...]:
    return (
        chunk.tokens,
        chunk.start_positions.to(torch.int32),
        chunk.seq_lens.to(torch.int32),
        chunk.page_table.to(torch.int32),
        chunk.last_token_index.to(torch.int64),
    )


def stage(
    chunk: PrefillChunk, *, device: Device, orphans: list[TensorResourceOrphan]
) -> PrefillInputs:
    """Upload a chunk's host tensors; the caller owns the result and must release it.

    If an upload fails, the tensors already uploaded are released (a failed release goes to
    ``orphans`` for a later retry) and the upload error propagates.
    """
    uploaded: list[torch.Tensor] = []
    try:
        for host in _host_fields(chunk):
            uploaded.append(device.upload(host))
    except BaseException:
        orphans.extend(release_tensors(uploaded, device=device, ledger=ReleaseLedger()))
        raise
    return PrefillInputs(
        tokens=uploaded[0],
        start_pos=uploaded[1],
        seq_lens=uploaded[2],
        page_table=uploaded[3],
        last_token_index=uploaded[4],
        **_geometry(chunk),
    )


def _geometry(chunk: PrefillChunk) -> dict[str, int]:
    """The chunk's host values (``host_geometry``), or zeros when its rows differ (a model
    that reads them refuses such a step in ``PrefillRuntime.body``)."""
    try:
        return host_geometry(chunk)
    except RequestError:
        return {"chunk_start": 0, "active_rows": 0}


def allocate_like(chunk: PrefillChunk, *, device: Device) -> PrefillInputs:
    """Persistent zeroed inputs with a chunk's geometry (for trace capture)."""
    made = allocate_many(device=device, specs=[(h.shape, h.dtype) for h in _host_fields(chunk)])
    return PrefillInputs(
        tokens=made[0],
        start_pos=made[1],
        seq_lens=made[2],
        page_table=made[3],
        last_token_index=made[4],
        **_geometry(chunk),
    )


def refresh(inputs: PrefillInputs, chunk: PrefillChunk, *, device: Device) -> None:
    """Rewrite every persistent input in place from a chunk's host values."""
    for dst, host in zip(inputs.owned_tensors(), _host_fields(chunk), strict=True):
        device.refresh(dst, host)
