"""The distribution exposes llmrt.containers and llmrt.recipes, and lists every package."""

from __future__ import annotations

import importlib
import pathlib

import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_package_directory_is_listed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "llmrt").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert on_disk <= listed, f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"
    assert {"llmrt.containers", "llmrt.recipes"} <= listed


def test_mapped_packages_import() -> None:
    containers = importlib.import_module("llmrt.containers")
    recipes = importlib.import_module("llmrt.recipes")
    assert pathlib.Path(containers.__file__).parent.name == "containers"
    assert pathlib.Path(recipes.__file__).parent.name == "recipes"
