"""Prefill planning: waves, sequential fallbacks, chunking, page tables and row validation.

``bench_planner`` (run this file as a script) measures the planner's per-row cost;
performance targets live in ``llmrt bench``, never in timed unit tests.
"""

from __future__ import annotations

import gc
import itertools
import math
import random
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmrt.errors import ConfigError, RequestError
from llmrt.runtime.config import PREFILL_BATCH_SIZES, PageTableLayout
from llmrt.runtime.prefill.buckets import SeqLenBuckets
from llmrt.runtime.prefill.plan import (
    BATCHED_PREFILL_TOKEN_LIMIT,
    CHUNKED_TABLE_FILLER,
    SKIP_BLOCK,
    PrefillPlan,
    PrefillPlanPolicy,
    PrefillRequest,
    PrefillRow,
    plan_prefill,
)

NO_ENV: Mapping[str, str] = {}


def make_policy(**overrides: Any) -> PrefillPlanPolicy:
    """A small batching-capable policy; ``bucket_kind``/``bucket_step`` pick the buckets."""
    kind = overrides.pop("bucket_kind", "fine")
    step = overrides.pop("bucket_step", 8)
    fields: dict[str, Any] = {
        "block_size": 8,
        "page_table_width": 16,
        "num_blocks": 4096,
        "max_sequence_length": 128,
        "max_chunk_size": 32,
        "batching_supported": True,
        "batching_enabled": True,
        "max_batch_size": 32,
        "lane_capacity": 64,
        "model_extracts_batched_outputs": True,
    }
    fields.update(overrides)
    fields.setdefault(
        "buckets", SeqLenBuckets.named(kind, max_len=fields["max_chunk_size"], step=step)
    )
    return PrefillPlanPolicy(**fields)


def make_rows(
    lengths: Sequence[int],
    *,
    policy: PrefillPlanPolicy,
    cached: Sequence[int] | None = None,
    first_block: int = 0,
) -> list[PrefillRow]:
    """Rows 0..n-1 with distinct tokens, slot == source row and consecutive exact block ids."""
    rows = []
    block = first_block
    for i, n in enumerate(lengths):
        need = math.ceil(n / policy.block_size)
        rows.append(
            PrefillRow(
                source_row=i,
                tokens=torch.arange(1, n + 1, dtype=torch.int64) + 1000 * i,
                cached_tokens=0 if cached is None else cached[i],
                slot=i,
                block_ids=tuple(range(block, block + need)),
            )
        )
        block += need
    return rows


def kinds(plan: PrefillPlan) -> list[tuple[str, tuple[int, ...], int]]:
    return [(r.kind, r.source_rows, r.padded_batch_size) for r in plan.requests]


# --- invariants checked on every plan ---------------------------------------------------


def check_plan(plan: PrefillPlan, rows: Sequence[PrefillRow], policy: PrefillPlanPolicy) -> None:
    by_source = {r.source_row: r for r in rows}
    locations = plan.source_order()
    assert [loc.source_row for loc in locations] == sorted(by_source)
    seen = [src for req in plan.requests for src in req.source_rows]
    assert sorted(seen) == sorted(by_source)
    for loc in locations:
        assert plan.requests[loc.request_index].source_rows[loc.batch_row] == loc.source_row
    for req in plan.requests:
        check_request(req, [by_source[s] for s in req.source_rows], policy)


def check_request(
    req: PrefillRequest, rows: Sequence[PrefillRow], policy: PrefillPlanPolicy
) -> None:
    bs, width = policy.block_size, policy.page_table_width
    active, padded = req.active_batch_size, req.padded_batch_size
    assert active == len(rows) == len(req.slots) == len(req.seq_lens) >= 1
    assert padded in PREFILL_BATCH_SIZES and padded >= active
    assert req.slots == tuple(r.slot for r in rows)
    assert req.prompt_lens == tuple(len(r.tokens) for r in rows)
    assert req.cached_tokens == tuple(r.cached_tokens for r in rows)
    assert req.seq_lens == tuple(
        p - c for p, c in zip(req.prompt_lens, req.cached_tokens, strict=True)
    )
    assert req.page_table_width == width
    assert req.page_table.shape == (padded, width) and req.page_table.dtype == torch.int32
    assert req.last_token_rows == tuple(range(active))
    if req.kind == "batched":
        assert active >= 2
        assert padded <= min(policy.max_batch_size, policy.lane_capacity)
        assert padded * req.padded_seq_len < BATCHED_PREFILL_TOKEN_LIMIT
        assert req.padded_seq_len <= policy.max_chunk_size
        assert policy.wave_rules != "spec" or all(r.cached_tokens == 0 for r in rows)
    else:
        assert active == padded == 1
        long_or_cached = rows[0].cached_tokens > 0 or req.seq_lens[0] > policy.max_chunk_size
        assert (req.kind == "chunked") == long_or_cached

    if req.kind != "chunked":
        (chunk,) = req.chunks
        assert chunk.page_table is req.page_table
        assert chunk.padded_len == req.padded_seq_len == policy.buckets.pad(max(req.seq_lens))
        for b, row in enumerate(rows):
            n = len(row.tokens)
            blocks = list(row.block_ids[: math.ceil(n / bs)])
            assert req.page_table[b].tolist() == blocks + [SKIP_BLOCK] * (width - len(blocks))
    else:
        row = rows[0]
        n = len(row.tokens)
        blocks = list(row.block_ids[: math.ceil(n / bs)])
        full = req.page_table[0].tolist()
        assert full == blocks + [CHUNKED_TABLE_FILLER] * (width - len(blocks))
        assert min(full) >= 0
        assert req.padded_seq_len == max(c.padded_len for c in req.chunks)

    # Chunks are contiguous, aligned to chunk-size steps from the cached offset, and cover
    # [cached_tokens, prompt_len) exactly; only the last one holds the final token.
    expected_start = req.cached_tokens[0] if req.kind == "chunked" else min(req.cached_tokens)
    for i, chunk in enumerate(req.chunks):
        assert chunk.index == i
        assert chunk.token_start == chunk.start_pos == expected_start
        assert chunk.is_last == (i == len(req.chunks) - 1)
        if req.kind == "batched":  # an envelope of rows that each start at their offset
            assert 0 < max(req.seq_lens) <= policy.max_chunk_size
        else:
            assert 0 < chunk.token_end - chunk.token_start <= policy.max_chunk_size
        if req.kind == "chunked":
            assert (chunk.token_start - req.cached_tokens[0]) % policy.max_chunk_size == 0
            assert chunk.padded_len == policy.buckets.pad(chunk.token_end - chunk.token_start)
        expected_start = chunk.token_end
        check_chunk_tensors(chunk, req, rows, policy)
    assert req.chunks[-1].token_end == max(req.prompt_lens)
    final_lens = req.chunks[-1].seq_lens[:active].tolist()
    assert req.last_token_indices == tuple(n - 1 for n in final_lens)


