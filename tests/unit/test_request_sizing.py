"""``request_overrides``: a recipe's decode slots fitted to the prompts of one run."""

from __future__ import annotations

import pytest

from llmrt.recipe import list_recipes, load_recipe
from llmrt.request_sizing import request_overrides

NO_ENV: dict[str, str] = {}


def _sized(name: str, requests: int, user: list[str] | None = None) -> tuple[list[str], object]:
    user = user or []
    base = load_recipe(name, overrides=user, env=NO_ENV)
    given = {o.split("=", 1)[0] for o in user}
    extra = request_overrides(base, requests=requests, given=given)
    return extra, load_recipe(name, overrides=[*extra, *user], env=NO_ENV)


def test_one_prompt_warms_one_decode_batch_and_single_row_prefill() -> None:
    extra, recipe = _sized("smollm2-135m", 1)
    assert recipe.decode.lane_capacity == 1  # type: ignore[attr-defined]
    assert recipe.decode_batch_sizes == (1,)  # type: ignore[attr-defined]
    assert recipe.prefill.max_batch_size == 1  # type: ignore[attr-defined]
    assert recipe.warmup.prefill_batch_sizes == (1,)  # type: ignore[attr-defined]
    assert "decode.lane_capacity=1" in extra


@pytest.mark.parametrize(("requests", "capacity"), [(2, 2), (3, 4), (5, 8), (9, 16), (40, 16)])
def test_capacity_is_the_power_of_two_holding_the_prompts_never_above_the_recipe(
    requests: int, capacity: int
) -> None:
    _, recipe = _sized("smollm2-135m", requests)
    assert recipe.decode.lane_capacity == capacity  # type: ignore[attr-defined]
    assert max(recipe.decode_batch_sizes) == capacity  # type: ignore[attr-defined]


def test_lanes_split_the_prompts() -> None:
    _, recipe = _sized("smollm2-135m-dp2", 3)
    assert recipe.decode.lane_capacity == 2  # type: ignore[attr-defined]
    assert recipe.decode_slots >= 3  # type: ignore[attr-defined]


def test_user_overrides_win() -> None:
    extra, recipe = _sized("smollm2-135m", 1, ["decode.lane_capacity=8"])
    assert extra == []
    assert recipe.decode.lane_capacity == 8  # type: ignore[attr-defined]
    pinned = ["prefill.max_batch_size=4", "warmup.prefill_batch_sizes=[1, 4]"]
    extra, recipe = _sized("smollm2-135m", 1, pinned)
    assert not any(o.startswith(("prefill.", "warmup.")) for o in extra)
    assert recipe.prefill.max_batch_size == 4  # type: ignore[attr-defined]
    assert recipe.decode.lane_capacity == 4  # type: ignore[attr-defined]  # holds the pinned wave


@pytest.mark.parametrize("name", [n for n in list_recipes() if n != "hf"])
@pytest.mark.parametrize("requests", [1, 2, 3, 7, 33])
def test_every_bundled_recipe_stays_valid(name: str, requests: int) -> None:
    _, recipe = _sized(name, requests)
    assert recipe.decode_slots >= min(requests, load_recipe(name, env=NO_ENV).decode_slots)  # type: ignore[attr-defined]


def test_requests_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        request_overrides(load_recipe("tiny-llama", env=NO_ENV), requests=0, given=())
