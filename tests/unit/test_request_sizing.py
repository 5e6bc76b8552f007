"""``request_overrides``: a recipe's decode slots fitted to the prompts of one run."""

from __future__ import annotations

import pytest

from llmrt.recipe.loader import list_recipes, load_recipe
from llmrt.recipe.sizing import request_overrides

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


@pytest.mark.parametrize("name", [n for n in list_recipes() if n not in ("gguf", "hf")])
@pytest.mark.parametrize("requests", [1, 2, 3, 7, 33])
def test_every_bundled_recipe_stays_valid(name: str, requests: int) -> None:
    _, recipe = _sized(name, requests)
    assert recipe.decode_slots >= min(requests, load_recipe(name, env=NO_ENV).decode_slots)  # type: ignore[attr-defined]


def test_requests_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        request_overrides(load_recipe("tiny-llama", env=NO_ENV), requests=0, given=())


@pytest.mark.parametrize(
    ("requests", "new_tokens", "placed"),
    [(1, 16, False), (1, 64, False), (4, 127, False), (4, 128, True), (1, 4096, True)],
)
def test_a_short_run_leaves_the_weights_off_huge_pages(
    requests: int, new_tokens: int, placed: bool
) -> None:
    # Moving the weights onto huge pages costs a fraction of a second or more at startup and
    # saves under a millisecond per decode step: a run decoding fewer than 512 tokens in all
    # skips it.
    base = load_recipe("smollm2-135m", env=NO_ENV)
    assert base.device.huge_pages  # type: ignore[attr-defined]
    extra = request_overrides(base, requests=requests, given=set(), new_tokens=new_tokens)
    recipe = load_recipe("smollm2-135m", overrides=extra, env=NO_ENV)
    assert recipe.device.huge_pages is placed  # type: ignore[attr-defined]
    # Unknown output lengths, or the user's own setting, leave it alone.
    assert "device.huge_pages=false" not in request_overrides(base, requests=1, given=set())
    given = {"device.huge_pages"}
    assert "device.huge_pages=false" not in request_overrides(
        base, requests=1, given=given, new_tokens=1
    )