def check_chunk_tensors(
    chunk: Any, req: PrefillRequest, rows: Sequence[PrefillRow], policy: PrefillPlanPolicy
) -> None:
    bs, width = policy.block_size, policy.page_table_width
    padded, active = req.padded_batch_size, req.active_batch_size
    assert chunk.tokens.shape == (padded, chunk.padded_len)
    assert chunk.tokens.dtype == torch.int64
    assert chunk.start_positions.shape == chunk.seq_lens.shape == (padded,)
    assert chunk.start_positions.dtype == chunk.seq_lens.dtype == torch.int32
    assert chunk.last_token_index.shape == (padded,)
    assert chunk.last_token_index.dtype == torch.int64
    assert chunk.page_table.shape == (padded, width) and chunk.page_table.dtype == torch.int32
    for b, row in enumerate(rows):
        end = min(chunk.token_end, len(row.tokens))
        start = row.cached_tokens if req.kind == "batched" else chunk.token_start
        n = end - start
        assert chunk.tokens[b, :n].tolist() == row.tokens[start:end].tolist()
        assert not chunk.tokens[b, n:].any()
        assert chunk.seq_lens[b] == n
        assert chunk.start_positions[b] == start
        assert chunk.last_token_index[b] == n - 1
        if req.kind == "chunked":
            mapped = list(row.block_ids[: math.ceil(end / bs)])
            assert chunk.page_table[b].tolist() == mapped + [SKIP_BLOCK] * (width - len(mapped))
    # Padding rows are inert: zero tokens, zero length, all -1 page table.
    pad = slice(active, padded)
    assert not chunk.tokens[pad].any()
    assert not chunk.seq_lens[pad].any()
    assert not chunk.start_positions[pad].any()
    assert not chunk.last_token_index[pad].any()
    assert (chunk.page_table[pad] == SKIP_BLOCK).all()
    assert (req.page_table[pad] == SKIP_BLOCK).all()


