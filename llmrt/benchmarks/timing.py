"""Timing helpers: interleaved timings of several calls, percentiles, progress bars."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import numpy as np
import torch
from tqdm import tqdm

T = TypeVar("T")


@attrs.frozen(kw_only=True)
class Timed:
    """One measured call; ``after`` runs untimed after it (cache cropping, resets)."""

    run: Callable[[], object]
    after: Callable[[], object] | None = None


def progress(items: Iterable[T], *, desc: str, total: int | None = None) -> Iterable[T]:
    """A tqdm bar on stderr (hidden when stderr is not a terminal)."""
    return tqdm(items, desc=desc, total=total, file=sys.stderr, leave=False, disable=None)


def device_sync(device: torch.device) -> Callable[[], None]:
    """A function that waits for ``device``'s queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


@attrs.frozen(kw_only=True)
class Timings:
    """Seconds per call: the ``median`` (what ratios use) and the ``minimum`` (the least
    disturbed sample, telling on a machine shared with other work)."""

    median: dict[str, float]
    minimum: dict[str, float]


def interleaved_times(
    calls: Mapping[str, Timed],
    *,
    warmup: int,
    repeats: int,
    sync: Callable[[], None],
    desc: str,
) -> Timings:
    """Time every call ``repeats`` times, alternating calls so drifting load hits all."""
    for _ in range(warmup):
        for call in calls.values():
            call.run()
            sync()
            if call.after is not None:
                call.after()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in progress(range(repeats), desc=desc):
        for name, call in calls.items():
            start = time.perf_counter()
            call.run()
            sync()
            samples[name].append(time.perf_counter() - start)
            if call.after is not None:
                call.after()
    return Timings(
        median={name: statistics.median(values) for name, values in samples.items()},
        minimum={name: min(values) for name, values in samples.items()},
    )


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (linear interpolation); NaN for no values."""
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def mean(values: Sequence[float]) -> float:
    return float(statistics.fmean(values)) if values else float("nan")


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``; NaN when the denominator is not positive."""
    return numerator / denominator if denominator > 0 else float("nan")


def rounded(values: Mapping[str, Any], digits: int = 6) -> dict[str, Any]:
    """Floats cut to ``digits`` significant digits for the report (others unchanged)."""
    return {k: float(f"{v:.{digits}g}") if isinstance(v, float) else v for k, v in values.items()}
