"""Progress bars (tqdm, on stderr) for the steps that can take seconds: loading and
dequantizing weights, repacking them, writing the weight cache, compiling warmup programs.

Bars show only on a terminal, so logs piped to a file stay clean; a bar over items shows
once its step has run ``DELAY_S`` (quick loops print nothing), a one-call step
(``progress_step``) shows its description while the call runs. ``LLMRT_PROGRESS``
overrides: ``0`` hides every bar (the CLI sets it for an explicit ``--log-level warning`` or
``error``), ``1`` shows them even without a terminal. Bars are removed when their step ends.
A one-call step counts its elapsed seconds while it runs (a minutes-long compile of the CPU
kernels shows it is alive).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

ENV = "LLMRT_PROGRESS"
DELAY_S = 0.5
#: How often a one-call step redraws its elapsed time.
TICK_S = 1.0
_OFF = frozenset({"0", "off", "false", "no"})
_ON = frozenset({"1", "on", "true", "yes"})

T = TypeVar("T")


def progress_setting() -> bool | None:
    """``LLMRT_PROGRESS`` read now: False hides, True forces, None shows on a terminal."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    return None


def progress(
    items: Iterable[T], *, desc: str, total: int | None = None, unit: str = "it"
) -> Iterator[T]:
    """``items``, with a bar counting them when the setting allows one."""
    setting = progress_setting()
    if setting is False:
        yield from items
        return
    bar = tqdm(
        items,
        desc=desc,
        total=total,
        unit=unit,
        delay=DELAY_S,
        disable=None if setting is None else False,
        leave=False,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    try:
        yield from bar
    finally:
        bar.close()


@contextlib.contextmanager
def progress_step(desc: str) -> Iterator[None]:
    """A one-step bar (its description and elapsed time, redrawn every ``TICK_S``) around a
    single long call, shown from the start when the setting allows one."""
    setting = progress_setting()
    if setting is False:
        yield
        return
    bar = tqdm(
        total=1,
        desc=desc,
        bar_format="{desc}... {elapsed}",
        disable=None if setting is None else False,
        leave=False,
        file=sys.stderr,
    )
    done = threading.Event()

    def tick() -> None:
        while not done.wait(TICK_S):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="llmrt-progress", daemon=True)
    if not bar.disable:
        ticker.start()
    try:
        yield
    finally:
        done.set()
        if ticker.is_alive():
            ticker.join()
        bar.close()