def expected_layout(
    rows: Sequence[PrefillRow],
    policy: PrefillPlanPolicy,
    *,
    sampling_params_given: bool,
    env: Mapping[str, str],
) -> list[tuple[str, tuple[int, ...]]]:
    """The wave rules stated directly: which rows form waves, which run alone.

    Spec rules: a whole bucket is one wave or runs row by row. Packed rules: cached rows
    count like any other, and a bucket larger than the largest allowed wave is cut into
    waves of that size first. Ragged rules: every row whose new tokens fit one chunk, in
    source order, cut into waves of the largest size allowed at the chunk length (a wave of
    one row runs alone); longer rows then run alone, shortest bucket first.
    """

    def bucket(row: PrefillRow) -> int:
        new = len(row.tokens) - row.cached_tokens
        if new > policy.max_chunk_size:
            return math.ceil(new / policy.max_chunk_size) * policy.max_chunk_size
        return policy.buckets.pad(new)

    off = (
        not policy.batching_supported
        or not policy.batching_enabled
        or env.get("DISABLE_BATCHED_PREFILL", "").lower() in ("1", "true", "yes")
        or (sampling_params_given and not policy.model_extracts_batched_outputs)
    )
    packed = policy.wave_rules != "spec"
    groups: list[tuple[int, list[PrefillRow]]] = []
    if policy.wave_rules == "ragged" and not off:
        chunk = policy.max_chunk_size
        fits = sorted(
            (r for r in rows if len(r.tokens) - r.cached_tokens <= chunk),
            key=lambda r: r.source_row,
        )
        largest = max(
            (
                b
                for b in policy.wave_batch_sizes
                if 1 < b <= min(policy.max_batch_size, policy.lane_capacity)
                and b * chunk < 128 * 1024
            ),
            default=1,
        )
        longer = sorted(
            (r for r in rows if len(r.tokens) - r.cached_tokens > chunk),
            key=lambda r: (bucket(r), r.source_row),
        )
        groups = [
            (max(bucket(r) for r in fits[i : i + largest]), fits[i : i + largest])
            for i in range(0, len(fits), largest)
        ] + [(bucket(r), [r]) for r in longer]
        rows = []  # grouped already
    for seq, group in itertools.groupby(
        sorted(rows, key=lambda r: (bucket(r), r.source_row)), key=bucket
    ):
        members = list(group)
        largest = max(
            (
                b
                for b in policy.wave_batch_sizes
                if 1 < b <= min(policy.max_batch_size, policy.lane_capacity)
                and b * seq < 128 * 1024
            ),
            default=0,
        )
        if packed and not off and largest and len(members) > largest:
            groups.extend((seq, members[i : i + largest]) for i in range(0, len(members), largest))
        else:
            groups.append((seq, members))
    out: list[tuple[str, tuple[int, ...]]] = []
    for seq, members in groups:
        wave = next((b for b in policy.wave_batch_sizes if b >= len(members)), 10**9)
        if (
            len(members) > 1
            and not off
            and wave <= policy.max_batch_size
            and wave <= policy.lane_capacity
            and seq <= policy.max_chunk_size
            and (packed or all(r.cached_tokens == 0 for r in members))
            and wave * seq < 128 * 1024
        ):
            out.append(("batched", tuple(r.source_row for r in members)))
            continue
        for r in members:
            long_or_cached = r.cached_tokens or len(r.tokens) > policy.max_chunk_size
            out.append(("chunked" if long_or_cached else "single", (r.source_row,)))
    return out


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[PrefillPlanPolicy, list[PrefillRow], bool, dict]:
    bs = draw(st.sampled_from([4, 8, 16, 32]))
    chunk_blocks = draw(st.integers(1, 8))
    width = draw(st.integers(chunk_blocks, 16))
    max_seq = draw(st.integers(1, width * bs))
    n = draw(st.one_of(st.integers(0, 10), st.integers(0, 40)))
    # A few distinct lengths make shared buckets (and so waves) common.
    pool = draw(st.lists(st.integers(1, max_seq), min_size=1, max_size=4))
    lengths = draw(st.lists(st.sampled_from(pool), min_size=n, max_size=n))
    cached_rate = draw(st.sampled_from([0.0, 0.0, 0.1, 0.5]))
    cached = [
        draw(st.integers(0, (length - 1) // bs)) * bs if draw(st.floats(0, 1)) < cached_rate else 0
        for length in lengths
    ]
    extra = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    need = [math.ceil(length / bs) + e for length, e in zip(lengths, extra, strict=True)]
    num_blocks = sum(need) + draw(st.integers(1, 8))
    order = draw(st.permutations(range(num_blocks)))
    lane_capacity = draw(st.integers(max(n, 1), 48))
    slots = draw(st.permutations(range(lane_capacity)))
    sources = draw(st.lists(st.integers(0, 10_000), unique=True, min_size=n, max_size=n))
    policy = make_policy(
        block_size=bs,
        page_table_width=width,
        num_blocks=num_blocks,
        max_sequence_length=max_seq,
        max_chunk_size=chunk_blocks * bs,
        batching_supported=draw(st.sampled_from([True, True, True, False])),
        batching_enabled=draw(st.sampled_from([True, True, True, False])),
        max_batch_size=draw(st.sampled_from((32, 16, 8, 32, 4, 2, 1))),
        lane_capacity=lane_capacity,
        model_extracts_batched_outputs=draw(st.booleans()),
        bucket_kind=draw(st.sampled_from(["tile", "fine"])),
        bucket_step=draw(st.sampled_from([8, 16, 32])),
        wave_rules=draw(st.sampled_from(["spec", "packed", "ragged"])),
    )
    rows = []
    offset = 0
    for i in range(n):
        ids = tuple(order[offset : offset + need[i]])
        offset += need[i]
        rows.append(
            PrefillRow(
                source_row=sources[i],
                tokens=torch.randint(1, 50_000, (lengths[i],), dtype=torch.int32),
                cached_tokens=cached[i],
                slot=slots[i],
                block_ids=ids,
            )
        )
    rows = draw(st.permutations(rows))
    env = draw(st.sampled_from([{}, {}, {"DISABLE_BATCHED_PREFILL": "1"}, {"OTHER": "1"}]))
    return policy, list(rows), draw(st.sampled_from([False, False, True])), env


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_plan_properties(scenario: tuple[PrefillPlanPolicy, list[PrefillRow], bool, dict]) -> None:
    policy, rows, sampling, env = scenario
    plan = plan_prefill(rows=rows, policy=policy, sampling_params_given=sampling, env=env)
    check_plan(plan, rows, policy)
    assert [(r.kind, r.source_rows) for r in plan.requests] == expected_layout(
        rows, policy, sampling_params_given=sampling, env=env
    )
    # Deterministic and independent of the order rows arrive in.
    again = plan_prefill(rows=rows[::-1], policy=policy, sampling_params_given=sampling, env=env)
    assert kinds(again) == kinds(plan)


# --- waves and fallbacks ----------------------------------------------------------------


def test_fifteen_rows_make_one_padded_sixteen_wave() -> None:
    policy = make_policy()
    rows = make_rows([25 + (i % 7) for i in range(15)], policy=policy)  # all pad to 32
    plan = plan_prefill(rows=rows, policy=policy, env=NO_ENV)
    (req,) = plan.requests
    assert (req.kind, req.active_batch_size, req.padded_batch_size) == ("batched", 15, 16)
    assert req.source_rows == tuple(range(15)) and req.slots == tuple(range(15))
    check_plan(plan, rows, policy)


def test_slots_do_not_split_a_wave() -> None:
    policy = make_policy()
    rows = [
        attrs.evolve(r, slot=s)
        for r, s in zip(make_rows([20, 21, 22], policy=policy), (40, 3, 17), strict=True)
    ]
    (req,) = plan_prefill(rows=rows, policy=policy, env=NO_ENV).requests
    assert req.kind == "batched" and req.slots == (40, 3, 17)


def test_one_row_bucket_is_single() -> None:
    policy = make_policy()
    plan = plan_prefill(rows=make_rows([5, 30], policy=policy), policy=policy, env=NO_ENV)
    assert kinds(plan) == [("single", (0,), 1), ("single", (1,), 1)]
    assert [r.sequential_reason for r in plan.requests] == [None, None]


def test_buckets_order_requests_by_padded_length() -> None:
    policy = make_policy()
    rows = make_rows([30, 3, 31, 4], policy=policy)
    plan = plan_prefill(rows=rows, policy=policy, env=NO_ENV)
    assert [(r.source_rows, r.padded_seq_len) for r in plan.requests] == [((1, 3), 8), ((0, 2), 32)]
    check_plan(plan, rows, policy)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"batching_supported": False}, "unsupported"),
        ({"batching_enabled": False}, "disabled"),
        ({"max_batch_size": 2}, "max_batch_size"),
        ({"lane_capacity": 3}, "lane_capacity"),
    ],
)
def test_policy_fallbacks_plan_single_rows(overrides: dict, reason: str) -> None:
    policy = make_policy(**overrides)
    rows = make_rows([10, 11, 12], policy=policy)  # one bucket of 3 rows -> padded 4
    plan = plan_prefill(rows=rows, policy=policy, env=NO_ENV)
    assert kinds(plan) == [("single", (i,), 1) for i in range(3)]
    assert {r.sequential_reason for r in plan.requests} == {reason}
    check_plan(plan, rows, policy)


