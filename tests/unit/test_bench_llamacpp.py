"""The ``llamacpp`` bench workload's wiring, against stand-in llama.cpp binaries.

Real llama.cpp is never needed (nor built) here: ``tests/fakes`` holds a llama-bench that
prints fixed JSON rows and a llama-server answering /health and /completion with fixed
timings, so the ratios below are known in advance."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from llmrt.benchmarks import vs_llamacpp
from llmrt.benchmarks.llamacpp import BENCH_ENV, DIR_ENV, SERVER_ENV, LlamaCpp
from llmrt.benchmarks.settings import BenchSettings
from llmrt.cli.bench import bench_report
from llmrt.errors import ConfigError

FAKES = Path(__file__).resolve().parent.parent / "fakes"


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A tiny workload, and a stand-in GGUF path for the tiny (random-weight) recipe."""
    monkeypatch.setattr(vs_llamacpp, "ITL_NEW_TOKENS", 4)
    monkeypatch.setattr(vs_llamacpp, "PP_LEN", 24)
    monkeypatch.setattr(vs_llamacpp, "REPEATS", 1)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setattr(vs_llamacpp, "recipe_gguf", lambda recipe: model)
    for key in (DIR_ENV, BENCH_ENV, SERVER_ENV):
        monkeypatch.delenv(key, raising=False)
    return model


def _settings(**kw: object) -> BenchSettings:
    return BenchSettings(
        recipe="tiny-llama", workload="llamacpp", num_prompts=3, max_new_tokens=3, **kw
    )  # type: ignore[arg-type]


def test_locate_prefers_explicit_paths_then_env_then_the_directory(tmp_path: Path) -> None:
    found = LlamaCpp.locate(directory=str(FAKES), env={})
    assert (found.bench, found.server) == (FAKES / "llama-bench", FAKES / "llama-server")
    only_env = LlamaCpp.locate(env={BENCH_ENV: str(FAKES / "llama-bench")})
    assert (only_env.bench, only_env.server) == (FAKES / "llama-bench", None)
    assert LlamaCpp.locate(directory=str(tmp_path), env={}).bench is None
    with pytest.raises(ConfigError, match="--llama-server"):
        LlamaCpp.locate(server=str(tmp_path / "nope"), env={})


def test_without_llama_cpp_the_report_says_so(small: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vs_llamacpp.LlamaCpp, "locate", classmethod(
        lambda cls, **kw: cls()))  # fmt: skip
    report = bench_report(_settings())
    assert report.headline.startswith("llama.cpp baseline not available: no llama-bench")
    assert "--llamacpp-dir" in report.headline
    data = report.to_json()
    assert data["ratios"] == {} and data["headline_ratio"] is None
    assert data["llmrt"]["mixed_output_tokens_per_s"] > 0


def test_a_recipe_without_a_gguf_has_no_llama_cpp_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vs_llamacpp, "ITL_NEW_TOKENS", 2)
    monkeypatch.setattr(vs_llamacpp, "PP_LEN", 16)
    monkeypatch.setattr(vs_llamacpp, "REPEATS", 1)
    report = bench_report(_settings(llamacpp_dir=str(FAKES)))
    assert report.headline == (
        "llama.cpp baseline not available: the recipe's checkpoint is random, not a GGUF"
    )


def test_ratios_against_llama_bench_and_server(
    small: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pidfile = tmp_path / "server.pid"
    monkeypatch.setenv("FAKE_LLAMA_SERVER_PIDFILE", str(pidfile))
    report = bench_report(_settings(llamacpp_dir=str(FAKES)))
    data = report.to_json()
    ours, theirs = data["llmrt"], data["llamacpp"]
    assert theirs["single_stream_source"] == "llama-bench"
    assert theirs["itl_s"] == pytest.approx(1 / 50.0)  # the fake's tg rate
    assert theirs["pp_tokens_per_s"] == 400.0
    assert theirs["mixed_output_tokens"] == 3 * 3  # every prompt, max_new_tokens each
    assert theirs["model"] == str(small)
    ratios = data["ratios"]
    assert ratios["itl_llmrt_over_llamacpp"] == pytest.approx(
        ours["itl_s"] / theirs["itl_s"], rel=1e-3
    )
    assert ratios["pp_llmrt_over_llamacpp"] == pytest.approx(
        ours["pp_tokens_per_s"] / 400.0, rel=1e-3
    )
    assert data["headline_ratio"] == pytest.approx(
        ours["mixed_output_tokens_per_s"] / theirs["mixed_output_tokens_per_s"], rel=1e-3
    )
    assert set(data["targets"]) == set(ratios)
    assert report.headline.startswith("mixed output tokens/s llmrt/llama-server: ")
    _assert_stopped(int(pidfile.read_text()))


def test_server_timings_stand_in_for_llama_bench(small: Path, tmp_path: Path) -> None:
    report = bench_report(_settings(llamacpp_server=str(FAKES / "llama-server")))
    theirs = report.to_json()["llamacpp"]
    assert theirs["single_stream_source"] == "llama-server timings"
    assert (theirs["itl_s"], theirs["pp_tokens_per_s"]) == (0.02, 300.0)


def test_bench_alone_reports_single_stream_and_says_mixed_needs_the_server(small: Path) -> None:
    report = bench_report(_settings(llamacpp_bench=str(FAKES / "llama-bench")))
    data = report.to_json()
    assert set(data["ratios"]) == {"itl_llmrt_over_llamacpp", "pp_llmrt_over_llamacpp"}
    assert "needs llama-server" in report.headline


def _assert_stopped(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"the llama-server stand-in (pid {pid}) is still running")
