"""Fixtures shared by every test directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmrt.lifecycle.events import reset_logging

#: ``pytester`` runs inline test files (the plugin's own tests use it).
pytest_plugins = ("pytester",)


@pytest.fixture(autouse=True)
def _isolated_logging() -> Iterator[None]:
    """Each test starts and ends with structlog's defaults (and no open audit file)."""
    reset_logging()
    yield
    reset_logging()


@pytest.fixture
def inductor_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private inductor cache for one test; the process-wide setting is restored after."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    from llmrt.runtime.compiled_step import INDUCTOR_CACHE_ENV

    cache = tmp_path / "inductor"
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, str(cache))
    with temporary_cache_dir(str(cache)):
        yield cache
