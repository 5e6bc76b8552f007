"""Parity checks every family module runs against transformers.

A family's test module defines a ``harness`` fixture (one per HF case, built on the plugin's
``torch_device``: cpu, and cuda where a GPU is present) and imports the ``test_*`` functions
below, so pytest runs each of them in that module over its cases and devices.
"""

from __future__ import annotations

from typing import Any

import pytest

from llmrt.testing.parity import perturb  # noqa: F401 (re-exported for the family tests)


def test_single_prompt(harness: Any) -> None:
    harness.check_single_prompt()


def test_ragged_batch_with_padding_row_and_ragged_decode_positions(harness: Any) -> None:
    harness.check_ragged_batch()


def test_chunked_prefill(harness: Any) -> None:
    harness.check_chunked_prefill()


def test_cached_prefix_continuation_next_to_fresh_row(
    harness: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness.check_cached_prefix(monkeypatch)


def test_shared_prefix_blocks(harness: Any) -> None:
    harness.check_shared_prefix_blocks()


def test_padding_writes_nothing_outside_owned_slots(harness: Any) -> None:
    harness.check_padding_writes_nothing()


def test_capture_safe_path_without_host_syncs(
    harness: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness.check_capture_safe(monkeypatch)
