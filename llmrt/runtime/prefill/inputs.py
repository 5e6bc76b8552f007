"""Prefill input values: host chunk tensors staged to the device, refreshed in place on replay."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from llmrt.device.base import Device
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
    """

    tokens: torch.Tensor
    start_pos: torch.Tensor
    seq_lens: torch.Tensor
    page_table: torch.Tensor
    last_token_index: torch.Tensor

    def owned_tensors(self) -> tuple[Any, ...]:
        return (self.tokens, self.start_pos, self.seq_lens, self.page_table, self.last_token_index)


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
    )


def allocate_like(chunk: PrefillChunk, *, device: Device) -> PrefillInputs:
    """Persistent zeroed inputs with a chunk's geometry (for trace capture)."""
    made = allocate_many(device=device, specs=[(h.shape, h.dtype) for h in _host_fields(chunk)])
    return PrefillInputs(
        tokens=made[0],
        start_pos=made[1],
        seq_lens=made[2],
        page_table=made[3],
        last_token_index=made[4],
    )


def refresh(inputs: PrefillInputs, chunk: PrefillChunk, *, device: Device) -> None:
    """Rewrite every persistent input in place from a chunk's host values."""
    for dst, host in zip(inputs.owned_tensors(), _host_fields(chunk), strict=True):
        device.refresh(dst, host)
