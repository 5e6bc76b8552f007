"""``llmrt check``: passes on a correct family, fails (exit 1) on a deliberately broken part."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

from llmrt.cli.main import main
from llmrt.families import llama, registry
from llmrt.families.hfconfig import HFConfig


def _gelu_instead_of_silu(cfg: HFConfig, dtype: torch.dtype) -> Any:
    """A family author's slip: the MLP activation mapped to GELU for a SwiGLU model."""
    spec, names = llama.read(cfg, dtype)
    assert spec.mlp is not None
    return attrs.evolve(spec, mlp=attrs.evolve(spec.mlp, activation="gelu")), names


BROKEN = attrs.evolve(llama.FAMILY, name="broken_llama", read=_gelu_instead_of_silu)


def test_check_passes_for_a_correct_family(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "tiny-llama", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "chunked prefill" in out and "prefix-cached" in out
    assert out.rstrip().endswith("ok")


def test_check_fails_on_a_broken_part(capsys: pytest.CaptureFixture[str]) -> None:
    with registry.register(BROKEN):
        status = main(["check", "tiny-llama", "--set", "family=broken_llama", "--steps", "4"])
    out = capsys.readouterr().out
    assert status == 1, out
    assert out.rstrip().endswith("FAILED")
    assert "family broken_llama" in out


def test_check_a_hugging_face_directory(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``family: auto`` from a local directory saved by transformers (here Qwen3)."""
    from llmrt.cli.check import reference_model

    hf = reference_model(
        config={
            "model_type": "qwen3",
            "vocab_size": 128,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "max_position_embeddings": 128,
        }
    )
    hf.save_pretrained(tmp_path)
    assert main(["check", str(tmp_path), "--steps", "4"]) == 0
    assert "family llama" in capsys.readouterr().out
