"""SamplingParams: defaults, normalisation and rejection of every invalid value."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmrt.errors import RequestError
from llmrt.sampling.params import GREEDY_TEMPERATURE, MAX_LOGPROBS, SamplingParams
from llmrt.sampling.structured import StructuredOutput

_NONFINITE = st.sampled_from([math.nan, math.inf, -math.inf])
_NOT_A_NUMBER = st.one_of(
    st.text(max_size=3), st.none(), st.booleans(), st.lists(st.integers(), max_size=2)
)


def _outside(low: float, high: float) -> st.SearchStrategy[float]:
    return st.one_of(
        st.floats(max_value=low, exclude_max=True),
        st.floats(min_value=high, exclude_min=True),
        _NONFINITE,
    )


INVALID: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.one_of(st.integers(max_value=0), st.floats(), _NOT_A_NUMBER),
    "temperature": st.one_of(st.floats(max_value=0.0, exclude_max=True), _NONFINITE, _NOT_A_NUMBER),
    "top_k": st.one_of(st.integers(max_value=-2), st.floats(), _NOT_A_NUMBER),
    "top_p": st.one_of(
        st.floats(max_value=0.0),
        st.floats(min_value=1.0, exclude_min=True),
        _NONFINITE,
        _NOT_A_NUMBER,
    ),
    "min_p": st.one_of(_outside(0.0, 1.0), _NOT_A_NUMBER),
    "seed": st.one_of(st.floats(), st.text(max_size=3), st.booleans()),
    "stop": st.one_of(
        st.integers(),
        st.floats(),
        st.lists(st.integers(), min_size=1),
        st.lists(st.text(min_size=1), max_size=2).map(lambda xs: [*xs, ""]),
    ),
    "stop_token_ids": st.one_of(
        st.text(),
        st.integers(),
        st.lists(st.integers(max_value=-1), min_size=1),
        st.lists(st.text(), min_size=1),
        st.lists(st.booleans(), min_size=1),
    ),
    "ignore_eos": st.one_of(st.integers(), st.floats(), st.text(max_size=3), st.none()),
    "logprobs": st.one_of(
        st.integers(max_value=-1),
        st.integers(min_value=MAX_LOGPROBS + 1),
        st.floats(),
        st.text(max_size=3),
        st.booleans(),
    ),
    "repetition_penalty": st.one_of(st.floats(max_value=0.0), _NONFINITE, _NOT_A_NUMBER),
    "presence_penalty": st.one_of(_outside(-2.0, 2.0), _NOT_A_NUMBER),
    "frequency_penalty": st.one_of(_outside(-2.0, 2.0), _NOT_A_NUMBER),
    "structured_output": st.one_of(
        st.text(min_size=1, max_size=3), st.integers(), st.dictionaries(st.text(), st.text())
    ),
    "constraint": st.one_of(st.text(min_size=1, max_size=3), st.integers(), st.booleans()),
}

VALID: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(min_value=1, max_value=1 << 20),
    "temperature": st.floats(min_value=0.0, max_value=1e4),
    "top_k": st.integers(min_value=-1, max_value=1 << 20),
    "top_p": st.floats(min_value=0.0, max_value=1.0, exclude_min=True),
    "min_p": st.floats(min_value=0.0, max_value=1.0),
    "seed": st.one_of(st.none(), st.integers()),
    "stop": st.one_of(st.none(), st.text(min_size=1), st.lists(st.text(min_size=1), max_size=3)),
    "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(min_value=0), max_size=3)),
    "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.none(), st.integers(min_value=0, max_value=MAX_LOGPROBS)),
    "repetition_penalty": st.floats(min_value=0.0, max_value=10.0, exclude_min=True),
    "presence_penalty": st.floats(min_value=-2.0, max_value=2.0),
    "frequency_penalty": st.floats(min_value=-2.0, max_value=2.0),
    "structured_output": st.one_of(
        st.none(),
        st.just(StructuredOutput.json_object()),
        st.builds(
            StructuredOutput.json_schema,
            st.fixed_dictionaries({"type": st.sampled_from(["object", "string", "integer"])}),
        ),
    ),
    "constraint": st.none(),
}


def test_every_field_has_invalid_and_valid_strategies() -> None:
    names = {a.name for a in attrs.fields(SamplingParams)}
    assert set(INVALID) == names
    assert set(VALID) == names


@pytest.mark.parametrize("field", sorted(INVALID))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_invalid_value_is_rejected_naming_field_and_value(field: str, data: st.DataObject) -> None:
    value = data.draw(INVALID[field], label=field)
    with pytest.raises(RequestError) as info:
        SamplingParams(**{field: value})
    err = info.value
    assert err.field == field
    assert str(err).startswith(f"{field}: ")
    if value is not None:
        assert repr(value) in str(err)


@settings(max_examples=200, deadline=None)
@given(kwargs=st.fixed_dictionaries({}, optional=VALID))
def test_valid_values_are_accepted(kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**kwargs)
    assert params.greedy == (params.temperature < GREEDY_TEMPERATURE)
    assert isinstance(params.stop, tuple)
    assert all(isinstance(s, str) and s for s in params.stop)
    assert isinstance(params.stop_token_ids, tuple)
    assert SamplingParams.from_kwargs(**kwargs) == params


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (16, 1.0, 0, 1.0, 0.0)
    assert (p.seed, p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == (
        None,
        (),
        (),
        False,
        None,
    )
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert not p.greedy
    assert not p.has_penalties
    assert not p.top_k_enabled


def test_stop_and_stop_token_ids_are_normalised_to_tuples() -> None:
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop="x") == SamplingParams(stop=("x",))
    with pytest.raises(RequestError, match="stop: must be a string or a list"):
        SamplingParams(stop={"a": 1})  # type: ignore[arg-type]  # its keys were taken


def test_greedy_and_disabled_top_k() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.01).greedy
    assert not SamplingParams(top_k=-1).top_k_enabled
    assert not SamplingParams(top_k=0).top_k_enabled
    assert SamplingParams(top_k=1).top_k_enabled
    assert SamplingParams(frequency_penalty=0.1).has_penalties


def test_frozen_and_keyword_only() -> None:
    p = SamplingParams()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]
    with pytest.raises(TypeError):
        SamplingParams(16)  # type: ignore[call-arg]


def test_from_kwargs_names_every_unknown_key() -> None:
    with pytest.raises(RequestError) as info:
        SamplingParams.from_kwargs(top_p=0.5, n=2, best_of=3)
    assert info.value.field == "sampling_params"
    assert info.value.value == ("best_of", "n")
    assert "best_of, n" in str(info.value)


def test_from_kwargs_still_validates_known_keys() -> None:
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams.from_kwargs(top_p=0)
    assert SamplingParams.from_kwargs(top_k=5, seed=7) == SamplingParams(top_k=5, seed=7)
