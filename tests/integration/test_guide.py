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
        assert recipe.family == "qwen2_moe"
        namespace["test_qwen2_moe_matches_transformers"](parity_harness)
    finally:
        registration = namespace.get("registration")
        if registration is not None:
            registration.remove()
    from llmrt.families import registry

    assert "qwen2_moe" not in registry.family_names()


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
    assert "qwen2_moe" not in registry.model_types()
    assert load_recipe(str(path)).declared_parts is not None
    report = check_target(str(path), steps=4)
    assert report.ok, report.table()
    assert report.family == "parts"
