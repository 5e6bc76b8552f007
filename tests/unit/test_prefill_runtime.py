"""Prefill runtime numerics and request validation on a tiny random Llama lane.

Batched waves, sequential single rows, small-chunk chunked prefill and prefix-cached
prefill must agree on last-token logits (<= 1e-4, float32) and on the KV they write for
active rows; KV slots no active row owns stay bit-for-bit unchanged. Bad requests raise a
``RequestError`` naming the row and field before any upload or KV write. The module lane runs
on every torch device (the plugin's ``torch_device``: cuda where a GPU is present).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lane_fixtures import (  # noqa: F401 (single_torch_thread: autouse)
    Lane,
    assert_unchanged_outside,
    build_lane,
    make_rows,
    page_table,
    prompt,
    run_prefill,
    single_torch_thread,
    written_mask,
)

from llmrt.errors import KVCacheStateError, RequestError
from llmrt.runtime.paged_kv_cache import PagedKVCacheManager
from llmrt.runtime.prefill.plan import PrefillRow
from llmrt.runtime.prefill.result_collector import PrefillOutput
from llmrt.runtime.prefill.runtime import PrefillRuntime
from llmrt.sampling.params import SamplingParams

TOL = 1e-4
BS = 4
NUM_BLOCKS = 96
MAX_LEN = 44  # > the lane's 32-token chunk: long prompts are chunked in every mode
SMALL_CHUNK = 8


@attrs.frozen
class Mix:
    prompts: tuple[tuple[int, ...], ...]
    blocks: tuple[tuple[int, ...], ...]
    cached: tuple[int, ...]

    def rows(self, *, cached: bool = False) -> list[PrefillRow]:
        return make_rows(self.prompts, self.blocks, cached=self.cached if cached else None)

    def written(self, *, prefix_only: bool = False) -> torch.Tensor:
        spans = [
            (b, c if prefix_only else len(p))
            for p, b, c in zip(self.prompts, self.blocks, self.cached, strict=True)
        ]
        return written_mask(spans, num_blocks=NUM_BLOCKS, block_size=BS)


@st.composite
def mixes(draw: st.DrawFn) -> Mix:
    lengths = draw(st.lists(st.integers(1, MAX_LEN), min_size=1, max_size=5))
    seed = draw(st.integers(0, 2**20))
    order = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    prompts, blocks, cached = [], [], []
    for i, n in enumerate(lengths):
        prompts.append(tuple(prompt(n, seed=seed + i)))
        need = -(-n // BS) + draw(st.integers(0, 1))  # sometimes a spare trailing block
        blocks.append(tuple(order[:need]))
        order = order[need:]
        cached.append(BS * draw(st.integers(0, (n - 1) // BS)))
    return Mix(prompts=tuple(prompts), blocks=tuple(blocks), cached=tuple(cached))


@pytest.fixture(scope="module")
def lane(torch_device: str) -> Iterator[Lane]:
    lane = build_lane(
        num_blocks=NUM_BLOCKS,
        block_size=BS,
        max_chunk=32,
        lane_capacity=8,
        torch_device=torch_device,
    )
    yield lane
    lane.cleanup()
    assert lane.live_tensors() == lane.baseline_live


@pytest.fixture(scope="module")
def runtimes(lane: Lane) -> dict[str, PrefillRuntime]:
    return {
        "sequential": lane.prefill_runtime(batching_enabled=False),
        "chunked": lane.prefill_runtime(max_chunk=SMALL_CHUNK),
    }


def _reference(lane: Lane, mix: Mix, init: Sequence[torch.Tensor]) -> tuple[Any, list[Any]]:
    """Every row prefilled alone, in its own call: logits [rows, V] and the resulting KV."""
    lane.restore(init)
    logits = []
    for i, row in enumerate(mix.rows()):
        alone = attrs.evolve(row, source_row=0, slot=0)
        out = lane.executor.prefill_forward(rows=[alone])
        assert out.logits is not None and out.logits.shape == (1, lane.vocab_size), i
        logits.append(out.logits[0])
    return torch.stack(logits), lane.snapshot()


def _check(
    lane: Lane,
    mode: str,
    out: PrefillOutput,
    *,
    ref_logits: torch.Tensor,
    ref_kv: Sequence[torch.Tensor],
    init: Sequence[torch.Tensor],
    mask: torch.Tensor,
) -> None:
    assert out.logits is not None and out.tokens is None
    assert out.logits.dtype == torch.float32
    diff = (out.logits - ref_logits).abs().max().item()
    assert diff <= TOL, f"{mode}: last-token logits differ by {diff:.3g}"
    after = lane.snapshot()
    assert_unchanged_outside(init, after, mask)
    for index, (got, want) in enumerate(zip(after, ref_kv, strict=True)):
        kv_diff = (got - want).abs().max().item()
        assert kv_diff <= TOL, f"{mode}: KV tensor {index} differs by {kv_diff:.3g}"


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(mix=mixes())
def test_batched_sequential_chunked_and_prefix_cached_prefill_agree(
    lane: Lane, runtimes: dict[str, PrefillRuntime], mix: Mix
) -> None:
    init = lane.snapshot()
    ref_logits, ref_kv = _reference(lane, mix, init)
    mask = mix.written()
    assert_unchanged_outside(init, ref_kv, mask)
    assert torch.isfinite(ref_logits).all()
    # A real prefill changes every slot it owns (the KV was random before).
    changed = (init[0] != ref_kv[0]).any(dim=3).any(dim=1)
    assert torch.equal(changed.cpu(), mask)

    check = {"ref_logits": ref_logits, "ref_kv": ref_kv, "init": init, "mask": mask}

    lane.restore(init)
    _check(lane, "batched", lane.executor.prefill_forward(rows=mix.rows()), **check)

    for mode, runtime in runtimes.items():
        lane.restore(init)
        _check(lane, mode, run_prefill(runtime, mix.rows()), **check)

    # Prefix caching: prefill each row's cached prefix first, then the whole prompt with
    # cached_tokens > 0 on the same blocks (only the suffix is computed).
    lane.restore(init)
    prefix_rows = [
        PrefillRow(
            source_row=i,
            tokens=torch.tensor(p[:c]),
            slot=i,
            block_ids=tuple(b[: c // BS]),
        )
        for i, (p, b, c) in enumerate(zip(mix.prompts, mix.blocks, mix.cached, strict=True))
        if c
    ]
    if prefix_rows:
        lane.executor.prefill_forward(
            rows=[attrs.evolve(r, source_row=j) for j, r in enumerate(prefix_rows)]
        )
        assert_unchanged_outside(init, lane.snapshot(), mix.written(prefix_only=True))
    _check(
        lane, "prefix-cached", lane.executor.prefill_forward(rows=mix.rows(cached=True)), **check
    )
    lane.restore(init)


def test_modes_really_differ_in_their_plans(
    lane: Lane, runtimes: dict[str, PrefillRuntime]
) -> None:
    """The agreement test is only meaningful if the modes plan differently."""
    prompts = [prompt(n, seed=n) for n in (5, 7, 3, 20)]
    blocks = [[0, 1], [2, 3], [4], [5, 6, 7, 8, 9]]
    rows = make_rows(prompts, blocks)
    batched = lane.prefill.prepare(rows=rows).plan
    kinds = sorted((r.kind, r.active_batch_size, r.padded_batch_size) for r in batched.requests)
    assert kinds == [("batched", 3, 4), ("single", 1, 1)]
    sequential = runtimes["sequential"].prepare(rows=rows).plan
    assert [r.kind for r in sequential.requests] == ["single"] * 4
    assert {r.sequential_reason for r in sequential.requests} == {"disabled", None}
    chunked = runtimes["chunked"].prepare(rows=rows).plan
    long = [r for r in chunked.requests if r.source_rows == (3,)]
    assert long[0].kind == "chunked" and len(long[0].chunks) == 3
    cached_rows = make_rows(prompts, blocks, cached=[4, 4, 0, 16])
    cached = lane.prefill.prepare(rows=cached_rows).plan
    assert [r.chunks[0].start_pos for r in cached.requests if r.kind == "chunked"] == [4, 4, 16]


def test_env_switch_disables_batching_with_identical_results(
    lane: Lane, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [prompt(n, seed=100 + n) for n in (9, 11, 12, 14)]  # one 16-token bucket
    blocks = [[10, 11, 12], [13, 14, 15], [16, 17, 18], [19, 20, 21, 22]]
    rows = make_rows(prompts, blocks)
    init = lane.snapshot()
    assert [r.kind for r in lane.prefill.prepare(rows=rows).plan.requests] == ["batched"]
    batched = lane.executor.prefill_forward(rows=rows)
    batched_kv = lane.snapshot()

    monkeypatch.setenv("DISABLE_BATCHED_PREFILL", "1")
    plan = lane.prefill.prepare(rows=rows).plan
    assert [(r.kind, r.sequential_reason) for r in plan.requests] == [
        ("single", "env_disabled")
    ] * 4
    lane.restore(init)
    sequential = lane.executor.prefill_forward(rows=rows)
    assert batched.logits is not None and sequential.logits is not None
    assert (batched.logits - sequential.logits).abs().max() <= TOL
    for got, want in zip(lane.snapshot(), batched_kv, strict=True):
        assert (got - want).abs().max() <= TOL
    lane.restore(init)


def test_results_come_back_in_source_row_order(lane: Lane) -> None:
    """Rows plan into several requests out of source order; outputs are in source order."""
    lengths = (30, 3, 17, 4, 40)
    prompts = [prompt(n, seed=200 + n) for n in lengths]
    blocks, next_block = [], 30
    for n in lengths:
        need = -(-n // BS)
        blocks.append(list(range(next_block, next_block + need)))
        next_block += need
    rows = make_rows(prompts, blocks, slots=[4, 0, 3, 1, 2])
    init = lane.snapshot()
    plan = lane.prefill.prepare(rows=rows).plan
    assert [r.source_rows for r in plan.requests] != [(i,) for i in range(5)]
    out = lane.executor.prefill_forward(rows=rows)
    assert out.logits is not None
    for i, row in enumerate(rows):
        lane.restore(init)
        alone = lane.executor.prefill_forward(rows=[attrs.evolve(row, source_row=0, slot=0)])
        assert alone.logits is not None
        assert (out.logits[i] - alone.logits[0]).abs().max() <= TOL, f"row {i}"
    lane.restore(init)


def test_greedy_sampling_returns_the_argmax_of_the_logits(lane: Lane) -> None:
    prompts = [prompt(n, seed=300 + n) for n in (5, 9, 13)]
    rows = make_rows(prompts, [[40, 41], [42, 43, 44], [45, 46, 47, 48]])
    init = lane.snapshot()
    logits = lane.executor.prefill_forward(rows=rows).logits
    lane.restore(init)
    greedy = lane.executor.prefill_forward(rows=rows, sampling_params=SamplingParams(temperature=0))
    assert greedy.logits is None and greedy.tokens is not None
    assert logits is not None
    assert greedy.tokens.tolist() == logits.argmax(dim=-1).tolist()
    lane.restore(init)


def test_greedy_rows_with_penalties_apply_them_to_the_prompt_history(lane: Lane) -> None:
    """vLLM applies penalties before the greedy argmax: a penalised top token must lose."""
    prompts = [prompt(n, seed=310 + n) for n in (5, 9)]
    rows = make_rows(prompts, [[40, 41], [42, 43, 44]])
    init = lane.snapshot()
    logits = lane.executor.prefill_forward(rows=rows).logits
    assert logits is not None
    top = logits.argmax(dim=-1).tolist()
    history = [([top[0]], []), ([], [top[1], top[1]])]
    params = [
        SamplingParams(temperature=0, repetition_penalty=50.0),
        SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0),
    ]
    lane.restore(init)
    out = lane.executor.prefill_forward(rows=rows, sampling_params=params, history=history)
    assert out.tokens is not None
    want = logits.clone()
    t0 = top[0]
    want[0, t0] = want[0, t0] / 50.0 if want[0, t0] > 0 else want[0, t0] * 50.0
    want[1, top[1]] -= 2.0 + 2.0 * 2
    assert out.tokens.tolist() == want.argmax(dim=-1).tolist()
    assert out.tokens.tolist() != top, "the penalties must move at least one row"
    lane.restore(init)


# -- bad input: a clear error naming row and field, before any upload or KV write --------


def _rejects(
    lane: Lane, call: Any, *, field: str, row: int | None, match: str | None = None
) -> RequestError:
    before = lane.snapshot()
    allocations = lane.inner.stats().allocations
    with pytest.raises(RequestError, match=match) as exc:
        call()
    err = exc.value
    assert err.field == field, str(err)
    assert err.row == row, str(err)
    assert field in str(err)
    if row is not None:
        assert str(err).startswith(f"row {row}: {field}:"), str(err)
    assert lane.inner.stats().allocations == allocations, "no upload may happen"
    for old, new in zip(before, lane.snapshot(), strict=True):
        assert torch.equal(old, new), "no KV write may happen"
    return err


def _good_and(bad: PrefillRow) -> list[PrefillRow]:
    """A valid row 0 ahead of the bad row, so a late check would already have written KV."""
    good = make_rows([prompt(6, seed=1)], [[50, 51]])[0]
    return [good, bad]


def _row(n: int = 6, **overrides: Any) -> PrefillRow:
    fields: dict[str, Any] = {
        "source_row": 1,
        "tokens": torch.tensor(prompt(n, seed=2)),
        "slot": 1,
        "block_ids": tuple(range(60, 60 + -(-n // BS))),
    }
    fields.update(overrides)
    return PrefillRow(**fields)


@pytest.mark.parametrize(
    ("bad", "field", "match"),
    [
        (_row(block_ids=(60, NUM_BLOCKS)), "block_ids", rf"\[0, {NUM_BLOCKS}\).*got {NUM_BLOCKS}"),
        (_row(block_ids=(60, -1)), "block_ids", "got -1"),
        (_row(block_ids=(60,)), "block_ids", "too few blocks"),
        (_row(block_ids=(60, 50)), "block_ids", "also allocated to row 0"),
        (_row(tokens=torch.tensor([], dtype=torch.int64), block_ids=()), "tokens", "empty"),
        (_row(tokens=torch.ones(257, dtype=torch.int64)), "tokens", "max_sequence_length"),
        (_row(tokens=torch.tensor([1.0, 2.0]), block_ids=(60,)), "tokens", "integer"),
        (_row(slot=8), "slot", r"\[0, 8\).*got 8"),
        (_row(slot=-1), "slot", "got -1"),
        (_row(slot=0), "slot", "already used by row 0"),
        (_row(cached_tokens=2), "cached_tokens", "multiple of block_size"),
        (_row(n=8, cached_tokens=8), "cached_tokens", "less than the prompt length"),
        (_row(cached_tokens=-4), "cached_tokens", "non-negative"),
    ],
)
def test_bad_rows_are_rejected_before_any_kv_write(
    lane: Lane, bad: PrefillRow, field: str, match: str
) -> None:
    rows = _good_and(bad)
    _rejects(
        lane, lambda: lane.executor.prefill_forward(rows=rows), field=field, row=1, match=match
    )


def test_prompt_over_the_page_table_capacity_is_rejected(lane: Lane) -> None:
    """A lane whose physical cache holds fewer tokens than the model's context."""
    small = build_lane(
        model=lane.model,
        num_blocks=8,
        block_size=BS,
        max_chunk=16,
        torch_device=str(lane.inner.torch_device),
    )
    try:
        assert small.layout.max_sequence_length == 32
        bad = _row(n=33, block_ids=tuple(range(8)))
        _rejects(
            small,
            lambda: small.executor.prefill_forward(rows=[bad]),
            field="tokens",
            row=1,
            match="longer than max_sequence_length=32",
        )
    finally:
        small.cleanup()
        lane.kv.borrowed_model.set_kv_cache(lane.context)


