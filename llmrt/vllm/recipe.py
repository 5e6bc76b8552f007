"""Which llmrt recipe serves the model vLLM was asked for.

vLLM hands a TT model class only the Hugging Face config (``hf_config``) and the model
name; llmrt runs recipes. :func:`select_recipe` bridges the two with an explicit table,
checked in this order:

1. ``LLMRT_VLLM_RECIPE`` (a bundled recipe name or a recipe file): always wins.
2. :data:`NAMED_RECIPES`: a checkpoint llmrt bundles a recipe for, by its Hub name.
3. :func:`architecture_recipes`: an architecture llmrt serves from a checkpoint directory:
   every architecture a registered family declares (``family.architectures``) with the
   ``hf`` recipe (``family: auto``), and :data:`ARCHITECTURE_RECIPES` where a recipe is
   named explicitly; the recipe's ``checkpoint.path`` is set to that directory. The
   directory is ``hf_config._name_or_path`` (vLLM's ``--model``) when it is one, else the
   Hub name's snapshot in the local Hugging Face cache (``HF_HUB_CACHE`` / ``HF_HOME``;
   never downloaded here: a name not cached is refused with the command that fetches it).

``LLMRT_VLLM_OVERRIDES`` adds recipe overrides (``--set`` syntax, whitespace separated,
shell quoting) to whichever recipe was chosen, e.g.
``LLMRT_VLLM_OVERRIDES="kv_cache.max_num_blocks=4096 device.backend=ttnn"``.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import attrs

from llmrt.errors import ConfigError
from llmrt.recipe.loader import Overrides, Recipe, load_recipe
from llmrt.weights.model_source import cached_snapshot, parse_hub_id

RECIPE_ENV = "LLMRT_VLLM_RECIPE"
OVERRIDES_ENV = "LLMRT_VLLM_OVERRIDES"

NAMED_RECIPES: Mapping[str, str] = MappingProxyType(
    {
        "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m",
    }
)
"""Hub model names with a bundled recipe (the recipe locates its own weights)."""

ARCHITECTURE_RECIPES: Mapping[str, str] = MappingProxyType(
    {
        "LlamaForCausalLM": "hf",
        "GPT2LMHeadModel": "hf",
    }
)
"""Architectures with an explicitly chosen recipe (beyond the registry's, which get ``hf``)."""
#: The recipe a registered family's architecture is served with (``family: auto``).
DIRECTORY_RECIPE = "hf"


def architecture_recipes() -> dict[str, str]:
    """Hugging Face architecture -> recipe for a local checkpoint directory: every
    architecture a registered family declares (``hf``), then ``ARCHITECTURE_RECIPES``."""
    from llmrt.families.registry import hf_architectures

    table = {arch: DIRECTORY_RECIPE for arch in hf_architectures()}
    table.update(ARCHITECTURE_RECIPES)
    return table


@attrs.frozen(kw_only=True)
class RecipeChoice:
    """The recipe picked for a vLLM model, why, and the overrides it gets."""

    recipe: str
    reason: str
    overrides: tuple[str, ...]

    def load(self, extra: Mapping[str, Any] | None = None) -> Recipe:
        """Load the recipe with the chosen overrides plus ``extra`` (vLLM's sizes)."""
        return load_recipe(self.recipe, overrides=merge_overrides(list(self.overrides), extra))

    def load_for(self, *, lanes: int, lane_capacity: int | None) -> Recipe:
        """Load it for vLLM's lanes and per-lane decode slots.

        A smaller capacity than the recipe's also drops the decode and prefill warmup
        batches it can no longer form (they would fail validation, not just go unused).
        """
        base = self.load()
        sizes: dict[str, Any] = {"lanes": lanes}
        if lane_capacity is not None and lane_capacity != base.decode.lane_capacity:
            sizes["decode.lane_capacity"] = lane_capacity
            if base.decode.batch_sizes is not None:
                sizes["decode.batch_sizes"] = [
                    b for b in base.decode.batch_sizes if b < lane_capacity
                ]
            widest = min(lane_capacity, base.prefill.max_batch_size)
            warm = [b for b in base.warmup.prefill_batch_sizes if b <= widest]
            sizes["warmup.prefill_batch_sizes"] = warm or [1]
            if base.serving.max_num_seqs is not None:
                sizes["serving.max_num_seqs"] = min(
                    base.serving.max_num_seqs, lanes * lane_capacity
                )
        return self.load(sizes)


def _field(hf_config: object, name: str) -> Any:
    if hf_config is None:
        return None
    if isinstance(hf_config, Mapping):
        return hf_config.get(name)
    return getattr(hf_config, name, None)


def select_recipe(
    *,
    hf_config: object | None = None,
    model_name: str | None = None,
    recipe: str | None = None,
    overrides: Overrides | None = None,
    env: Mapping[str, str] = os.environ,
) -> RecipeChoice:
    """The recipe for ``hf_config`` / ``model_name`` (see the module docstring for the order).

    ``recipe`` / ``overrides`` are for direct callers: an explicit recipe beats the table.
    """
    env_overrides = tuple(shlex.split(env.get(OVERRIDES_ENV, "")))
    given = _as_strings(overrides)
    name = model_name or _field(hf_config, "_name_or_path") or _field(hf_config, "name_or_path")
    if recipe is not None:
        return RecipeChoice(
            recipe=recipe, reason="recipe argument", overrides=(*env_overrides, *given)
        )
    chosen = env.get(RECIPE_ENV, "").strip()
    if chosen:
        return RecipeChoice(
            recipe=chosen, reason=f"${RECIPE_ENV}", overrides=(*env_overrides, *given)
        )
    if isinstance(name, str) and name in NAMED_RECIPES:
        return RecipeChoice(
            recipe=NAMED_RECIPES[name],
            reason=f"NAMED_RECIPES[{name!r}]",
            overrides=(*env_overrides, *given),
        )
    architectures = _field(hf_config, "architectures") or ()
    if isinstance(architectures, str):
        architectures = (architectures,)
    served = [a.removeprefix("TT") for a in architectures if isinstance(a, str)]
    table = architecture_recipes()
    known = [a for a in served if a in table]
    directory = _checkpoint_directory(name, env) if known and isinstance(name, str) else None
    if known and directory is not None:
        arch = known[0]
        return RecipeChoice(
            recipe=table[arch],
            reason=f"architecture {arch} -> recipe {table[arch]} with checkpoint {directory}",
            overrides=(f"checkpoint.path={directory}", *env_overrides, *given),
        )
    what = f"model {name!r}" if name else "the model"
    if known:
        hint = (
            f"{what} is a {known[0]} but neither a local checkpoint directory nor a Hub "
            "checkpoint in the local Hugging Face cache with its weights "
            f"(fetch it with `huggingface-cli download {name}`)"
        )
    else:
        hint = (
            f"no llmrt recipe for {what} (architectures {list(served) or 'unknown'}; "
            f"served: {sorted(NAMED_RECIPES)} by name, {sorted(table)} from a "
            "local directory)"
        )
    raise ConfigError(
        "hf_config",
        name,
        f"{hint}; set {RECIPE_ENV}=<recipe name or file> to choose the recipe",
    )


def _checkpoint_directory(name: str, env: Mapping[str, str]) -> str | None:
    """``name`` if it is a directory, else its cached Hub snapshot holding weights, else None.

    Only the local cache is read (``model_source.cached_snapshot``, as ``-m`` reads it): vLLM
    fetched the config, and the weights must be there too (``*.safetensors``), since the
    recipe reads them."""
    if Path(name).is_dir():
        return name
    hub_id = parse_hub_id(name)
    if hub_id is None:
        return None  # not a Hub ``org/model`` id
    repo, revision = hub_id
    snapshot = cached_snapshot(repo, revision=revision, env=env)
    if snapshot is None or not any(snapshot.glob("*.safetensors")):
        return None
    return str(snapshot)


def _as_strings(overrides: Overrides | None) -> tuple[str, ...]:
    if overrides is None:
        return ()
    if isinstance(overrides, Mapping):
        return tuple(f"{key}={_text(value)}" for key, value in overrides.items())
    if isinstance(overrides, str):
        raise ConfigError("overrides", overrides, "must be a list of key=value strings")
    return tuple(str(item) for item in overrides)


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    return str(value)


def merge_overrides(base: Sequence[str], extra: Mapping[str, Any] | None) -> list[str]:
    """``base`` plus ``extra`` (vLLM-derived values); a key set to another value in both fails."""
    merged = list(base)
    if not extra:
        return merged
    given = {}
    for item in base:
        key, sep, value = item.partition("=")
        if sep:
            given[key.strip()] = value.strip()
    for key, value in extra.items():
        text = _text(value)
        if key in given and given[key] != text:
            raise ConfigError(
                key, value, f"vLLM's value disagrees with the recipe override {key}={given[key]}"
            )
        merged.append(f"{key}={text}")
    return merged
