"""Static config validation, PageTableLayout geometry and shrink-only replacement."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmrt.errors import ConfigError
from llmrt.runtime.config import PagedKVCacheConfig, PageTableLayout, TraceConfig, WarmupConfig


@pytest.mark.parametrize(
    ("mode", "prefill", "decode"),
    [("none", False, False), ("decode_only", False, True), ("all", True, True)],
)
def test_trace_modes(mode: str, prefill: bool, decode: bool) -> None:
    cfg = TraceConfig(mode=mode)
    assert (cfg.prefill_enabled, cfg.decode_enabled) == (prefill, decode)


def test_trace_mode_rejected_names_field() -> None:
    with pytest.raises(ConfigError, match=r"trace\.mode: must be one of .* got 'sometimes'"):
        TraceConfig(mode="sometimes")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prefill_batch_sizes": (3,)}, r"warmup\.prefill_batch_sizes\[0\]"),
        ({"prefill_batch_sizes": ()}, r"warmup\.prefill_batch_sizes"),
        ({"prefill_seq_lens": (0,)}, r"warmup\.prefill_seq_lens\[0\]"),
        ({"prefill_seq_lens": (256, 128)}, r"warmup\.prefill_seq_lens"),
    ],
)
def test_warmup_rejects(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        WarmupConfig(**kwargs)


def test_kv_config_block_size_power_of_two() -> None:
    with pytest.raises(ConfigError) as info:
        PagedKVCacheConfig(block_size=24, max_num_blocks=8)
    assert str(info.value) == "kv_cache.block_size: must be a power of two, got 24"


def test_kv_config_dtype_and_counts() -> None:
    with pytest.raises(ConfigError, match=r"kv_cache\.dtype"):
        PagedKVCacheConfig(block_size=32, max_num_blocks=8, dtype="int8")
    with pytest.raises(ConfigError, match=r"kv_cache\.num_blocks: must not exceed"):
        PagedKVCacheConfig(block_size=32, max_num_blocks=8, num_blocks=9)
    with pytest.raises(ConfigError, match=r"kv_cache\.max_num_blocks"):
        PagedKVCacheConfig(block_size=32, max_num_blocks=0)


def test_kv_config_capacity_and_late_resolution() -> None:
    cfg = PagedKVCacheConfig(block_size=32, max_num_blocks=100)
    assert not cfg.is_resolved
    assert cfg.max_capacity_tokens == 3200
    with pytest.raises(ConfigError, match="not resolved"):
        _ = cfg.capacity_tokens
    resolved = cfg.with_num_blocks(64)
    assert resolved.is_resolved and resolved.capacity_tokens == 2048
    assert resolved.with_num_blocks(10).num_blocks == 10
    with pytest.raises(ConfigError, match="may only shrink"):
        resolved.with_num_blocks(65)
    with pytest.raises(ConfigError, match="may not change the block size"):
        cfg.check_replacement(PagedKVCacheConfig(block_size=16, max_num_blocks=100))
    with pytest.raises(ConfigError, match="may not grow capacity"):
        resolved.check_replacement(
            PagedKVCacheConfig(block_size=32, max_num_blocks=100, num_blocks=70)
        )


def test_layout_example() -> None:
    layout = PageTableLayout.resolve(
        block_size=32,
        model_max_sequence_length=1000,
        physical_num_blocks=2048,
        max_prefill_chunk_size=256,
    )
    assert layout.width == 32  # ceil(1000 / 32)
    assert layout.max_sequence_length == 1000
    assert layout.chunk_width == 8
    small = layout.with_physical_blocks(10)
    assert small.width == 10 and small.max_sequence_length == 320
    layout.check_replacement(small)
    with pytest.raises(ConfigError, match="may not grow"):
        small.check_replacement(layout)


def test_layout_rejects_unaligned_chunk() -> None:
    with pytest.raises(ConfigError, match=r"prefill\.max_chunk_size: must be a multiple"):
        PageTableLayout.resolve(
            block_size=32,
            model_max_sequence_length=1000,
            physical_num_blocks=64,
            max_prefill_chunk_size=100,
        )


block_sizes = st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128])


@given(
    block_size=block_sizes,
    max_len=st.integers(1, 20_000),
    blocks=st.integers(1, 5_000),
    chunk_blocks=st.integers(1, 64),
)
def test_layout_widths_are_aligned(
    block_size: int, max_len: int, blocks: int, chunk_blocks: int
) -> None:
    layout = PageTableLayout.resolve(
        block_size=block_size,
        model_max_sequence_length=max_len,
        physical_num_blocks=blocks,
        max_prefill_chunk_size=chunk_blocks * block_size,
    )
    assert layout.width == min(math.ceil(max_len / block_size), blocks)
    assert layout.width * block_size >= layout.max_sequence_length
    assert (layout.width - 1) * block_size < layout.max_sequence_length
    assert layout.max_prefill_chunk_size % block_size == 0
    assert 1 <= layout.chunk_width <= layout.width


@given(
    block_size=block_sizes,
    max_len=st.integers(1, 20_000),
    blocks=st.integers(1, 5_000),
    new_blocks=st.integers(1, 10_000),
)
def test_layout_replacement_only_shrinks(
    block_size: int, max_len: int, blocks: int, new_blocks: int
) -> None:
    layout = PageTableLayout.resolve(
        block_size=block_size,
        model_max_sequence_length=max_len,
        physical_num_blocks=blocks,
        max_prefill_chunk_size=block_size,
    )
    if new_blocks > blocks:
        with pytest.raises(ConfigError, match=r"kv_cache\.num_blocks"):
            layout.with_physical_blocks(new_blocks)
        return
    smaller = layout.with_physical_blocks(new_blocks)
    layout.check_replacement(smaller)
    assert smaller.block_size == layout.block_size
    assert smaller.width <= layout.width
    assert smaller.max_sequence_length <= layout.max_sequence_length


@given(
    max_blocks=st.integers(1, 10_000), first=st.integers(1, 10_000), second=st.integers(1, 10_000)
)
def test_kv_capacity_never_grows(max_blocks: int, first: int, second: int) -> None:
    cfg = PagedKVCacheConfig(block_size=16, max_num_blocks=max_blocks)
    if first > max_blocks:
        with pytest.raises(ConfigError):
            cfg.with_num_blocks(first)
        return
    resolved = cfg.with_num_blocks(first)
    if second > first:
        with pytest.raises(ConfigError, match="may only shrink"):
            resolved.with_num_blocks(second)
    else:
        assert resolved.with_num_blocks(second).capacity_tokens == second * 16
