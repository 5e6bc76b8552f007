"""Fixtures shared by every test directory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llmrt.lifecycle import reset_logging

#: ``pytester`` runs inline test files (the plugin's own tests use it).
pytest_plugins = ("pytester",)


@pytest.fixture(autouse=True)
def _isolated_logging() -> Iterator[None]:
    """Each test starts and ends with structlog's defaults (and no open audit file)."""
    reset_logging()
    yield
    reset_logging()
