"""Parity tests use the harness from ``llmrt.testing.parity`` (shared with ``llmrt check``)
through the pytest plugin's ``parity_harness`` fixture; this module re-exports its pieces
for the tests that drive a model by hand."""

from __future__ import annotations

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