def test_limits_compare_the_padded_batch_not_the_active_count() -> None:
    rows_3 = make_rows([10, 11, 12], policy=make_policy())
    assert kinds(plan_prefill(rows=rows_3, policy=make_policy(max_batch_size=4), env=NO_ENV)) == [
        ("batched", (0, 1, 2), 4)
    ]
    assert kinds(plan_prefill(rows=rows_3, policy=make_policy(lane_capacity=4), env=NO_ENV)) == [
        ("batched", (0, 1, 2), 4)
    ]


def test_over_limit_bucket_is_not_split() -> None:
    policy = make_policy(max_batch_size=8)
    rows = make_rows([12] * 9, policy=policy)
    plan = plan_prefill(rows=rows, policy=policy, env=NO_ENV)
    assert kinds(plan) == [("single", (i,), 1) for i in range(9)]


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", " Yes "])
def test_disable_batched_prefill_env(value: str) -> None:
    policy = make_policy()
    rows = make_rows([10, 11], policy=policy)
    plan = plan_prefill(rows=rows, policy=policy, env={"DISABLE_BATCHED_PREFILL": value})
    assert kinds(plan) == [("single", (0,), 1), ("single", (1,), 1)]
    assert {r.sequential_reason for r in plan.requests} == {"env_disabled"}


@pytest.mark.parametrize("value", ["0", "", "false", "no"])
def test_disable_batched_prefill_env_falsy_keeps_batching(value: str) -> None:
    policy = make_policy()
    plan = plan_prefill(
        rows=make_rows([10, 11], policy=policy),
        policy=policy,
        env={"DISABLE_BATCHED_PREFILL": value},
    )
    assert kinds(plan) == [("batched", (0, 1), 2)]


def test_disable_batched_prefill_read_from_os_environ_at_call_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policy = make_policy()
    rows = make_rows([10, 11], policy=policy)
    monkeypatch.setenv("DISABLE_BATCHED_PREFILL", "1")
    assert kinds(plan_prefill(rows=rows, policy=policy))[0][0] == "single"
    monkeypatch.delenv("DISABLE_BATCHED_PREFILL")
    assert kinds(plan_prefill(rows=rows, policy=policy))[0][0] == "batched"


@pytest.mark.parametrize(
    ("given", "extracts", "kind"),
    [(True, False, "single"), (True, True, "batched"), (False, False, "batched")],
)
def test_sampling_params_fallback(given: bool, extracts: bool, kind: str) -> None:
    policy = make_policy(model_extracts_batched_outputs=extracts)
    plan = plan_prefill(
        rows=make_rows([10, 11], policy=policy),
        policy=policy,
        sampling_params_given=given,
        env=NO_ENV,
    )
    assert plan.requests[0].kind == kind
    if kind == "single":
        assert plan.requests[0].sequential_reason == "sampling"


def test_cached_row_makes_its_bucket_sequential() -> None:
    policy = make_policy()
    rows = make_rows([20, 21, 30], policy=policy, cached=[0, 0, 8])  # new lens 20, 21, 22
    plan = plan_prefill(rows=rows, policy=policy, env=NO_ENV)
    assert kinds(plan) == [("single", (0,), 1), ("single", (1,), 1), ("chunked", (2,), 1)]
    assert {r.sequential_reason for r in plan.requests} == {"cached"}
    check_plan(plan, rows, policy)


