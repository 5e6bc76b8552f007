"""Progress bars: on a terminal (or forced), never in a pipe or when asked to be quiet; and
the long steps (GGUF loading, the weight cache, compiling) report through them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import llmrt.lifecycle.progress as progress_module
from llmrt.cli.main import main
from llmrt.lifecycle.progress import progress, progress_step


def slow(n: int) -> list[int]:
    return list(progress((time.sleep(0.25) or i for i in range(n)), desc="slow work", total=n))


def test_a_forced_bar_shows_a_step_past_its_delay(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMRT_PROGRESS", "1")
    assert slow(4) == [0, 1, 2, 3]
    err = capsys.readouterr().err
    assert "slow work" in err and ("3/4" in err or "4/4" in err)
    with progress_step("one long call"):
        pass
    assert "one long call..." in capsys.readouterr().err


def test_quick_steps_show_nothing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMRT_PROGRESS", "1")
    assert list(progress(range(3), desc="quick")) == [0, 1, 2]
    assert "quick" not in capsys.readouterr().err


@pytest.mark.parametrize("setting", ["0", None])
def test_quiet_when_asked_or_not_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, setting: str | None
) -> None:
    """``0`` hides bars; unset, they follow the terminal (pytest's stderr is none)."""
    if setting is None:
        monkeypatch.delenv("LLMRT_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("LLMRT_PROGRESS", setting)
    assert slow(3) == [0, 1, 2]
    with progress_step("one long call"):
        pass
    assert capsys.readouterr().err == ""


def test_an_explicit_warning_log_level_silences_bars(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMRT_PROGRESS", raising=False)
    main(["generate", "tiny-llama", "--prompt", "x", "--max-new-tokens", "1", "--json"])
    assert progress_module.progress_setting() is None  # the default level keeps bars
    main(["generate", "tiny-llama", "--prompt", "x", "--max-new-tokens", "1", "--log-level",
          "warning", "--json"])  # fmt: skip
    assert progress_module.progress_setting() is False


def test_loading_caching_and_compiling_report_progress(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    from model_files import tiny_llama, train_bpe, write_llama_gguf

    from llmrt.serving.llm import LLM

    monkeypatch.setenv("LLMRT_PROGRESS", "1")
    monkeypatch.setenv("LLMRT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(progress_module, "DELAY_S", 0.0)
    bpe = train_bpe()
    path = write_llama_gguf(tmp_path / "p.gguf", tiny_llama(bpe.get_vocab_size()), bpe)
    overrides = ["decode.lane_capacity=2", "kv_cache.num_blocks=16"]
    with LLM(model=str(path), overrides=overrides):
        pass
    err = capsys.readouterr().err
    for step in (
        "dequantizing p.gguf",
        "writing the weight cache",
        "building the llama model (float32 weights)",
        "compiling decode",
        "compiling prefill",
    ):
        assert step in err, step


def test_the_kernel_build_shows_it_is_alive_on_a_terminal_only(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Building the CPU kernels takes minutes on a first run: a forced bar names the step and
    counts its seconds while the compiler runs; quiet (``0``) shows nothing."""
    from torch.utils import cpp_extension

    from llmrt.kernels import native

    compiled = []
    monkeypatch.setattr(progress_module, "TICK_S", 0.05)
    monkeypatch.setattr(
        cpp_extension, "load", lambda **kwargs: compiled.append(kwargs) or time.sleep(0.3)
    )
    monkeypatch.setenv("LLMRT_PROGRESS", "1")
    native._build(tmp_path / "build")
    err = capsys.readouterr().err
    assert "building llmrt's CPU kernels" in err and "00:00" in err
    assert err.count("building llmrt's CPU kernels") >= 3  # redrawn while it ran
    monkeypatch.setenv("LLMRT_PROGRESS", "0")
    native._build(tmp_path / "build")
    assert capsys.readouterr().err == ""
    assert [kwargs["build_directory"] for kwargs in compiled] == [str(tmp_path / "build")] * 2
