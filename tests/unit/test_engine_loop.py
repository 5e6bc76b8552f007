"""The engine loop's failure path keeps every failure: a failing ``abort_all`` is logged and
noted on the engine's error, never swallowed."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from llmrt.server.engine_loop import EngineLoop


class BrokenEngine:
    """An engine whose ``abort_all`` fails too (the loop only calls that here, and reads its
    scheduler's slots when built)."""

    scheduler = SimpleNamespace(config=SimpleNamespace(capacity=4, max_num_seqs=4))

    def abort_all(self) -> None:
        raise OSError("device gone while aborting")


def test_a_failing_abort_all_is_logged_and_noted_on_the_engine_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[BaseException] = []
    engine: Any = BrokenEngine()
    loop = EngineLoop(engine=engine, max_waiting=1, on_failure=seen.append)
    failure = RuntimeError("the engine step failed")
    with caplog.at_level(logging.WARNING, logger="llmrt.server"):
        loop._fail(failure)
    assert seen == [failure]
    assert any("device gone while aborting" in note for note in failure.__notes__)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "abort_all failed" in caplog.records[0].getMessage()
