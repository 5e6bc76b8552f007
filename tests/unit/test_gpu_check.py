"""``scripts/gpu_check.sh`` on a machine without a GPU: its commands are ones llmrt accepts.

The script is meant for a person with one NVIDIA GPU; here its ``--dry-run`` commands are
parsed with llmrt's own CLI parser and bench settings, and the recipes they build are
validated, so a flag or override the CLI lacks fails here rather than on their GPU.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from llmrt.benchmarks.settings import BenchSettings
from llmrt.cli.main import build_parser
from llmrt.recipe.loader import load_recipe

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"
FIVE_MINUTES = 300


def _steps() -> list[tuple[int, list[str]]]:
    done = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, check=True, timeout=30
    )
    steps = []
    for line in done.stdout.splitlines():
        assert line.startswith("+ timeout "), line
        words = shlex.split(line[2:])
        steps.append((int(words[1]), words[2:]))
    return steps


def test_the_steps_fit_in_five_minutes_and_run_the_cuda_tests_first() -> None:
    steps = _steps()
    assert sum(budget for budget, _ in steps) <= FIVE_MINUTES - 10  # the device probe
    _, tests = steps[0]
    assert tests[0] == "pytest" and tests[-1] == "tests"
    assert tests[tests.index("-m") + 1] == "cuda"


def test_bench_commands_parse_and_build_valid_cuda_recipes() -> None:
    benches = [argv for _, argv in _steps() if argv[0] == "llmrt"]
    decode_batches = set()
    workloads = []
    for argv in benches:
        assert argv[1] == "bench", argv
        args = build_parser().parse_args(argv[1:])
        settings = BenchSettings.from_args(args)
        recipe = load_recipe(settings.recipe, overrides=list(settings.overrides))
        assert recipe.device.kind == "cuda" and recipe.device.torch_device == "cuda:0"
        assert recipe.checkpoint.weights in ("float32", "bfloat16"), "CPU-only GGUF kernels"
        assert settings.as_json
        workloads.append(settings.workload)
        if settings.workload == "decode":
            assert recipe.trace.mode in ("decode_only", "all"), "traced/eager needs traces"
            cap = recipe.decode.lane_capacity
            assert max(recipe.warmup.prefill_batch_sizes) <= cap
            decode_batches.add(cap)
        if settings.workload == "mixed":
            assert settings.baseline == "hf"
    assert decode_batches == {1, 16}
    assert workloads.count("mixed") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message when CUDA is missing")
def test_without_a_gpu_the_script_says_so_and_fails(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "GPU_CHECK_OUT": str(tmp_path / "out")},
    )
    assert done.returncode == 2, done.stderr
    assert "no CUDA device" in done.stderr
    assert not (tmp_path / "out").exists(), "nothing runs without a GPU"
