"""Library use configures nothing: info events stay silent, warnings reach stderr only."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import logging, structlog
    before = (list(logging.getLogger().handlers), logging.getLogger("llmrt").handlers[:])
    import llmrt
    from llmrt import LLM
    assert not structlog.is_configured(), "import llmrt configured structlog"
    assert (list(logging.getLogger().handlers), logging.getLogger("llmrt").handlers[:]) == before
    with LLM.from_recipe("tiny-llama") as llm:
        out = llm.generate("hi", llmrt.SamplingParams(temperature=0.0, max_tokens=2))
    assert not structlog.is_configured(), "building an LLM configured structlog"
    from llmrt.lifecycle.events import component_logger, emit
    emit(component_logger("scope", lane=0), "cleanup.failed", step="probe", error="boom")
    emit(component_logger("scope", lane=0), "kv.allocated", layers=2)
    """
)


def test_library_use_prints_no_info_events_and_warnings_go_to_stderr() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert lines == ["cleanup.failed component=scope lane=0 step=probe error=boom"]
