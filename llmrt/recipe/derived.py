"""Recipes derived from a model: ``-m SOURCE`` with no recipe, or a recipe whose checkpoint
``-m`` replaces.

A derived recipe is a bundled template (``gguf`` for a GGUF file, ``hf`` for a Hugging Face
directory) plus overrides naming the model: its path, its name (the id it is served under)
and, for a GGUF without blocks the CPU kernels run, float32 weights. It is returned as
``(recipe name, overrides)`` so it travels as text (``llmrt bench`` hands both to the
processes it starts) and ``llmrt recipes show -m SOURCE`` prints it whole.
"""

from __future__ import annotations

from llmrt.errors import ConfigError
from llmrt.recipe.loader import derived_recipe_args, quoted, recipe_data
from llmrt.weights.model_source import resolve_model_source


def model_recipe_args(
    model: str,
    *,
    recipe: str | None,
    gguf_file: str | None = None,
    download: bool = False,
) -> tuple[str, list[str]]:
    """``(recipe, overrides)`` for ``-m MODEL`` with or without a recipe.

    Without one the recipe is derived; with one, ``-m`` replaces its checkpoint (format,
    path; a ``gguf-native`` recipe given a directory computes in its dtype) and its name.
    """
    source = resolve_model_source(model, field="--model", gguf_file=gguf_file, download=download)
    if recipe is None:
        return derived_recipe_args(source)
    data = recipe_data(recipe)
    checkpoint = data.get("checkpoint")
    checkpoint = checkpoint if isinstance(checkpoint, dict) else {}
    if checkpoint.get("format") == "random":
        raise ConfigError(
            "--model",
            model,
            f"recipe {recipe} draws random weights shaped by its model: section; -m replaces "
            "the checkpoint of a gguf or safetensors recipe (or give no recipe)",
        )
    overrides = [
        f"name={quoted(source.name)}",
        f"checkpoint.format={source.kind}",
        f"checkpoint.path={quoted(str(source.path))}",
        "checkpoint.package=null",
        "checkpoint.file=null",
    ]
    if checkpoint.get("weights") == "gguf-native" and source.kind != "gguf":
        overrides.append("checkpoint.weights=null")
    return recipe, overrides
