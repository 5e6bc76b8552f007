"""Prefill sequence-length buckets: the tile and fine policies, and their caps."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmrt.errors import ConfigError, RequestError
from llmrt.runtime.prefill.buckets import SeqLenBuckets


@pytest.mark.parametrize(
    ("n", "padded"),
    [(1, 128), (128, 128), (129, 256), (256, 256), (257, 512), (1000, 1024), (1500, 1536)],
)
def test_tile_powers_of_two_from_128_capped(n: int, padded: int) -> None:
    assert SeqLenBuckets.tile(max_len=1536).pad(n) == padded


def test_tile_below_128_cap() -> None:
    assert SeqLenBuckets.tile(max_len=64).pad(1) == 64
    assert SeqLenBuckets.tile(max_len=64).lengths() == (64,)


@pytest.mark.parametrize(("n", "padded"), [(1, 32), (32, 32), (33, 64), (100, 128), (995, 1000)])
def test_fine_step_multiples_capped(n: int, padded: int) -> None:
    assert SeqLenBuckets.fine(max_len=1000).pad(n) == padded


def test_lengths_list_every_padded_length() -> None:
    assert SeqLenBuckets.tile(max_len=1536).lengths() == (128, 256, 512, 1024, 1536)
    assert SeqLenBuckets.tile(max_len=512).lengths() == (128, 256, 512)
    assert SeqLenBuckets.fine(max_len=100, step=24).lengths() == (24, 48, 72, 96, 100)


@given(
    kind=st.sampled_from(["tile", "fine"]),
    max_len=st.integers(1, 5000),
    step=st.sampled_from([8, 16, 24, 32, 64]),
    data=st.data(),
)
def test_pad_is_a_listed_length_at_least_n(
    kind: str, max_len: int, step: int, data: st.DataObject
) -> None:
    buckets = SeqLenBuckets.named(kind, max_len=max_len, step=step)
    n = data.draw(st.integers(1, max_len))
    padded = buckets.pad(n)
    assert n <= padded <= max_len
    assert padded in buckets.lengths()
    assert buckets.pad(padded) == padded
    smaller = [length for length in buckets.lengths() if length < padded]
    assert all(length < n for length in smaller)


@pytest.mark.parametrize("n", [0, -3, 1001, True])
def test_pad_refuses_lengths_outside_the_cap(n: int) -> None:
    with pytest.raises(RequestError, match="seq_len"):
        SeqLenBuckets.fine(max_len=1000).pad(n)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kind": "coarse", "max_len": 128}, "prefill.buckets.kind"),
        ({"kind": "fine", "max_len": 0}, "prefill.buckets.max_len"),
        ({"kind": "fine", "max_len": 128, "step": 12}, "prefill.buckets.step"),
        ({"kind": "fine", "max_len": 128, "step": 0}, "prefill.buckets.step"),
    ],
)
def test_bucket_policy_rejects(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}: "):
        SeqLenBuckets(**kwargs)