def test_packed_rules_put_cached_rows_in_a_wave_at_their_own_offsets() -> None:
    policy = make_policy(wave_rules="packed")
    rows = make_rows([20, 21, 30], policy=policy, cached=[0, 0, 8])  # new lens 20, 21, 22
    plan = plan_prefill(rows=rows, policy=policy, env=NO_ENV)
    (req,) = plan.requests
    assert (req.kind, req.source_rows, req.padded_batch_size) == ("batched", (0, 1, 2), 4)
    assert req.cached_tokens == (0, 0, 8) and req.seq_lens == (20, 21, 22)
    assert req.last_token_indices == (19, 20, 21)
    (chunk,) = req.chunks
    assert chunk.start_positions.tolist() == [0, 0, 8, 0]
    assert chunk.tokens[2, :22].tolist() == rows[2].tokens[8:].tolist()
    # The cached row's table maps its whole prompt: the prefix block is read, not written.
    assert chunk.page_table[2, :4].tolist() == list(rows[2].block_ids[:4])
    check_plan(plan, rows, policy)


def test_packed_rules_share_read_only_prefix_blocks_inside_one_wave() -> None:
    policy = make_policy(wave_rules="packed")
    prefix = (100, 101)
    rows = [
        PrefillRow(
            source_row=i,
            tokens=torch.arange(1, 25, dtype=torch.int64) + 1000 * i,
            cached_tokens=16,
            slot=i,
            block_ids=(*prefix, 200 + i),
        )
        for i in range(3)
    ]
    plan = plan_prefill(rows=rows, policy=policy, env=NO_ENV)
    (req,) = plan.requests
    assert req.kind == "batched" and req.chunks[0].start_positions[:3].tolist() == [16] * 3
    assert req.chunks[0].token_start == 16 and req.chunks[0].token_end == 24
    check_plan(plan, rows, policy)


def test_packed_rules_split_a_large_bucket_into_full_waves() -> None:
    policy = make_policy(wave_rules="packed", max_batch_size=8)
    rows = make_rows([25 + (i % 7) for i in range(19)], policy=policy)  # all pad to 32
    plan = plan_prefill(rows=rows, policy=policy, env=NO_ENV)
    assert kinds(plan) == [
        ("batched", tuple(range(0, 8)), 8),
        ("batched", tuple(range(8, 16)), 8),
        ("batched", (16, 17, 18), 4),
    ]
    check_plan(plan, rows, policy)
    spec = plan_prefill(rows=rows, policy=make_policy(max_batch_size=8), env=NO_ENV)
    assert {r.sequential_reason for r in spec.requests} == {"max_batch_size"}


def test_ragged_rules_put_rows_of_any_length_in_one_wave_in_source_order() -> None:
    policy = make_policy(wave_rules="ragged", max_batch_size=4)
    # New lengths 3, 30, 17, 9, 20 (row 4 is cached): one wave of four, padded to the longest
    # of them; the fifth row alone; the 70-token row in chunks.
    rows = make_rows([3, 30, 17, 9, 28, 70], policy=policy, cached=[0, 0, 0, 0, 8, 0])
    plan = plan_prefill(rows=rows, policy=policy, env=NO_ENV)
    assert kinds(plan) == [
        ("batched", (0, 1, 2, 3), 4),
        ("chunked", (4,), 1),
        ("chunked", (5,), 1),
    ]
    wave = plan.requests[0]
    assert wave.padded_seq_len == policy.buckets.pad(30) == 32
    assert wave.seq_lens == (3, 30, 17, 9)
    assert wave.chunks[0].seq_lens.tolist() == [3, 30, 17, 9]
    check_plan(plan, rows, policy)
    # The same rows under packed rules: one wave per padded length at most.
    packed = plan_prefill(rows=rows, policy=make_policy(wave_rules="packed"), env=NO_ENV)
    waves = [r for r in packed.requests if r.kind == "batched"]
    assert waves and all(len(set(map(policy.buckets.pad, r.seq_lens))) == 1 for r in waves)


def test_ragged_rules_keep_the_global_fallbacks() -> None:
    policy = make_policy(wave_rules="ragged", batching_enabled=False)
    rows = make_rows([3, 30, 17], policy=policy)
    plan = plan_prefill(rows=rows, policy=policy, env=NO_ENV)
    assert kinds(plan) == [("single", (i,), 1) for i in (0, 2, 1)]
    assert {r.sequential_reason for r in plan.requests} <= {"disabled", None}
    one = make_policy(wave_rules="ragged", max_batch_size=1)
    assert kinds(plan_prefill(rows=rows, policy=one, env=NO_ENV)) == [
        ("single", (i,), 1) for i in range(3)
    ]


def test_packed_rules_keep_the_spec_fallbacks_where_no_wave_is_allowed() -> None:
    policy = make_policy(wave_rules="packed", max_batch_size=1)
    rows = make_rows([10, 11, 12], policy=policy)
    plan = plan_prefill(rows=rows, policy=policy, env=NO_ENV)
    assert kinds(plan) == [("single", (i,), 1) for i in range(3)]
    assert {r.sequential_reason for r in plan.requests} == {"max_batch_size"}
    disabled = make_policy(wave_rules="packed", batching_enabled=False)
    cached = make_rows([20, 30], policy=disabled, cached=[0, 8])
    plan = plan_prefill(rows=cached, policy=disabled, env=NO_ENV)
    assert kinds(plan) == [("single", (0,), 1), ("chunked", (1,), 1)]


def test_long_rows_are_chunked_not_batched() -> None:
    policy = make_policy()
    rows = make_rows([40, 45], policy=policy)  # both span two 32-token chunks
    plan = plan_prefill(rows=rows, policy=policy, env=NO_ENV)
    assert kinds(plan) == [("chunked", (0,), 1), ("chunked", (1,), 1)]
    assert {r.sequential_reason for r in plan.requests} == {"chunked"}
    check_plan(plan, rows, policy)


