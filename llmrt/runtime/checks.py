"""Input checks shared by the runtime's request validators."""

from __future__ import annotations

import numpy as np
import torch

#: numpy dtype kinds token ids, positions, page tables and step offsets may have.
INTEGER_KINDS = "iub"


def host_array(value: object) -> np.ndarray:
    """A numpy view of a host tensor (a copy of a device one), or an array of anything else.

    Validators and per-step host code read inputs this way: ~1 us numpy ops instead of ~4 us
    dispatched torch ops, which a few-ms decode step notices. numpy has no bfloat16 (or
    float8): such a tensor comes back as float32, so it is still refused as a float."""
    if isinstance(value, torch.Tensor):
        host = value.detach().cpu()
        return (host.float() if host.is_floating_point() else host).numpy()
    return np.asarray(value)


def first_outside(
    values: torch.Tensor | np.ndarray, *, low: int, high: int
) -> tuple[int, ...] | None:
    """Index of the first element of ``values`` outside ``[low, high)`` (row-major), or None.

    Validators name that element (row, column, value) in their error; tensors are read
    through ``host_array``.
    """
    array = host_array(values)
    bad = np.flatnonzero((array < low) | (array >= high))
    if bad.size == 0:
        return None
    return tuple(int(i) for i in np.unravel_index(int(bad[0]), array.shape))
