"""Kernel outputs computed in a fresh process at a forced instruction-set level, for tests
that state two levels' loops give the same bits (integer sums in both)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from llmrt.device.cpu_features import ISA_VARIABLE, forceable_levels, read_cpu_features


def products_at(level: str | None, *, code: str, path: Path) -> dict[Any, Any]:
    """Run ``code`` (it saves a dict of tensors with ``torch.save(out, sys.argv[1])``) at
    ``level`` (None: the CPU's own) and return what it saved."""
    import torch

    env = {k: v for k, v in os.environ.items() if k != ISA_VARIABLE}
    if level is not None:
        env[ISA_VARIABLE] = level
    prelude = "import llmrt.kernels.native as n; n.load_kernels()\n"
    done = subprocess.run(
        [sys.executable, "-c", prelude + code, str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    saved: dict[Any, Any] = torch.load(path)
    return saved


def assert_same_bits(level: str | None, other: str, *, code: str, directory: Path) -> None:
    """``code``'s tensors at ``level`` (None: the CPU's own) equal, bit for bit, those at
    ``other``."""
    import torch

    first = products_at(level, code=code, path=directory / f"{level or 'native'}.pt")
    second = products_at(other, code=code, path=directory / f"{other}.pt")
    assert first.keys() == second.keys()
    for key, value in first.items():
        assert torch.equal(value, second[key]), key


def has_level(level: str) -> bool:
    """Whether this CPU runs ``level`` (its own or one it can be forced to)."""
    return level in forceable_levels(read_cpu_features())