def test_source_rows_must_number_the_call_rows(lane: Lane) -> None:
    rows = _good_and(attrs.evolve(_row(), source_row=5))
    _rejects(
        lane,
        lambda: lane.executor.prefill_forward(rows=rows),
        field="source_row",
        row=5,
        match=r"0\.\.1",
    )


def test_negative_step_offsets_are_rejected(lane: Lane) -> None:
    rows = _good_and(_row())
    seeded = SamplingParams(temperature=1.0, seed=3)
    _rejects(
        lane,
        lambda: lane.executor.prefill_forward(
            rows=rows, sampling_params=seeded, step_offsets=[0, -2]
        ),
        field="step_offsets",
        row=1,
        match="got -2",
    )


def test_out_of_vocab_tokens_are_rejected(lane: Lane) -> None:
    table = page_table([[50, 51], [60, 61]], width=4)
    tokens = [prompt(6, seed=1), [1, 2, lane.vocab_size]]
    _rejects(
        lane,
        lambda: lane.executor.prefill_forward(
            rows=lane.prefill.rows_from_batch(tokens=tokens, page_table=table)
        ),
        field="tokens",
        row=1,
        match="out of range",
    )


@pytest.mark.parametrize(
    ("lens", "row", "match"),
    [([6, 0], 1, r"\[1, 6\].*got 0"), ([-2, 6], 0, "got -2"), ([6, 7], 1, "got 7")],
)
def test_batch_lengths_must_be_positive_and_fit_the_tokens(
    lane: Lane, lens: list[int], row: int, match: str
) -> None:
    tokens = torch.tensor([prompt(6, seed=1), prompt(6, seed=2)])
    table = page_table([[50, 51], [60, 61]], width=4)
    _rejects(
        lane,
        lambda: lane.prefill.rows_from_batch(tokens=tokens, page_table=table, prompt_lens=lens),
        field="prompt_lens",
        row=row,
        match=match,
    )


