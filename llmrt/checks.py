"""Input checks shared by the runtime's request validators."""

from __future__ import annotations

import numpy as np
import torch


def first_outside(
    values: torch.Tensor | np.ndarray, *, low: int, high: int
) -> tuple[int, ...] | None:
    """Index of the first element of ``values`` outside ``[low, high)`` (row-major), or None.

    Validators name that element (row, column, value) in their error. Host tensors are
    checked through a numpy view: a few array ops at ~1 us each instead of ~4 us as torch
    ops, which a 6 ms decode step notices.
    """
    array = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else values
    bad = np.flatnonzero((array < low) | (array >= high))
    if bad.size == 0:
        return None
    return tuple(int(i) for i in np.unravel_index(int(bad[0]), array.shape))
