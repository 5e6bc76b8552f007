"""Data-parallel lanes built by the container: routing, source order, parity with one lane."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch

from llmrt.errors import CompileGateClosed, RequestError, UnsupportedError
from llmrt.runtime.decode import DecodeOutput
from llmrt.runtime.lane_group import LaneGroupHost, LaneGroupLease
from llmrt.runtime.model_executor import ModelExecutor
from llmrt.runtime.prefill.plan import PrefillRow
from llmrt.sampling.params import SamplingParams
from llmrt.testing.devices import recipe_overrides

GREEDY = SamplingParams(temperature=0.0)
Runtime = Any  # conftest's Runtime

#: Lengths whose prefill geometries the tiny recipes warm up: 10 and 20 pad to 32 (a
#: batched wave), 33 and 70 pad to 64 and 96 (one row each).
PROMPTS = [
    [(3 * i + 1) % 250 + 1 for i in range(10)],
    [(5 * i + 2) % 250 + 1 for i in range(33)],
    [(7 * i + 3) % 250 + 1 for i in range(20)],
    [(11 * i + 4) % 250 + 1 for i in range(70)],
]
#: Global slots interleaving the requests across two lanes of 4 slots: lanes 0, 1, 0, 1.
INTERLEAVED = [0, 5, 1, 6]


def _on(torch_device: str) -> list[str]:
    return [f"{key}={value}" for key, value in recipe_overrides(torch_device).items()]


@pytest.fixture(scope="module")
def one_lane(module_build: Callable[..., Runtime], torch_device: str) -> Runtime:
    """Shared by the module: every test writes each KV block it later reads. On every torch
    device (the plugin's ``torch_device``)."""
    return module_build("tiny-llama", _on(torch_device)).ready()


@pytest.fixture(scope="module")
def two_lanes(module_build: Callable[..., Runtime], torch_device: str) -> Runtime:
    return module_build("tiny-llama", ["lanes=2", *_on(torch_device)]).ready()


def _rows(runtime: Runtime, slots: list[int], *, steps: int = 0) -> list[PrefillRow]:
    blocks = runtime.blocks_for(PROMPTS, slots, steps)
    bs = runtime.block_size
    return [
        PrefillRow(
            source_row=i,
            tokens=torch.tensor(p),
            slot=slot,
            block_ids=ids[: -(-len(p) // bs)],
        )
        for i, (p, slot, ids) in enumerate(zip(PROMPTS, slots, blocks, strict=True))
    ]


def test_two_lanes_give_the_tokens_of_one_lane(one_lane: Runtime, two_lanes: Runtime) -> None:
    single = one_lane.generate(PROMPTS, slots=[0, 1, 2, 3], steps=5, with_logits=True)
    split = two_lanes.generate(PROMPTS, slots=INTERLEAVED, steps=5, with_logits=True)

    assert split.tokens == single.tokens
    torch.testing.assert_close(split.prefill_logits, single.prefill_logits, atol=1e-5, rtol=1e-5)
    assert len({tuple(t) for t in single.tokens}) == len(PROMPTS)  # distinct requests


def test_rows_route_by_slot_with_lane_local_slots_and_come_back_in_source_order(
    one_lane: Runtime, two_lanes: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[int, list[tuple[int, int, int]]] = {}
    for index, lane in enumerate(two_lanes.group.lanes):

        def spy(*, rows: list[PrefillRow], _lane: ModelExecutor = lane, _i: int = index, **kw: Any):
            seen[_i] = [(r.source_row, r.slot, r.tokens.numel()) for r in rows]
            return ModelExecutor.prepare_prefill(_lane, rows=rows, **kw)

        monkeypatch.setattr(lane, "prepare_prefill", spy)

    out = two_lanes.group.prefill_forward(rows=_rows(two_lanes, INTERLEAVED))
    reference = one_lane.group.prefill_forward(rows=_rows(one_lane, [0, 1, 2, 3]))

    # Requests 0 and 2 go to lane 0 (slots 0, 1); 1 and 3 to lane 1 (global 5, 6 -> local 1, 2).
    assert seen == {0: [(0, 0, 10), (1, 1, 20)], 1: [(0, 1, 33), (1, 2, 70)]}
    assert out.logits is not None and reference.logits is not None
    torch.testing.assert_close(out.logits, reference.logits, atol=1e-5, rtol=1e-5)
    # Every row is its own request's result, in the caller's order.
    for row in _rows(one_lane, [0, 1, 2, 3]):
        alone = one_lane.group.prefill_forward(rows=[attrs.evolve(row, source_row=0, slot=0)])
        assert alone.logits is not None
        torch.testing.assert_close(alone.logits[0], out.logits[row.source_row], atol=1e-5, rtol=0)


def test_decode_on_the_second_lane_only_lands_at_its_global_slots(
    one_lane: Runtime, two_lanes: Runtime
) -> None:
    """Lane 0 has no live row and is skipped; lane 1's rows keep their global slots."""
    prompts = PROMPTS[1:3]
    single = one_lane.generate(prompts, slots=[0, 1], steps=3)
    split = two_lanes.generate(prompts, slots=[6, 5], steps=3)

    assert split.tokens == single.tokens


def test_each_lane_decodes_at_the_smallest_batch_holding_its_live_rows(
    one_lane: Runtime, two_lanes: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One request at the first slot of each lane: the group passes a full slot batch for
    lane 0, but both lanes run batch-1 steps (trailing padding rows are cut)."""
    batches: list[tuple[int, int]] = []
    for index, lane in enumerate(two_lanes.group.lanes):
        prepare = lane.decode.prepare

        def spy(*, _prepare: Any = prepare, _i: int = index, **kw: Any) -> Any:
            prepared = _prepare(**kw)
            batches.append((_i, prepared.signature.batch_size))
            return prepared

        monkeypatch.setattr(lane.decode, "prepare", spy)
    prompts = PROMPTS[:2]
    cap = two_lanes.group.lane_capacity
    single = one_lane.generate(prompts, slots=[0, 1], steps=3)
    split = two_lanes.generate(prompts, slots=[0, cap], steps=3)
    assert split.tokens == single.tokens
    assert batches and set(batches) == {(0, 1), (1, 1)}


def test_async_decode_read_is_one_contract_over_both_lanes(two_lanes: Runtime) -> None:
    group = two_lanes.group
    rows = _rows(two_lanes, INTERLEAVED, steps=1)
    first = group.prefill_forward(rows=rows, sampling_params=GREEDY)
    assert first.tokens is not None
    width = group.lanes[0].layout.width
    tokens = torch.zeros(8, dtype=torch.int64)
    positions = torch.zeros(8, dtype=torch.int32)
    table = torch.full((8, width), -1, dtype=torch.int32)
    blocks = two_lanes.blocks_for(PROMPTS, INTERLEAVED, 1)
    for i, slot in enumerate(INTERLEAVED):
        tokens[slot] = first.tokens[i]
        positions[slot] = len(PROMPTS[i])
        table[slot, : len(blocks[i])] = torch.tensor(blocks[i])
    params: list[SamplingParams | None] = [GREEDY] * 8

    lease = group.decode_forward(
        tokens=tokens,
        start_pos=positions,
        page_table=table,
        sampling_params=params,
        read_from_device=False,
    )
    assert isinstance(lease, LaneGroupLease) and len(lease.leases) == 2 and lease.rows == 8
    host, events = group.read_decode_output(lease, async_read=True)
    assert isinstance(host, LaneGroupHost) and [i for i, _ in host.values] == [0, 1]
    assert len(events) == 2  # one completion event per lane, started together
    leased = group.process_decode_output_host(host, is_tokens=True)
    synchronous = group.decode_forward(
        tokens=tokens, start_pos=positions, page_table=table, sampling_params=params
    )

    assert isinstance(synchronous, DecodeOutput)
    assert leased.tokens is not None and synchronous.tokens is not None
    assert torch.equal(leased.tokens[INTERLEAVED], synchronous.tokens[INTERLEAVED])
    assert all(lane.decode.outstanding_leases == 0 for lane in group.lanes)


def test_data_parallel_logprobs_are_rejected_explicitly(two_lanes: Runtime) -> None:
    group = two_lanes.group
    wanted = SamplingParams(temperature=0.0, logprobs=1)

    with pytest.raises(UnsupportedError, match="data-parallel lanes"):
        group.prefill_forward(rows=_rows(two_lanes, INTERLEAVED), sampling_params=wanted)
    with pytest.raises(UnsupportedError, match="data-parallel lanes"):
        group.decode_forward(
            tokens=[1],
            start_pos=[0],
            page_table=torch.zeros((1, 1), dtype=torch.int32),
            sampling_params=[wanted],
        )


def test_every_participating_lane_is_preflighted_before_any_runs(
    two_lanes: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = two_lanes.group.lanes
    before = [t.clone() for t in first.kv_cache.context.keys]
    runs: list[int] = []

    def closed(signature: Any) -> None:
        raise CompileGateClosed("key", signature.describe())

    def invoke(*args: Any, **kwargs: Any) -> Any:
        runs.append(1)
        raise AssertionError("lane 0 ran before lane 1 was preflighted")

    monkeypatch.setattr(second.eager.program_compiler, "check_runnable", closed)
    monkeypatch.setattr(first.prefill, "invoke", invoke)

    with pytest.raises(CompileGateClosed):
        two_lanes.group.prefill_forward(rows=_rows(two_lanes, INTERLEAVED))

    assert runs == []
    assert all(torch.equal(a, b) for a, b in zip(before, first.kv_cache.context.keys, strict=True))


def test_a_slot_outside_every_lane_is_rejected(two_lanes: Runtime) -> None:
    rows = _rows(two_lanes, [0, 5, 1, 8])

    with pytest.raises(RequestError, match=r"row 3: slots: slot out of range \[0, 8\), got 8"):
        two_lanes.group.prefill_forward(rows=rows)


@pytest.mark.parametrize(
    ("table", "match"),
    [
        (torch.zeros(2, dtype=torch.int32), r"page_table: must be \[2, width\]"),
        (torch.zeros(2, 4, dtype=torch.bfloat16), "must be integer tensors"),
        (torch.zeros(2, 4, dtype=torch.float32), "must be integer tensors"),
    ],
)
def test_a_malformed_page_table_is_refused_by_name_through_the_group(
    two_lanes: Runtime, table: torch.Tensor, match: str
) -> None:
    """The group reads which rows are live from the table; one it cannot read that way goes
    to the lane, whose checks name the problem (no stray numpy or index error)."""
    with pytest.raises(RequestError, match=match):
        two_lanes.group.decode_forward(
            tokens=torch.ones(2, dtype=torch.int64),
            start_pos=torch.zeros(2, dtype=torch.int32),
            page_table=table,
            sampling_params=[GREEDY, GREEDY],
        )


def test_traced_decode_widths_follow_the_device_and_crossing_one_keeps_the_tokens(
    build: Callable[..., Runtime], torch_device: str
) -> None:
    """A CUDA step attends over its whole page table, so CUDA decode gets a width ladder
    (tiny-llama: 16 blocks of 16 tokens, then the layout's 32); the CPU trims the table to
    the blocks in use and keeps one width. A request decoding across position 256 replays
    the w16 trace, then the w32 one (CUDA), and gives the eager run's tokens."""
    prompt = [(13 * i + 5) % 250 + 1 for i in range(250)]
    traced = build("tiny-llama", _on(torch_device)).ready()
    lane = traced.group.lanes[0]
    widths = (16, 32) if torch.device(torch_device).type == "cuda" else (32,)
    assert lane.layout.width == 32 and lane.decode.config.widths == widths
    got = traced.generate([prompt], steps=12)
    (container,) = traced.container.lane_containers()
    replayed = {
        key.rsplit(" w", 1)[1].rstrip("]")
        for key, count in container.trace_compiler().replay_counts().items()
        if key.startswith("decode[") and count > 0
    }
    assert replayed == {str(w) for w in widths}
    traced.close()
    eager = build("tiny-llama", [*_on(torch_device), "trace.mode=none"]).ready()
    assert eager.group.lanes[0].decode.config.widths == widths
    assert got.tokens == eager.generate([prompt], steps=12).tokens
