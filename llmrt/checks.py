"""Input checks shared by the runtime's request validators."""

from __future__ import annotations

import torch


def first_outside(values: torch.Tensor, *, low: int, high: int) -> tuple[int, ...] | None:
    """Index of the first element of ``values`` outside ``[low, high)`` (row-major), or None.

    Validators name that element (row, column, value) in their error.
    """
    bad = ((values < low) | (values >= high)).nonzero()
    return None if bad.numel() == 0 else tuple(int(i) for i in bad[0])
