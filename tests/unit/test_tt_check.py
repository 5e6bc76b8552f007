"""``scripts/tt_check.sh`` without a Tenstorrent device: its commands are ones llmrt accepts.

The script is meant for a person with a TT machine; here its ``--dry-run`` commands are
parsed with llmrt's own CLI parser (and bench settings), the recipes they build are
validated as ttnn recipes on the real module, the pytest step names an existing test file
whose ``-k`` selects its tests, and the vLLM smoke's overrides load.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from llmrt.benchmarks.settings import BenchSettings
from llmrt.cli.main import build_parser
from llmrt.recipe.loader import load_recipe

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "tt_check.sh"


def _steps() -> list[list[str]]:
    done = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, check=True, timeout=30
    )
    steps = []
    for line in done.stdout.splitlines():
        assert line.startswith("+ timeout "), line
        words = shlex.split(line[2:])
        assert int(words[1]) > 0
        steps.append(words[2:])
    return steps


def _env(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    env: dict[str, str] = {}
    if argv[0] == "env":
        argv = argv[1:]
        while "=" in argv[0]:
            key, _, value = argv.pop(0).partition("=")
            env[key] = value
    return env, argv


def _ttnn_recipe(name: str, overrides: list[str]) -> None:
    recipe = load_recipe(name, overrides=overrides)
    assert recipe.device.backend == "ttnn" and recipe.device.ttnn.module == "ttnn"


def test_five_steps_parity_answer_decode_bench_mixed_bench_vllm() -> None:
    steps = _steps()
    assert len(steps) == 5
    env, parity = _env(steps[0])
    assert env == {"LLMRT_TTNN_MODULE": "ttnn"}
    assert parity[0] == "pytest" and (ROOT / parity[-1]).is_file()
    assert "1x1" in parity[parity.index("-k") + 1]

    generate = steps[1]
    args = build_parser().parse_args(generate[1:])
    assert args.command == "generate" and "capital of France" in args.chat
    _ttnn_recipe(args.recipe, list(args.overrides))

    workloads = []
    for argv in steps[2:4]:
        assert argv[:2] == ["llmrt", "bench"], argv
        settings = BenchSettings.from_args(build_parser().parse_args(argv[1:]))
        _ttnn_recipe(settings.recipe, list(settings.overrides))
        workloads.append(settings.workload)
        assert settings.as_json
    assert workloads == ["decode", "mixed"]

    env, smoke = _env(steps[4])
    assert smoke[:2] == ["python", "scripts/vllm_smoke.py"] and (ROOT / smoke[1]).is_file()
    assert "llmrt" in env["VLLM_PLUGINS"].split(",")
    _ttnn_recipe(env["LLMRT_VLLM_RECIPE"], env["LLMRT_VLLM_OVERRIDES"].split())
