"""Recipes sized to a workload: KV blocks and warmup coverage, the user's ``--set`` winning."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from llmrt.recipe.loader import Recipe, load_recipe


@attrs.frozen(kw_only=True)
class SizedRecipe:
    """A recipe plus the overrides the bench added (reported, so runs are reproducible)."""

    recipe: Recipe
    bench_overrides: tuple[str, ...]


def override_key(override: str) -> str:
    return override.split("=", 1)[0].strip()


def kv_blocks(recipe: Recipe, *, tokens_per_request: int, requests: int | None = None) -> int:
    """Blocks per lane for ``requests`` concurrent requests (default: every decode slot)."""
    per_request = math.ceil(tokens_per_request / recipe.kv_cache.block_size)
    concurrent = recipe.decode.lane_capacity if requests is None else requests
    wanted = concurrent * per_request + concurrent  # one spare block per request
    return max(per_request, min(wanted, recipe.kv_cache.max_num_blocks))


def sized_recipe(
    name: str,
    *,
    user_overrides: Sequence[str],
    tokens_per_request: int,
    requests: int | None = None,
    extra: Sequence[str] = (),
) -> SizedRecipe:
    """``name`` with ``kv_cache.num_blocks`` sized to the workload and ``extra`` overrides.

    Overrides the user gave (``--set``) are applied last and are never replaced.
    """
    base = load_recipe(name, overrides=list(user_overrides))
    given = {override_key(o) for o in user_overrides}
    bench: list[str] = []
    if "kv_cache.num_blocks" not in given:
        blocks = kv_blocks(base, tokens_per_request=tokens_per_request, requests=requests)
        bench.append(f"kv_cache.num_blocks={blocks}")
    bench.extend(o for o in extra if override_key(o) not in given)
    recipe = load_recipe(name, overrides=[*bench, *user_overrides])
    return SizedRecipe(recipe=recipe, bench_overrides=tuple(bench))