def big_policy(**overrides: Any) -> PrefillPlanPolicy:
    fields: dict[str, Any] = {
        "block_size": 64,
        "page_table_width": 64,
        "max_sequence_length": 4096,
        "max_chunk_size": 4096,
        "num_blocks": 4096,
        "bucket_step": 32,
    }
    fields.update(overrides)
    return make_policy(**fields)


@pytest.mark.parametrize(
    ("lengths", "kind", "product"),
    [
        ([4096] * 32, "single", 32 * 4096),  # == 128K -> sequential
        ([4096] * 17, "single", 32 * 4096),  # padded batch counts, not the 17 active rows
        ([4064] * 32, "batched", 32 * 4064),  # just under 128K -> one wave
        ([4096] * 16, "batched", 16 * 4096),
    ],
)
def test_token_limit_boundary(lengths: list[int], kind: str, product: int) -> None:
    policy = big_policy()
    rows = make_rows(lengths, policy=policy)
    plan = plan_prefill(rows=rows, policy=policy, env=NO_ENV)
    assert {r.kind for r in plan.requests} == {kind}
    padded = next(b for b in PREFILL_BATCH_SIZES if b >= len(lengths))
    assert padded * plan.requests[0].padded_seq_len == product
    if kind == "single":
        assert len(plan.requests) == len(lengths)
        assert {r.sequential_reason for r in plan.requests} == {"token_limit"}


def test_tile_buckets_use_powers_of_two_from_128() -> None:
    policy = big_policy(max_chunk_size=1024, bucket_kind="tile")
    rows = make_rows([100, 128, 129, 250, 600], policy=policy)
    plan = plan_prefill(rows=rows, policy=policy, env=NO_ENV)
    assert [(r.source_rows, r.padded_seq_len) for r in plan.requests] == [
        ((0, 1), 128),
        ((2, 3), 256),
        ((4,), 1024),
    ]
    check_plan(plan, rows, policy)


def test_fine_buckets_use_step_multiples() -> None:
    policy = big_policy(max_chunk_size=1024, bucket_kind="fine", bucket_step=32)
    rows = make_rows([100, 128, 129, 150, 600], policy=policy)
    plan = plan_prefill(rows=rows, policy=policy, env=NO_ENV)
    assert [(r.source_rows, r.padded_seq_len) for r in plan.requests] == [
        ((0, 1), 128),
        ((2, 3), 160),
        ((4,), 608),
    ]


# --- chunking and page tables -----------------------------------------------------------


def test_chunks_start_at_cached_offset_and_align_to_chunk_steps() -> None:
    policy = big_policy(block_size=16, max_chunk_size=64, bucket_step=8)
    (row,) = make_rows([200], policy=policy, cached=[32])
    (req,) = plan_prefill(rows=[row], policy=policy, env=NO_ENV).requests
    assert req.kind == "chunked"
    assert [(c.token_start, c.token_end, c.padded_len, c.is_last) for c in req.chunks] == [
        (32, 96, 64, False),
        (96, 160, 64, False),
        (160, 200, 40, True),
    ]
    assert req.last_token_indices == (39,)
    assert [int(c.page_table[0].ne(SKIP_BLOCK).sum()) for c in req.chunks] == [6, 10, 13]
    check_plan(PrefillPlan(requests=(req,)), [row], policy)


def test_cached_short_row_is_one_chunk_reading_the_prefix() -> None:
    policy = make_policy()
    (row,) = make_rows([20], policy=policy, cached=[16])
    (req,) = plan_prefill(rows=[row], policy=policy, env=NO_ENV).requests
    (chunk,) = req.chunks
    assert (req.kind, chunk.token_start, chunk.token_end, chunk.padded_len) == (
        "chunked",
        16,
        20,
        8,
    )
    assert chunk.tokens[0].tolist() == [17, 18, 19, 20, 0, 0, 0, 0]
    assert chunk.page_table[0, :4].tolist() == [0, 1, 2, SKIP_BLOCK]
    assert req.page_table[0, :4].tolist() == [0, 1, 2, CHUNKED_TABLE_FILLER]


def test_regular_tables_copy_only_the_covering_prefix() -> None:
    policy = make_policy()
    rows = [
        PrefillRow(source_row=0, tokens=torch.arange(10), slot=0, block_ids=(7, 3, 9, 11)),
        PrefillRow(source_row=1, tokens=torch.arange(12), slot=1, block_ids=(5, 6)),
    ]
    (req,) = plan_prefill(rows=rows, policy=policy, env=NO_ENV).requests
    assert req.page_table[:, :4].tolist() == [[7, 3, -1, -1], [5, 6, -1, -1]]
    assert req.page_table.shape == (2, policy.page_table_width)


def test_plan_does_not_alias_caller_tokens() -> None:
    policy = make_policy()
    rows = make_rows([10, 11, 40], policy=policy, cached=[0, 0, 8])
    plan = plan_prefill(rows=rows, policy=policy, env=NO_ENV)
    for row in rows:
        row.tokens.fill_(-5)
    assert all((c.tokens >= 0).all() for r in plan.requests for c in r.chunks)


def test_empty_call_is_an_empty_plan() -> None:
    plan = plan_prefill(rows=[], policy=make_policy(), env=NO_ENV)
    assert plan.requests == () and plan.source_order() == () and plan.num_rows == 0


