"""``smollm2-135m-compiled`` in two fresh processes over one cache: the first traces,
compiles and saves its decode step; the second loads it without a Dynamo trace and
generates the same greedy tokens (minutes: a cold inductor compile of 30 layers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import NEEDS_SMOLLM2

pytestmark = [*NEEDS_SMOLLM2, pytest.mark.slow]

_SCRIPT = textwrap.dedent(
    """
    import json
    from structlog.testing import capture_logs
    from torch._dynamo.utils import counters
    from llmrt import LLM, SamplingParams

    with capture_logs() as logs, LLM.from_recipe("smollm2-135m-compiled") as llm:
        (out,) = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
        stats = llm.container.lanes()[0].program_compiler().borrowed_step_compiler.stats()
    print(json.dumps({
        "tokens": list(out.token_ids),
        "graphs": stats.graphs,
        "recompilations": stats.recompilations,
        "events": [e["event"] for e in logs],
        "dynamo_graphs": counters["stats"]["unique_graphs"],
    }))
    """
)


def test_a_warm_start_loads_the_decode_step_instead_of_tracing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["LLMRT_CACHE_DIR"] = str(tmp_path)

    def start() -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    cold = start()
    assert cold["graphs"] >= 1 and cold["dynamo_graphs"] >= 1 and cold["recompilations"] == 0
    assert "program.artifact_saved" in cold["events"]
    warm = start()
    assert warm["graphs"] == 0 and warm["dynamo_graphs"] == 0 and warm["recompilations"] == 0
    assert warm["events"].count("program.artifact_loaded") == cold["events"].count(
        "program.artifact_saved"
    )
    assert "program.artifact_rejected" not in warm["events"]
    assert warm["tokens"] == cold["tokens"]