def test_lengths_that_disagree_with_token_lists_are_rejected(lane: Lane) -> None:
    tokens = [prompt(6, seed=1), prompt(5, seed=2)]
    table = page_table([[50, 51], [60, 61]], width=4)
    _rejects(
        lane,
        lambda: lane.prefill.rows_from_batch(tokens=tokens, page_table=table, prompt_lens=[6, 6]),
        field="prompt_lens",
        row=1,
        match="disagrees with the 5 tokens",
    )
    _rejects(
        lane,
        lambda: lane.prefill.rows_from_batch(tokens=tokens, page_table=table, prompt_lens=[6]),
        field="prompt_lens",
        row=None,
        match="1 entries for 2 prompts",
    )


def test_unmapped_page_table_entries_and_slots_from_a_batch_are_rejected(lane: Lane) -> None:
    tokens = [prompt(6, seed=1), prompt(6, seed=2)]
    unmapped = page_table([[50, 51], [60]], width=4)  # row 1 needs 2 blocks, has one
    _rejects(
        lane,
        lambda: lane.executor.prefill_forward(
            rows=lane.prefill.rows_from_batch(tokens=tokens, page_table=unmapped)
        ),
        field="block_ids",
        row=1,
        match="got -1",
    )
    table = page_table([[50, 51], [60, 61]], width=4)
    _rejects(
        lane,
        lambda: lane.executor.prefill_forward(
            rows=lane.prefill.rows_from_batch(tokens=tokens, page_table=table, slots=[0, 9])
        ),
        field="slot",
        row=1,
        match="got 9",
    )


def test_foreign_kv_handle_is_rejected_and_the_lane_keeps_its_kv(lane: Lane) -> None:
    before = lane.snapshot()
    other = PagedKVCacheManager(model=lane.model, device=lane.device, config=lane.kv.config)
    assert lane.kv.validate_handle(lane.context) is lane.context
    with pytest.raises(KVCacheStateError, match="foreign KV cache handle"):
        lane.kv.validate_handle(attrs.evolve(lane.context))
    with pytest.raises(KVCacheStateError, match="not bound"):
        other.validate_handle(lane.context)
    for old, new in zip(before, lane.snapshot(), strict=True):
        assert torch.equal(old, new)
    other.release()