# --- validation -------------------------------------------------------------------------


def _row(**overrides: Any) -> PrefillRow:
    fields: dict[str, Any] = {
        "source_row": 7,
        "tokens": torch.arange(1, 20),
        "slot": 2,
        "block_ids": (10, 11, 12),
    }
    fields.update(overrides)
    return PrefillRow(**fields)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"tokens": torch.zeros(0, dtype=torch.int64)}, "tokens"),
        ({"tokens": torch.zeros((2, 3), dtype=torch.int64)}, "tokens"),
        ({"tokens": torch.zeros(5)}, "tokens"),
        ({"tokens": torch.ones(5, dtype=torch.bool)}, "tokens"),
        ({"tokens": [1, 2, 3]}, "tokens"),
        ({"tokens": torch.arange(129), "block_ids": tuple(range(17))}, "tokens"),
        ({"cached_tokens": -8}, "cached_tokens"),
        ({"cached_tokens": 4}, "cached_tokens"),
        ({"cached_tokens": 24}, "cached_tokens"),
        ({"tokens": torch.arange(16), "block_ids": (1, 2), "cached_tokens": 16}, "cached_tokens"),
        ({"slot": -1}, "slot"),
        ({"slot": 64}, "slot"),
        ({"block_ids": (10, 11)}, "block_ids"),
        ({"block_ids": (10, -1, 12)}, "block_ids"),
        ({"block_ids": (10, 4096, 12)}, "block_ids"),
        ({"block_ids": (10, 11, 10)}, "block_ids"),
        ({"block_ids": (10, 11.0, 12)}, "block_ids"),
    ],
)
def test_row_validation_names_row_and_field(overrides: dict, field: str) -> None:
    policy = make_policy()
    with pytest.raises(RequestError, match=rf"^row 7: {field}: ") as info:
        plan_prefill(rows=[_row(**overrides)], policy=policy, env=NO_ENV)
    assert (info.value.row, info.value.field) == (7, field)


def test_prompt_beyond_page_table_capacity() -> None:
    policy = make_policy(max_sequence_length=1000, page_table_width=4)
    with pytest.raises(RequestError, match="page table") as info:
        plan_prefill(
            rows=[_row(tokens=torch.arange(33), block_ids=tuple(range(5)))],
            policy=policy,
            env=NO_ENV,
        )
    assert (info.value.row, info.value.field, info.value.value) == (7, "tokens", 33)


@pytest.mark.parametrize(
    ("second", "field"),
    [
        ({"source_row": 7, "slot": 3, "block_ids": (20, 21, 22)}, "source_row"),
        ({"source_row": 8, "slot": 2, "block_ids": (20, 21, 22)}, "slot"),
        ({"source_row": 8, "slot": 3, "block_ids": (20, 12, 22)}, "block_ids"),
    ],
)
def test_duplicates_across_rows_name_the_later_row(second: dict, field: str) -> None:
    with pytest.raises(RequestError) as info:
        plan_prefill(rows=[_row(), _row(**second)], policy=make_policy(), env=NO_ENV)
    assert (info.value.row, info.value.field) == (second["source_row"], field)
    if field != "source_row":
        assert "row 7" in info.value.reason


def test_negative_source_row_is_rejected() -> None:
    with pytest.raises(RequestError, match="source_row") as info:
        plan_prefill(rows=[_row(source_row=-1)], policy=make_policy(), env=NO_ENV)
    assert info.value.row == -1


def test_validation_precedes_construction() -> None:
    """A bad late row rejects the whole call: nothing is planned for the good rows."""
    policy = make_policy()
    rows = [*make_rows([10, 11], policy=policy, first_block=100), _row(slot=999)]
    with pytest.raises(RequestError, match="slot"):
        plan_prefill(rows=rows, policy=policy, env=NO_ENV)


# --- policy -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"block_size": 12}, "prefill_plan.block_size"),
        (
            {"max_chunk_size": 20, "buckets": SeqLenBuckets.fine(max_len=20, step=8)},
            "prefill_plan.max_chunk_size",
        ),
        ({"max_batch_size": 6}, "prefill_plan.max_batch_size"),
        ({"wave_rules": "loose"}, "prefill_plan.wave_rules"),
        ({"lane_capacity": 0}, "prefill_plan.lane_capacity"),
        ({"batching_enabled": 1}, "prefill_plan.batching_enabled"),
        ({"buckets": SeqLenBuckets.tile(max_len=64)}, "prefill_plan.buckets.max_len"),
    ],
)
def test_policy_rejects(overrides: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}: "):
        make_policy(**overrides)


def test_policy_from_layout() -> None:
    layout = PageTableLayout.resolve(
        block_size=32,
        model_max_sequence_length=2048,
        physical_num_blocks=40,
        max_prefill_chunk_size=512,
    )
    policy = PrefillPlanPolicy.from_layout(
        layout,
        batching_supported=True,
        batching_enabled=True,
        max_batch_size=8,
        lane_capacity=16,
        model_extracts_batched_outputs=False,
        buckets="fine",
        bucket_step=64,
    )
    assert (policy.block_size, policy.page_table_width, policy.num_blocks) == (32, 40, 40)
    assert (policy.max_sequence_length, policy.max_chunk_size) == (1280, 512)
    assert policy.buckets == SeqLenBuckets.fine(max_len=512, step=64)
    tile = PrefillPlanPolicy.from_layout(
        layout,
        batching_supported=False,
        batching_enabled=True,
        max_batch_size=1,
        lane_capacity=1,
        model_extracts_batched_outputs=False,
    )
    assert tile.buckets == SeqLenBuckets.tile(max_len=512)


