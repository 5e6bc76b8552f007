"""docs/writing-a-family.md runs: its Python blocks execute in order, its recipe validates,
``llmrt check`` passes on it and its plugin test passes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "writing-a-family.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", GUIDE.read_text(encoding="utf-8"), re.S)


def test_the_guide_example_runs_end_to_end(tmp_path: Path, parity_harness: Any) -> None:
    from llmrt.recipe.loader import load_recipe

    recipe_yaml, _ = _blocks("yaml")
    recipe_path = tmp_path / "tiny-qwen2-moe.yaml"
    recipe_path.write_text(recipe_yaml, encoding="utf-8")
    namespace: dict[str, Any] = {"RECIPE_PATH": str(recipe_path)}
    code = _blocks("python")
    assert len(code) == 4
    try:
        for block in code:
            exec(compile(block, str(GUIDE), "exec"), namespace)
        recipe = load_recipe(str(recipe_path))
        assert recipe.family == "my_qwen2_moe"
        namespace["test_qwen2_moe_matches_transformers"](parity_harness)
        _the_module_reads_a_save_pretrained_directory(namespace["QWEN2_MOE"], tmp_path / "dir")
        # Section 7's parts read the same directory (per-expert tensors stacked for them too).
        import yaml

        from llmrt.families.declared import declared_family, parse_parts

        parts = parse_parts(yaml.safe_load(_blocks("yaml")[1])["model"]["parts"])
        family = declared_family(parts, model_type="qwen2_moe")
        _the_module_reads_a_save_pretrained_directory(family, tmp_path / "dir2")
    finally:
        registration = namespace.get("registration")
        if registration is not None:
            registration.remove()
    from llmrt.families import registry

    assert "my_qwen2_moe" not in registry.family_names()


def _the_module_reads_a_save_pretrained_directory(family: Any, directory: Path) -> None:
    """The guide's module, on what transformers' ``save_pretrained`` writes (per-expert
    tensors), as the runtime loads it: ``llmrt check`` of the directory with that family."""
    from llmrt.cli.check import reference_model, run_check

    config = {
        "model_type": "qwen2_moe", "vocab_size": 128, "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 80, "num_experts": 4, "num_experts_per_tok": 2,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }  # fmt: skip
    reference_model(config=config).save_pretrained(directory)
    report = run_check(
        family=family,
        hf_model=reference_model(directory=directory),
        source=str(directory),
        directory=directory,
        steps=4,
    )
    assert report.ok, report.table()


def test_the_guide_recipe_is_rejected_without_its_family(tmp_path: Path) -> None:
    """Validation happens before any weight: an unregistered family is named."""
    from llmrt.errors import RecipeError
    from llmrt.recipe.loader import load_recipe

    recipe_yaml, _ = _blocks("yaml")
    path = tmp_path / "r.yaml"
    path.write_text(recipe_yaml, encoding="utf-8")
    with pytest.raises(RecipeError, match=r"^family: is not a registered model family"):
        load_recipe(str(path))


def test_the_guide_parts_recipe_needs_no_family_and_passes_check(tmp_path: Path) -> None:
    """Section 7: the same Qwen2-MoE declared in the recipe, with no family registered,
    validates and matches transformers under ``llmrt check``."""
    from llmrt.cli.check import check_target
    from llmrt.families import registry
    from llmrt.recipe.loader import load_recipe

    _, parts_yaml = _blocks("yaml")
    path = tmp_path / "tiny-qwen2-moe-parts.yaml"
    path.write_text(parts_yaml, encoding="utf-8")
    assert "my_qwen2_moe" not in registry.family_names()
    assert load_recipe(str(path)).declared_parts is not None
    report = check_target(str(path), steps=4)
    assert report.ok, report.table()
    assert report.family == "parts"
