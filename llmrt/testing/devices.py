"""The torch devices a device-generic test runs on: ``cpu`` always, ``cuda:0`` where a GPU is.

The pytest plugin's ``torch_device`` fixture is parametrized over ``TORCH_DEVICES``: every test
that asks for it runs once per device, the cuda case carrying the ``cuda`` marker (so
``pytest -m cuda`` selects exactly the CUDA variants, as ``scripts/gpu_check.sh`` does) and
skipped with ``NO_CUDA`` as the reason where no GPU is present. A test that only makes sense on
a GPU uses ``requires_cuda``. Nothing here imports torch at module load: the plugin imports
this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest

NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False"

#: ``torch_device`` strings to run device-generic tests on (ids ``cpu`` and ``cuda``).
TORCH_DEVICES = (
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda:0", id="cuda", marks=pytest.mark.cuda),
)

_F = TypeVar("_F", bound=Callable[..., object])


def missing_device(device: str) -> str | None:
    """Why ``device`` cannot run here (a CUDA device torch does not see), or None."""
    import torch

    placed = torch.device(device)
    if placed.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return NO_CUDA
    if placed.index is not None and placed.index >= torch.cuda.device_count():
        return f"needs {placed}: torch sees {torch.cuda.device_count()} CUDA device(s)"
    return None


def require_device(device: str) -> str:
    """``device``, or skip the running test with the reason it cannot run here."""
    reason = missing_device(device)
    if reason is not None:
        pytest.skip(reason)
    return device


def recipe_overrides(device: str) -> dict[str, Any]:
    """Recipe overrides placing a torch recipe on ``device`` (none for ``cpu``, the bundled
    recipes' own device)."""
    import torch

    placed = torch.device(device)
    if placed.type == "cpu":
        return {}
    return {"device.kind": placed.type, "device.index": placed.index or 0}


def requires_cuda(test: _F) -> _F:
    """Mark a GPU-only test ``cuda`` and skip it, with the reason, where no GPU is present."""
    reason = missing_device("cuda:0")
    skip = pytest.mark.skipif(reason is not None, reason=reason or "")
    marked: _F = pytest.mark.cuda(skip(test))
    return marked