# --- planner cost (not a test: run this file as a script) -------------------------------


def bench_planner(n_rows: int, *, seed: int = 0, repeat: int = 3, gc_enabled: bool = True) -> float:
    """Best-of-``repeat`` CPU seconds per row to plan ``n_rows`` mixed prompts.

    Prompts have 1-256 tokens (half longer than the 128-token chunk), ~10% carry a
    cached prefix; rows arrive shuffled. ``gc_enabled=False`` isolates the planner's
    own work from the interpreter's cyclic garbage collector.
    """
    rng = random.Random(seed)
    policy = make_policy(
        block_size=16,
        page_table_width=32,
        max_sequence_length=512,
        max_chunk_size=128,
        num_blocks=n_rows * 32,
        lane_capacity=n_rows,
        bucket_kind="fine",
        bucket_step=32,
    )
    rows, block = [], 0
    for i in range(n_rows):
        n = rng.randint(1, 256)
        need = math.ceil(n / 16)
        cached = 16 * rng.randint(0, (n - 1) // 16) if rng.random() < 0.1 else 0
        rows.append(
            PrefillRow(
                source_row=i,
                tokens=torch.randint(0, 1000, (n,)),
                cached_tokens=cached,
                slot=i,
                block_ids=tuple(range(block, block + need)),
            )
        )
        block += need
    rng.shuffle(rows)
    plan_prefill(rows=rows[:64], policy=policy, env=NO_ENV)  # warm torch's dispatch paths
    best = math.inf
    for _ in range(repeat):
        gc.collect()
        if not gc_enabled:
            gc.disable()
        try:
            start = time.process_time()
            plan = plan_prefill(rows=rows, policy=policy, env=NO_ENV)
            best = min(best, time.process_time() - start)
        finally:
            gc.enable()
        del plan
    return best / n_rows


if __name__ == "__main__":
    torch.set_num_threads(1)
    sizes = [int(a) for a in sys.argv[1:]] or [1_000, 10_000, 100_000]
    for gc_on in (True, False):
        for size in sizes:
            cost = bench_planner(size, gc_enabled=gc_on)
            print(f"gc={gc_on!s:5} rows={size:>7}: {cost * 1e6:7.1f} us/row")


def test_waves_only_use_warmed_sizes_and_lengths() -> None:
    """A wave rounds up to the next warmed size and never exceeds the warmed wave length."""
    layout = PageTableLayout.resolve(
        block_size=16, model_max_sequence_length=512, physical_num_blocks=64,
        max_prefill_chunk_size=128,
    )
    policy = PrefillPlanPolicy.from_layout(
        layout, batching_supported=True, batching_enabled=True, max_batch_size=8,
        lane_capacity=8, model_extracts_batched_outputs=True, buckets="fine", bucket_step=32,
        wave_batch_sizes=(1, 4), max_wave_seq_len=32,
    )

    def rows(lengths: list[int]) -> list[PrefillRow]:
        out, block = [], 0
        for i, n in enumerate(lengths):
            blocks = tuple(range(block, block + -(-n // 16)))
            block += len(blocks)
            out.append(PrefillRow(source_row=i, tokens=torch.arange(n) % 50, slot=i,
                                  block_ids=blocks))
        return out

    short = plan_prefill(rows=rows([20, 30]), policy=policy)
    assert [(r.kind, r.padded_batch_size) for r in short.requests] == [("batched", 4)]
    longer = plan_prefill(rows=rows([40, 50]), policy=policy)
    assert [r.kind for r in longer.requests] == ["single", "single"]
    assert {r.sequential_reason for r in longer.requests} == {"wave_seq_len"}


def test_rows_may_share_cached_prefix_blocks_but_not_written_ones() -> None:
    """Prefix-cache hits share read-only blocks; a block some row writes stays exclusive."""
    layout = PageTableLayout.resolve(
        block_size=16, model_max_sequence_length=512, physical_num_blocks=64,
        max_prefill_chunk_size=128,
    )
    policy = PrefillPlanPolicy.from_layout(
        layout, batching_supported=True, batching_enabled=True, max_batch_size=8,
        lane_capacity=8, model_extracts_batched_outputs=True, buckets="fine", bucket_step=32,
    )
    prefix = torch.arange(32)
    a = PrefillRow(source_row=0, tokens=torch.cat([prefix, torch.tensor([1, 2])]),
                   cached_tokens=32, slot=0, block_ids=(0, 1, 2))
    b = PrefillRow(source_row=1, tokens=torch.cat([prefix, torch.tensor([3])]),
                   cached_tokens=32, slot=1, block_ids=(0, 1, 3))
    plan = plan_prefill(rows=[a, b], policy=policy)
    assert sorted(r for req in plan.requests for r in req.source_rows) == [0, 1]
    writes_shared = attrs.evolve(b, block_ids=(0, 1, 2))
    with pytest.raises(RequestError) as info:
        plan_prefill(rows=[a, writes_shared], policy=policy)
    assert info.value.row == 1 and info.value.field == "block_ids"
    reads_written = PrefillRow(source_row=1, tokens=torch.arange(40), cached_tokens=32, slot=1,
                               block_ids=(2, 5, 6))
    with pytest.raises(RequestError, match="also allocated to row 0"):
        plan_prefill(rows=[a, reads_written], policy=policy)
