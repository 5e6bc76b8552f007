"""Bench workloads that measure child processes: ``run_process`` and ``oneshot`` wiring.

Cheap stand-in commands keep these fast; the real ``llmrt generate`` command line is
checked for its shape (the CLI tests run it)."""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import pytest

from llmrt.benchmarks import oneshot as oneshot_module
from llmrt.benchmarks.processes import run_process
from llmrt.benchmarks.settings import BenchSettings
from llmrt.cli.bench import bench_report
from llmrt.errors import ConfigError

PY = sys.executable
FAKE_CLI = Path(__file__).resolve().parent.parent / "fakes" / "llama-bench"  # any executable


def test_peak_rss_is_the_childs_own() -> None:
    big = run_process([PY, "-c", "b = bytearray(300 << 20); b[::4096] = b'x' * len(b[::4096])"],
                      timeout_s=60)  # fmt: skip
    small = run_process([PY, "-c", "pass"], timeout_s=60)
    assert big.ok and small.ok
    assert big.peak_rss_bytes > (300 << 20)
    assert small.peak_rss_bytes < big.peak_rss_bytes - (200 << 20)  # not the max of all children
    assert small.wall_s > 0


def test_a_failing_or_hanging_child_is_reported() -> None:
    failed = run_process([PY, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"],
                         timeout_s=60)  # fmt: skip
    assert (failed.ok, failed.returncode, failed.stderr_tail) == (False, 3, "boom")
    hung = run_process([PY, "-c", "import time; time.sleep(30)"], timeout_s=0.5)
    assert hung.timed_out and not hung.ok and hung.wall_s < 20


def test_oneshot_commands_run_llmrt_generate_with_the_recipe_and_overrides() -> None:
    settings = BenchSettings(recipe="tiny-llama", workload="oneshot", overrides=("lanes=1",))
    commands = oneshot_module.oneshot_commands(settings)
    assert commands["import_torch"] == [PY, "-c", "import torch"]
    argv = commands["llmrt_generate"]
    assert argv[:5] == [PY, "-m", "llmrt.cli", "generate", "tiny-llama"]
    assert argv[argv.index("--max-new-tokens") + 1] == "16"
    assert argv[-2:] == ["--set", "lanes=1"]
    api = commands["llm_api"]  # the recipe as written, through LLM.from_recipe
    assert api[:4] == [PY, "-m", "llmrt.benchmarks.api_oneshot", "tiny-llama"]
    assert api[-2:] == ["16", "lanes=1"]


def test_the_api_oneshot_generates_through_llm_from_recipe(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from llmrt.benchmarks import api_oneshot
    from llmrt.serving import llm as llm_module

    seen: dict[str, object] = {}

    class FakeLLM:
        @classmethod
        def from_recipe(cls, recipe: str, *, overrides: list[str]) -> FakeLLM:
            seen.update(recipe=recipe, overrides=overrides)
            return cls()

        def __enter__(self) -> FakeLLM:
            return self

        def __exit__(self, *exc: object) -> None:
            seen["closed"] = True

        def generate(self, prompts: list[str], params: object) -> list[object]:
            seen.update(prompts=prompts, max_tokens=getattr(params, "max_tokens", None))
            return [type("Out", (), {"text": " Paris."})()]

    monkeypatch.setattr(llm_module, "LLM", FakeLLM)
    assert api_oneshot.main(["tiny-llama", "The capital", "5", "lanes=1"]) == 0
    assert capsys.readouterr().out == " Paris.\n"
    assert seen == {
        "recipe": "tiny-llama", "overrides": ["lanes=1"], "prompts": ["The capital"],
        "max_tokens": 5, "closed": True,
    }  # fmt: skip


def test_oneshot_reports_ratio_and_peak_rss(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = {
        "import_torch": [PY, "-c", "pass"],
        "llmrt_generate": [PY, "-c", "b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096])"],
    }
    monkeypatch.setattr(oneshot_module, "oneshot_commands", lambda settings, **kw: fake)
    report = bench_report(BenchSettings(recipe="tiny-llama", workload="oneshot", num_prompts=1))
    data = report.to_json()
    assert set(data["wall_s"]) == {
        "import_torch", "llmrt_generate", "import_torch_min", "llmrt_generate_min"
    }  # fmt: skip
    assert data["peak_rss_gb"]["llmrt_generate"] > 64 / 1024
    assert data["headline_ratio"] == pytest.approx(
        data["wall_s"]["llmrt_generate"] / data["wall_s"]["import_torch"], rel=1e-3
    )
    assert set(data["targets"]) == {"generate_peak_rss_gb", "generate_over_import_torch_wall"}
    assert "peak_rss_over_file" not in data  # tiny-llama is not a GGUF recipe


def test_oneshot_gives_each_peak_over_the_gguf_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * (32 << 20))
    fake = {
        "import_torch": [PY, "-c", "pass"],
        "llmrt_generate": [PY, "-c", "b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096])"],
        "llm_api": [PY, "-c", "b = bytearray(128 << 20); b[::4096] = b'x' * len(b[::4096])"],
    }
    monkeypatch.setattr(oneshot_module, "oneshot_commands", lambda settings, **kw: fake)
    monkeypatch.setattr(oneshot_module, "recipe_gguf", lambda recipe: model)
    report = bench_report(BenchSettings(recipe="tiny-llama", workload="oneshot", num_prompts=1))
    data = report.to_json()
    over = data["peak_rss_over_file"]
    size = model.stat().st_size / 1e9
    for name in ("llmrt_generate", "llm_api"):
        assert over[name] == pytest.approx(data["peak_rss_gb"][name] / size, rel=1e-2)
    assert over["llm_api"] > over["llmrt_generate"] + 1.5  # 64 MiB more over a 32 MiB file
    assert report.headline.startswith("llmrt generate / import torch wall: ")


def test_oneshot_names_a_failing_command(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = {"import_torch": [PY, "-c", "pass"], "llmrt_generate": [PY, "-c", "raise SystemExit(2)"]}
    monkeypatch.setattr(oneshot_module, "oneshot_commands", lambda settings, **kw: fake)
    with pytest.raises(ConfigError, match="oneshot llmrt_generate: exited 2"):
        bench_report(BenchSettings(recipe="tiny-llama", workload="oneshot", num_prompts=1))


def test_oneshot_adds_llama_cli_and_transformers_baselines_when_available(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    model = tmp_path / "m.gguf"
    monkeypatch.setattr(oneshot_module, "recipe_gguf", lambda recipe: model)
    monkeypatch.setenv("LLMRT_LLAMACPP_CLI", str(FAKE_CLI))
    settings = BenchSettings(recipe="tiny-llama", workload="oneshot", baseline="hf")
    assert oneshot_module.oneshot_model(settings) == model
    commands = oneshot_module.oneshot_commands(settings, model=model)
    cli = commands["llamacpp_cli"]
    assert cli[0] == str(FAKE_CLI) and cli[cli.index("-m") + 1] == str(model)
    assert cli[cli.index("-n") + 1] == "16" and "-st" in cli
    assert commands["hf_generate"][1:4] == ["-m", "llmrt.benchmarks.hf_oneshot", str(model)]
    monkeypatch.delenv("LLMRT_LLAMACPP_CLI")
    plain = oneshot_module.oneshot_commands(attrs.evolve(settings, baseline="none"), model=model)
    assert set(plain) == {"import_torch", "llmrt_generate", "llm_api"}
