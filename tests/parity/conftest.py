"""Parity fixtures: the harness lives in ``llmrt.testing.parity`` (shared with the pytest
plugin and ``llmrt check``); this module re-exports it for the parity tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from llmrt.families.base import Family
from llmrt.families.layers import select_linear_kernel
from llmrt.testing.parity import (  # noqa: F401 (re-exported for the parity tests)
    BLOCK_SIZE,
    LOGIT_TOL,
    NUM_BLOCKS,
    STEPS,
    BlockPool,
    Harness,
    PagedKV,
    Reference,
    Run,
    allocate_kv,
    hf_greedy,
    page_table,
)

HarnessFactory = Callable[..., Harness]


@pytest.fixture(scope="module")
def make_harness() -> HarnessFactory:
    """Build an llmrt model from an HF model's ``state_dict`` + ``config.to_dict()``.

    The linear layers use the kernel a recipe's ``device.linear: auto`` picks (oneDNN on
    CPU where torch has it), so parity covers the serving path.
    """

    def make(*, family: Family, hf_model: Any, seed: int = 0) -> Harness:
        hf_model.eval()
        model = family.build(
            hf_config=hf_model.config.to_dict(),
            tensors=hf_model.state_dict(),
            dtype=torch.float32,
            device="cpu",
        )
        select_linear_kernel(
            model, choice="auto", device=torch.device("cpu"), dtype=torch.float32
        )
        return Harness(
            hf_model=hf_model, model=model, vocab_size=model.config.vocab_size, seed=seed
        )

    return make
