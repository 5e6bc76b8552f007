"""The torch devices device-generic tests run on: cpu always, ``cuda:0`` when a GPU is present.

Import with ``from device_params import TORCH_DEVICES`` (pytest puts ``tests/`` on
``sys.path``) and parametrize over it; the cuda case is marked ``cuda`` and skipped, with the
reason, where ``torch.cuda.is_available()`` is False. ``scripts/gpu_check.sh`` runs them
with ``-m cuda`` on a machine with an NVIDIA GPU.
"""

from __future__ import annotations

import pytest
import torch

NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False"

CUDA = pytest.param(
    "cuda:0",
    id="cuda",
    marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)],
)

TORCH_DEVICES = [pytest.param("cpu", id="cpu"), CUDA]
"""``torch_device`` strings to parametrize over."""
