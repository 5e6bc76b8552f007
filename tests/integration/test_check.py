"""``llmrt check``: passes on a correct family, fails (exit 1) on a deliberately broken part."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import yaml

from llmrt.cli.check import SMALL_VOCAB, small_config
from llmrt.cli.main import main
from llmrt.families import llama, mistral, registry
from llmrt.families.hfconfig import HFConfig


def _gelu_instead_of_silu(cfg: HFConfig, dtype: torch.dtype) -> Any:
    """A family author's slip: the MLP activation mapped to GELU for a SwiGLU model."""
    spec, names = llama.read(cfg, dtype)
    assert spec.mlp is not None
    return attrs.evolve(spec, mlp=attrs.evolve(spec.mlp, activation="gelu")), names


BROKEN = attrs.evolve(llama.FAMILY, name="broken_llama", read=_gelu_instead_of_silu)
RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _theta_ten_thousand(cfg: HFConfig, dtype: torch.dtype) -> Any:
    """A family author's slip: RoPE's base read as 10000 when the config gives none, where
    transformers' Mixtral defaults to 1e6 (what the shipped family once did)."""
    spec, names = mistral.read(cfg, dtype)
    if "rope_theta" not in cfg.raw and "rope_parameters" not in cfg.raw:
        spec = attrs.evolve(spec, ropes=(attrs.evolve(spec.ropes[0], theta=10000.0),))
    return spec, names


WRONG_DEFAULT = attrs.evolve(mistral.FAMILY, name="wrong_default", read=_theta_ten_thousand)


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


def _mixtral_recipe(tmp_path: Path) -> Path:
    """tiny-llama's recipe over a Mixtral config that leaves ``rope_theta`` to its default."""
    recipe = yaml.safe_load((RECIPES / "tiny-llama.yaml").read_text())
    recipe.update(name="tiny-mixtral", family="auto")
    recipe["model"] = {
        "model_type": "mixtral",
        "vocab_size": 258,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "max_position_embeddings": 512,
    }
    path = tmp_path / "tiny-mixtral.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_check_fails_a_family_that_reads_a_default_differently(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The llmrt side reads the recipe's raw config as the runtime does, so a family that
    fills in a default transformers fills differently fails, and the shipped one passes."""
    recipe = str(_mixtral_recipe(tmp_path))
    with registry.register(WRONG_DEFAULT):
        status = main(["check", recipe, "--set", "family=wrong_default", "--steps", "4"])
    out = capsys.readouterr().out
    assert status == 1, out
    assert out.rstrip().endswith("FAILED") and "family wrong_default" in out
    assert main(["check", recipe, "--steps", "4"]) == 0
    assert "family mistral" in capsys.readouterr().out


def test_check_wraps_token_ids_into_the_shrunk_vocabulary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A full-size vocabulary shrinks, and pad/bos/eos ids past it are wrapped into it
    (transformers refuses a padding id outside the embedding)."""
    recipe = yaml.safe_load((RECIPES / "tiny-llama.yaml").read_text())
    recipe["model"].update(
        vocab_size=49152, pad_token_id=49151, bos_token_id=1, eos_token_id=[2, 49150]
    )
    recipe["tokenizer"] = {"source": "byte"}
    path = tmp_path / "big-vocab.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["check", str(path), "--steps", "4"]) == 0, capsys.readouterr()
    config = small_config(recipe["model"])
    assert config["vocab_size"] == SMALL_VOCAB
    assert config["pad_token_id"] < SMALL_VOCAB and config["bos_token_id"] == 1
    assert all(i < SMALL_VOCAB for i in config["eos_token_id"])


def test_validate_resolves_a_directory_model_type(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``recipes validate`` on a checkpoint directory names the family its ``model_type``
    resolves to, and fails naming a ``model_type`` no family handles."""
    recipe = yaml.safe_load((RECIPES / "tiny-llama.yaml").read_text())
    recipe.update(family="auto", checkpoint={"format": "safetensors", "path": str(tmp_path)})
    recipe.pop("model")
    recipe["tokenizer"] = {"source": "checkpoint"}
    path = tmp_path / "dir.yaml"
    path.write_text(yaml.safe_dump(recipe))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert main(["recipes", "validate", str(path)]) == 0
    assert "family qwen2, model_type qwen2" in capsys.readouterr().out
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_arch"}))
    assert main(["recipes", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "no_such_arch" in err and "no installed family handles" in err


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
    assert "family qwen3" in capsys.readouterr().out
