"""Decode runtime on a tiny random Llama lane: preparation, blocking vs async lease
outputs, drain/cleanup of leases, sampling through decode, and request validation.

The module lane runs on every torch device (the plugin's ``torch_device``: cuda where a GPU
is present); inputs are host tensors, as the executor takes them, and outputs come back to
the host.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import pytest
import torch
from lane_fixtures import (  # noqa: F401 (single_torch_thread: autouse)
    Lane,
    build_lane,
    make_rows,
    page_table,
    poisons_pending_reads,
    prompt,
    single_torch_thread,
)

from llmrt.errors import ConfigError, RequestError
from llmrt.runtime.decode import DecodeOutput, DecodeOutputLease, DecodeRuntimeConfig
from llmrt.sampling.params import SamplingParams

CAPACITY = 4
BS = 4
PROMPT_LENS = (9, 14, 3)
BLOCKS = ((3, 17, 5, 30, 31, 32), (8, 1, 22, 40, 41, 42, 43), (11, 12, 13, 14, 15))


@pytest.fixture(scope="module")
def lane(torch_device: str) -> Iterator[Lane]:
    lane = build_lane(
        num_blocks=48,
        block_size=BS,
        max_chunk=16,
        lane_capacity=CAPACITY,
        torch_device=torch_device,
    )
    rows = make_rows([prompt(n, seed=n) for n in PROMPT_LENS], BLOCKS)
    first = lane.executor.prefill_forward(rows=rows)
    assert first.logits is not None
    lane.notes["first_tokens"] = first.logits.argmax(dim=-1)
    yield lane
    lane.cleanup()
    assert lane.live_tensors() == lane.baseline_live


@pytest.fixture
def fresh(lane: Lane) -> Iterator[Lane]:
    """The module lane with its prefilled KV restored after the test (and no leftovers)."""
    saved = lane.snapshot()
    yield lane
    assert lane.decode.outstanding_leases == 0
    assert lane.reader.pending_count == 0
    lane.decode.cleanup_transients()
    lane.restore(saved)


def _table(rows: Sequence[int] = (0, 1, 2)) -> torch.Tensor:
    return page_table([BLOCKS[r] for r in rows], width=8)


def _start(lane: Lane, rows: Sequence[int] = (0, 1, 2)) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = lane.notes["first_tokens"][list(rows)]
    positions = torch.tensor([PROMPT_LENS[r] for r in rows], dtype=torch.int32)
    return tokens, positions


def _blocking(lane: Lane, **kwargs: Any) -> DecodeOutput:
    out = lane.executor.decode_forward(**kwargs)
    assert isinstance(out, DecodeOutput)
    return out


def _async(lane: Lane, **kwargs: Any) -> DecodeOutput:
    lease = lane.executor.decode_forward(read_from_device=False, **kwargs)
    assert isinstance(lease, DecodeOutputLease)
    assert lane.decode.outstanding_leases == 1
    host, events = lane.decode.read_decode_output(lease, async_read=True)
    assert len(events) == 1
    assert lane.reader.pending_count == 1
    for value in host.values() if poisons_pending_reads(lane) else ():
        # poisoned until the event is synchronized
        if value.dtype.is_floating_point:
            assert torch.isnan(value).all()
        else:
            assert (value == torch.iinfo(value.dtype).max).all()
    out = lane.decode.process_decode_output_host(host)
    assert lease.released and lane.decode.outstanding_leases == 0
    assert lane.reader.pending_count == 0
    return out


def _run(lane: Lane, steps: int, *, reader: Any, params: Any = None) -> list[DecodeOutput]:
    tokens, positions = _start(lane)
    outs = []
    for _ in range(steps):
        out = reader(
            lane,
            tokens=tokens,
            start_pos=positions,
            page_table=_table(),
            sampling_params=params,
        )
        outs.append(out)
        tokens = out.tokens if out.tokens is not None else out.logits.argmax(dim=-1)
        positions = positions + 1
    return outs


# -- prepare ---------------------------------------------------------------------------


def test_prepare_normalizes_to_the_lane_geometry(fresh: Lane) -> None:
    tokens, positions = _start(fresh)
    prepared = fresh.decode.prepare(
        tokens=tokens.tolist(), start_pos=positions.tolist(), page_table=_table().to(torch.int64)
    )
    width = fresh.layout.width
    assert prepared.active_rows == 3
    assert prepared.page_table.shape == (CAPACITY, width)
    assert prepared.page_table.dtype == torch.int32
    assert torch.equal(prepared.page_table[:3, :8], _table())
    assert (prepared.page_table[:3, 8:] == -1).all() and (prepared.page_table[3] == -1).all()
    assert prepared.tokens.tolist() == [*tokens.tolist(), 0]
    assert prepared.positions.dtype == torch.int32
    assert prepared.positions.tolist() == [*positions.tolist(), 0]
    assert prepared.path == "logits" and prepared.sampling is None
    sig = prepared.signature
    assert (sig.batch_size, sig.page_table_width) == (CAPACITY, width)


@pytest.mark.parametrize(
    ("params", "path"),
    [
        (None, "logits"),
        ([SamplingParams(temperature=0)] * 3, "argmax"),
        ([None, SamplingParams(temperature=0), None], "argmax"),
        ([SamplingParams(temperature=0, logprobs=2)] * 3, "sample"),
        ([SamplingParams(temperature=0), SamplingParams(temperature=0.7), None], "sample"),
        ([SamplingParams(temperature=0, repetition_penalty=1.2)] * 3, "sample"),
    ],
)
def test_prepare_classifies_the_output_path(fresh: Lane, params: Any, path: str) -> None:
    tokens, positions = _start(fresh)
    prepared = fresh.decode.prepare(
        tokens=tokens, start_pos=positions, page_table=_table(), sampling_params=params
    )
    assert prepared.path == path
    assert (prepared.sampling is not None) == (path == "sample")
    # One program serves every output path: the signature does not depend on it.
    plain = fresh.decode.prepare(tokens=tokens, start_pos=positions, page_table=_table())
    assert prepared.signature == plain.signature


def test_prepare_classifies_position_feedback_and_table_changes(fresh: Lane) -> None:
    decode = fresh.decode
    tokens, positions = _start(fresh)
    first = decode.prepare(tokens=tokens, start_pos=positions, page_table=_table())
    assert first.page_table_changed and not first.feedback_compatible
    decode.note_submitted(first, artifact=None)
    follow = decode.prepare(tokens=tokens, start_pos=positions + 1, page_table=_table())
    assert follow.feedback_compatible and not follow.page_table_changed
    assert not decode.prepare(
        tokens=tokens, start_pos=positions + 2, page_table=_table()
    ).feedback_compatible
    reset = decode.prepare(
        tokens=tokens, start_pos=positions + 1, page_table=_table(), reset_batch=True
    )
    assert reset.reset_batch and not reset.feedback_compatible
    moved = _table()
    moved[0, 3] = 47
    assert decode.prepare(
        tokens=tokens, start_pos=positions + 1, page_table=moved
    ).page_table_changed
    decode.cleanup_transients()
    assert not decode.prepare(
        tokens=tokens, start_pos=positions + 1, page_table=_table()
    ).feedback_compatible


# -- blocking vs async -----------------------------------------------------------------


def test_decode_logits_match_the_model_called_directly(fresh: Lane) -> None:
    saved = fresh.snapshot()
    tokens, positions = _start(fresh)
    out = _blocking(fresh, tokens=tokens, start_pos=positions, page_table=_table())
    assert out.logits is not None and out.tokens is None
    assert out.logits.shape == (3, fresh.vocab_size)
    fresh.restore(saved)
    prepared = fresh.decode.prepare(tokens=tokens, start_pos=positions, page_table=_table())
    on = fresh.inner.torch_device
    direct = fresh.model.decode_forward(
        tokens=prepared.tokens.to(on),
        positions=prepared.positions.to(on),
        page_table=prepared.page_table.to(on),
    )
    assert torch.equal(out.logits, direct[:3].to("cpu"))
    # The padding row is inert: it wrote nothing, so both runs leave identical KV.
    first = fresh.snapshot()
    fresh.restore(saved)
    _blocking(fresh, tokens=tokens, start_pos=positions, page_table=_table())
    for x, y in zip(first, fresh.snapshot(), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("greedy", [False, True], ids=["logits", "argmax"])
def test_async_lease_path_matches_the_blocking_path(fresh: Lane, greedy: bool) -> None:
    params = [SamplingParams(temperature=0)] * 3 if greedy else None
    saved = fresh.snapshot()
    blocking = _run(fresh, 6, reader=_blocking, params=params)
    after_blocking = fresh.snapshot()
    fresh.restore(saved)
    leased = _run(fresh, 6, reader=_async, params=params)
    for b, a in zip(blocking, leased, strict=True):
        if greedy:
            assert b.logits is None and a.logits is None
            assert b.tokens is not None and a.tokens is not None
            assert torch.equal(b.tokens, a.tokens)
        else:
            assert b.logits is not None and a.logits is not None
            assert torch.equal(b.logits, a.logits)
    for x, y in zip(after_blocking, fresh.snapshot(), strict=True):
        assert torch.equal(x, y)


def test_synchronous_read_of_a_lease(fresh: Lane) -> None:
    tokens, positions = _start(fresh)
    saved = fresh.snapshot()
    want = _blocking(fresh, tokens=tokens, start_pos=positions, page_table=_table())
    fresh.restore(saved)
    lease = fresh.executor.decode_forward(
        tokens=tokens, start_pos=positions, page_table=_table(), read_from_device=False
    )
    assert isinstance(lease, DecodeOutputLease) and not lease.is_tokens
    host, events = fresh.decode.read_decode_output(lease, async_read=False)
    assert events == () and fresh.reader.pending_count == 0
    with pytest.raises(RequestError, match="is_tokens: lease holds logits"):
        fresh.decode.process_decode_output_host(host, is_tokens=True)
    assert fresh.decode.outstanding_leases == 1 and not lease.released
    out = fresh.decode.process_decode_output_host(host, is_tokens=False)  # still processable
    assert lease.released
    assert out.logits is not None and want.logits is not None
    assert torch.equal(out.logits, want.logits)


def test_drain_after_an_abandoned_step_leaves_nothing_pending(fresh: Lane) -> None:
    tokens, positions = _start(fresh)
    kwargs = {"tokens": tokens, "page_table": _table(), "read_from_device": False}
    abandoned = fresh.executor.decode_forward(start_pos=positions, **kwargs)
    host, _ = fresh.decode.read_decode_output(abandoned, async_read=True)
    never_read = fresh.executor.decode_forward(start_pos=positions + 1, **kwargs)
    assert fresh.decode.outstanding_leases == 2
    assert fresh.reader.pending_count == 1 and fresh.inner.stats().pending_reads == 1

    assert fresh.decode.drain_external_outputs() == 2
    assert fresh.decode.outstanding_leases == 0
    assert fresh.reader.pending_count == 0 and fresh.inner.stats().pending_reads == 0
    assert abandoned.released and never_read.released
    assert fresh.decode.drain_external_outputs() == 0  # idempotent

    with pytest.raises(RequestError, match="host_value"):
        fresh.decode.process_decode_output_host(host)
    with pytest.raises(RequestError, match="not an outstanding lease"):
        fresh.decode.read_decode_output(never_read, async_read=True)
    with pytest.raises(RequestError, match="not an outstanding lease"):
        fresh.decode.read_decode_output(abandoned, async_read=False)


def test_lane_cleanup_releases_outstanding_leases() -> None:
    lane = build_lane(num_blocks=16, block_size=BS, lane_capacity=2)
    table = page_table([[0, 1], [2]], width=4)
    kwargs = {"tokens": [1, 2], "page_table": table, "read_from_device": False}
    leases = [lane.executor.decode_forward(start_pos=[p, p], **kwargs) for p in range(3)]
    lane.decode.read_decode_output(leases[1], async_read=True)
    assert lane.decode.outstanding_leases == 3
    lane.cleanup()
    assert all(isinstance(x, DecodeOutputLease) and x.released for x in leases)
    assert lane.decode.outstanding_leases == 0 and lane.reader.pending_count == 0
    assert lane.inner.stats().pending_reads == 0
    assert lane.live_tensors() == lane.baseline_live
    lane.cleanup()  # idempotent


# -- sampling through decode -------------------------------------------------------------


def _seeded_tokens(
    lane: Lane, *, rows: Sequence[int], params: Sequence[SamplingParams], target: int, steps: int
) -> list[int]:
    """Tokens of source row ``target`` decoded ``steps`` times in a batch of ``rows``."""
    tokens, positions = _start(lane, rows)
    picked = []
    for step in range(steps):
        out = _blocking(
            lane,
            tokens=tokens,
            start_pos=positions,
            page_table=_table(rows),
            sampling_params=list(params),
            step_offsets=[step] * len(rows),
        )
        assert out.tokens is not None
        picked.append(int(out.tokens[list(rows).index(target)]))
        tokens, positions = out.tokens, positions + 1
    return picked


def test_seeded_sampling_is_reproducible_across_batch_compositions(fresh: Lane) -> None:
    saved = fresh.snapshot()
    seeded = SamplingParams(temperature=1.5, seed=1234)

    def run(rows: Sequence[int], params: Sequence[SamplingParams]) -> list[int]:
        fresh.restore(saved)
        return _seeded_tokens(fresh, rows=rows, params=params, target=0, steps=8)

    alone = run([0], [seeded])
    assert run([0], [seeded]) == alone
    crowd = run(
        [2, 1, 0],
        [SamplingParams(temperature=0.9), SamplingParams(temperature=1.0, seed=7), seeded],
    )
    assert crowd == alone
    assert run([1, 0], [SamplingParams(temperature=0), seeded]) == alone
    other_seed = run([0], [SamplingParams(temperature=1.5, seed=4321)])
    assert other_seed != alone, "a different seed must draw differently"


def _penalised(
    logits: torch.Tensor,
    *,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    rep: float,
    presence: float,
    frequency: float,
) -> torch.Tensor:
    """vLLM penalties written out by hand for one row."""
    out = logits.clone()
    seen = set(prompt_ids) | set(output_ids)
    for t in seen:
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output_ids):
        out[t] -= presence + frequency * list(output_ids).count(t)
    return out


@pytest.mark.parametrize(
    ("temperature", "logprobs"),
    [(0.0, None), (0.0, 4), (1.0, 4)],
    ids=["greedy", "greedy_logprobs", "top_k_1_logprobs"],
)
def test_penalties_from_history_change_exactly_the_penalised_tokens(
    fresh: Lane, temperature: float, logprobs: int | None
) -> None:
    tokens, positions = _start(fresh)
    saved = fresh.snapshot()
    logits = _blocking(fresh, tokens=tokens, start_pos=positions, page_table=_table()).logits
    assert logits is not None
    top = logits.argmax(dim=-1).tolist()
    history = [
        ([int(t) for t in prompt(PROMPT_LENS[0], seed=PROMPT_LENS[0])], [top[0], top[0], 5]),
        ((), ()),  # row 1 samples with penalties but has no history: unchanged
        ([top[2]], []),  # repetition penalty from the prompt only
    ]
    knobs = {"repetition_penalty": 3.0, "presence_penalty": 1.5, "frequency_penalty": 1.0}
    params = [
        SamplingParams(temperature=temperature, top_k=1, logprobs=logprobs, **knobs)
        for _ in range(3)
    ]
    fresh.restore(saved)
    out = _blocking(
        fresh,
        tokens=tokens,
        start_pos=positions,
        page_table=_table(),
        sampling_params=params,
        history=history,
    )
    assert out.tokens is not None
    assert (out.logprobs is None) == (out.top_logprobs is None) == (logprobs is None)
    for r, (prompt_ids, output_ids) in enumerate(history):
        want = _penalised(
            logits[r],
            prompt_ids=prompt_ids,
            output_ids=output_ids,
            rep=knobs["repetition_penalty"],
            presence=knobs["presence_penalty"],
            frequency=knobs["frequency_penalty"],
        )
        assert int(out.tokens[r]) == int(want.argmax()), f"row {r}"
        if out.logprobs is None or out.top_logprobs is None:
            continue
        expected = torch.log_softmax(want, dim=-1)
        assert torch.allclose(out.logprobs[r], expected[out.tokens[r]], atol=1e-5)
        values, ids = out.top_logprobs
        assert torch.allclose(values[r], expected.topk(4).values, atol=1e-5)
        assert ids[r].tolist() == expected.topk(4).indices.tolist()
    assert int(out.tokens[0]) != top[0], "the penalty must move row 0 off its argmax"
    assert int(out.tokens[1]) == top[1]


# -- bad input: a clear error naming row and field, before any device work ----------------


def _rejects(lane: Lane, *, field: str, row: int | None, match: str, **kwargs: Any) -> None:
    before = lane.snapshot()
    stats = lane.inner.stats()
    call = {"tokens": None, "start_pos": None, "page_table": _table()}
    tokens, positions = _start(lane)
    call.update(tokens=tokens, start_pos=positions)
    call.update(kwargs)
    with pytest.raises(RequestError, match=match) as exc:
        lane.executor.decode_forward(**call)
    err = exc.value
    assert (err.field, err.row) == (field, row), str(err)
    prefix = f"row {row}: {field}:" if row is not None else f"{field}:"
    assert str(err).startswith(prefix), str(err)
    after = lane.inner.stats()
    assert (after.allocations, after.live_tensors) == (stats.allocations, stats.live_tensors)
    for old, new in zip(before, lane.snapshot(), strict=True):
        assert torch.equal(old, new), "no KV write may happen"


def test_page_table_wider_than_the_layout(fresh: Lane) -> None:
    width = fresh.layout.width
    wide = page_table([BLOCKS[r] for r in range(3)], width=width + 1)
    _rejects(
        fresh, field="page_table", row=None, match=f"width {width + 1} exceeds", page_table=wide
    )


@pytest.mark.parametrize(("value", "match"), [(48, r"\[0, 48\).*got 48"), (-2, "got -2")])
def test_block_id_out_of_range(fresh: Lane, value: int, match: str) -> None:
    table = _table()
    table[1, 6] = value
    _rejects(fresh, field="page_table", row=1, match=match, page_table=table)


def test_position_whose_block_is_unmapped_or_beyond_the_table(fresh: Lane) -> None:
    table = _table()
    table[2, 0] = -1
    _rejects(fresh, field="page_table", row=2, match="is -1", page_table=table)
    narrow = _table()[:, :2]
    _rejects(fresh, field="page_table", row=0, match="no column for position 9", page_table=narrow)


@pytest.mark.parametrize("bad", [-1, "max"])
def test_position_beyond_max_sequence(fresh: Lane, bad: Any) -> None:
    _, positions = _start(fresh)
    limit = fresh.layout.max_sequence_length
    positions[1] = limit if bad == "max" else bad
    _rejects(fresh, field="start_pos", row=1, match=f"got {int(positions[1])}", start_pos=positions)


def test_batch_over_lane_capacity(fresh: Lane) -> None:
    rows = CAPACITY + 1
    _rejects(
        fresh,
        field="tokens",
        row=None,
        match=f"batch of {rows} rows exceeds the lane capacity {CAPACITY}",
        tokens=[1] * rows,
        start_pos=[0] * rows,
        page_table=page_table([[0]] * rows, width=2),
    )


def test_token_out_of_vocab(fresh: Lane) -> None:
    tokens, _ = _start(fresh)
    tokens = tokens.clone()
    tokens[2] = fresh.vocab_size
    _rejects(fresh, field="tokens", row=2, match="out of range", tokens=tokens)


def test_mismatched_argument_lengths(fresh: Lane) -> None:
    _rejects(fresh, field="start_pos", row=None, match="2 entries for 3", start_pos=[9, 14])
    _rejects(
        fresh,
        field="sampling_params",
        row=None,
        match="2 entries for 3",
        sampling_params=[SamplingParams(), SamplingParams()],
    )
    _rejects(fresh, field="step_offsets", row=None, match="2 entries for 3", step_offsets=[0, 0])
    _rejects(fresh, field="step_offsets", row=1, match="got -1", step_offsets=[0, -1, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64])
def test_non_integer_inputs_are_refused(fresh: Lane, dtype: torch.dtype) -> None:
    tokens, positions = _start(fresh)
    match = "must be integer tensors"
    _rejects(fresh, field="tokens", row=None, match=match, tokens=tokens.to(dtype))
    _rejects(fresh, field="tokens", row=None, match=match, start_pos=positions.to(dtype))
    _rejects(fresh, field="tokens", row=None, match=match, page_table=_table().to(dtype))
    offsets = [0.5] * 3
    _rejects(fresh, field="step_offsets", row=None, match="must be integers", step_offsets=offsets)


def test_lists_and_tensors_of_any_integer_dtype_prepare_the_same_step(fresh: Lane) -> None:
    tokens, positions = _start(fresh)
    runtime = fresh.executor.decode
    reference = runtime.prepare(tokens=tokens, start_pos=positions, page_table=_table())
    for kwargs in (
        {
            "tokens": tokens.tolist(),
            "start_pos": positions.tolist(),
            "page_table": _table().tolist(),
        },
        {"tokens": tokens.int(), "start_pos": positions.long(), "page_table": _table().short()},
    ):
        got = runtime.prepare(**kwargs)
        for name in ("tokens", "positions", "page_table", "step_offsets"):
            want = getattr(reference, name)
            assert torch.equal(getattr(got, name), want), name
            assert getattr(got, name).dtype == want.dtype, name
    cap = reference.signature.batch_size
    assert reference.tokens.tolist() == tokens.tolist() + [0] * (cap - 3)
    assert reference.page_table.shape == (cap, fresh.layout.width)
    assert reference.page_table[3:].eq(-1).all()


@pytest.mark.parametrize(
    ("field", "kwargs", "match"),
    [
        ("top_p", {"top_p": 0.0}, r"\(0, 1\]"),
        ("top_p", {"top_p": 1.5}, "got 1.5"),
        ("temperature", {"temperature": -0.5}, ">= 0"),
        ("top_k", {"top_k": -2}, "got -2"),
        ("min_p", {"min_p": 1.2}, "got 1.2"),
        ("repetition_penalty", {"repetition_penalty": 0.0}, "> 0"),
        ("presence_penalty", {"presence_penalty": 3.0}, "got 3.0"),
        ("seed", {"seed": 1.5}, "integer"),
    ],
)
def test_invalid_sampling_values_never_reach_decode(
    fresh: Lane, field: str, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(RequestError, match=match) as exc:
        SamplingParams(**kwargs)
    assert exc.value.field == field and str(exc.value).startswith(f"{field}:")


def test_a_non_params_sampling_row_is_rejected(fresh: Lane) -> None:
    _rejects(
        fresh,
        field="sampling_params",
        row=1,
        match="must be SamplingParams or None",
        sampling_params=[SamplingParams(temperature=0.5), {"temperature": 0.5}, None],
    )
    _rejects(
        fresh,
        field="sampling_params",
        row=0,
        match="must be SamplingParams or None",
        sampling_params=["greedy", None, None],
    )


# -- physical batch sizes ----------------------------------------------------------------


def test_a_step_runs_at_the_smallest_batch_size_holding_its_rows(fresh: Lane) -> None:
    saved = fresh.snapshot()
    tokens, positions = _start(fresh, rows=(0, 1))
    table = _table(rows=(0, 1))
    full = _blocking(fresh, tokens=tokens, start_pos=positions, page_table=table)
    fresh.restore(saved)
    config = fresh.decode.config
    fresh.decode.config = attrs.evolve(config, batch_sizes=(1, 2, CAPACITY))
    try:
        prepared = fresh.decode.prepare(tokens=tokens, start_pos=positions, page_table=table)
        assert prepared.signature.batch_size == 2 and prepared.tokens.shape == (2,)
        assert prepared.page_table.shape == (2, fresh.layout.width)
        small = _blocking(fresh, tokens=tokens, start_pos=positions, page_table=table)
        one = fresh.decode.prepare(tokens=tokens[:1], start_pos=positions[:1], page_table=table[:1])
        assert one.signature.batch_size == 1
    finally:
        fresh.decode.config = config
    assert full.logits is not None and small.logits is not None
    assert full.logits.shape == small.logits.shape == (2, fresh.vocab_size)
    torch.testing.assert_close(small.logits, full.logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sizes", [(), (2, 1, CAPACITY), (1, 3), (0, CAPACITY), (1, 2 * CAPACITY)])
def test_decode_batch_sizes_must_increase_to_the_lane_capacity(
    fresh: Lane, sizes: tuple[int, ...]
) -> None:
    with pytest.raises(ConfigError, match=r"decode\.batch_sizes.*ending at the lane capacity"):
        _resolve_like(fresh, batch_sizes=sizes)


def _resolve_like(lane: Lane, **changes: Any) -> DecodeRuntimeConfig:
    """``DecodeRuntimeConfig.resolve`` over ``lane``'s collaborators with ``changes``."""
    config = lane.decode.config
    return DecodeRuntimeConfig.resolve(
        model=config.model,
        device=config.device,
        output_reader=config.output_reader,
        lane_capacity=CAPACITY,
        page_table_layout=config.layout,
        device_sampling_enabled=True,
        **changes,
    )


# -- page-table width ladder -------------------------------------------------------------


def test_a_width_ladder_doubles_from_its_first_tokens_to_the_layout_width(fresh: Lane) -> None:
    """Blocks of 4, a 48-block layout: 8 tokens take 2 blocks, doubled while narrower than
    48, which ends the ladder; 9 tokens round up to 3 blocks."""
    config = fresh.decode.config
    assert fresh.layout.width == 48 and config.widths == (48,)
    assert attrs.evolve(config, width_ladder=8).widths == (2, 4, 8, 16, 32, 48)
    assert attrs.evolve(config, width_ladder=9).widths == (3, 6, 12, 24, 48)
    assert attrs.evolve(config, width_ladder=1000).widths == (48,)


def test_a_step_runs_at_the_narrowest_width_holding_its_furthest_position(fresh: Lane) -> None:
    """Positions 5 and 17 (blocks 1 and 4): 5 blocks needed, the ladder's 8 taken; the
    table keeps its first 8 columns and the step's logits equal the full-width step's."""
    saved = fresh.snapshot()
    tokens = torch.tensor([3, 7], dtype=torch.int64)
    positions = torch.tensor([5, 17], dtype=torch.int32)
    table = torch.full((2, fresh.layout.width), -1, dtype=torch.int32)
    table[0, :2] = torch.tensor([0, 1])
    table[1, :5] = torch.tensor([2, 3, 4, 5, 6])
    full = _blocking(fresh, tokens=tokens, start_pos=positions, page_table=table)
    fresh.restore(saved)
    config = fresh.decode.config
    fresh.decode.config = attrs.evolve(config, width_ladder=8)
    try:
        prepared = fresh.decode.prepare(tokens=tokens, start_pos=positions, page_table=table)
        assert prepared.signature.page_table_width == 8
        assert torch.equal(prepared.page_table[:2], table[:, :8])
        early = fresh.decode.prepare(tokens=tokens, start_pos=positions - 5, page_table=table)
        assert early.signature.page_table_width == 4  # positions 0 and 12: 4 blocks
        narrow = _blocking(fresh, tokens=tokens, start_pos=positions, page_table=table)
    finally:
        fresh.decode.config = config
    assert full.logits is not None and narrow.logits is not None
    torch.testing.assert_close(narrow.logits, full.logits, rtol=0, atol=0)


@pytest.mark.parametrize("tokens", [0, -8, True, 2.5])
def test_a_width_ladder_needs_a_positive_token_count(fresh: Lane, tokens: object) -> None:
    with pytest.raises(ConfigError, match=r"width_ladder.*positive number of tokens"):
        _resolve_like(fresh, width_ladder=tokens)


# -- tokens from the device (vLLM's overlapped steps) ------------------------------------


@pytest.mark.parametrize("read", ["blocking", "lease"])
def test_tokens_from_device_continue_the_previous_step_whatever_the_host_sends(
    fresh: Lane, read: str
) -> None:
    """A continued step ignores the host's (lagging) tokens: it decodes what was sampled."""
    params = [SamplingParams(temperature=0.0)] * 3
    saved = fresh.snapshot()
    expected = _run(fresh, 3, reader=_blocking, params=params)
    fresh.restore(saved)
    fresh.decode.cleanup_transients()
    tokens, positions = _start(fresh)
    got = [
        _blocking(
            fresh,
            tokens=tokens,
            start_pos=positions,
            page_table=_table(),
            sampling_params=params,
            reset_batch=True,
        )
    ]
    for step in (1, 2):
        kwargs = dict(
            tokens=tokens,  # stale: the first step's inputs, every time
            start_pos=positions + step,
            page_table=_table(),
            sampling_params=params,
            tokens_from_device=True,
        )
        got.append(_blocking(fresh, **kwargs) if read == "blocking" else _async(fresh, **kwargs))
    assert [o.tokens.tolist() for o in got] == [o.tokens.tolist() for o in expected]


def test_tokens_from_device_are_refused_without_a_step_to_continue(fresh: Lane) -> None:
    tokens, positions = _start(fresh)
    greedy = [SamplingParams(temperature=0.0)] * 3
    base = dict(tokens=tokens, page_table=_table(), tokens_from_device=True)
    fresh.decode.cleanup_transients()
    with pytest.raises(RequestError, match="sampled no tokens"):
        fresh.executor.decode_forward(start_pos=positions, sampling_params=greedy, **base)
    _blocking(
        fresh, tokens=tokens, start_pos=positions, page_table=_table(), sampling_params=greedy
    )
    with pytest.raises(RequestError, match="no sampling_params"):
        fresh.executor.decode_forward(start_pos=positions + 1, **base)
    with pytest.raises(RequestError, match="batch reset"):
        fresh.executor.decode_forward(
            start_pos=positions + 1, sampling_params=greedy, reset_batch=True, **base
        )
    with pytest.raises(RequestError, match=r"position \+ 1") as info:
        fresh.executor.decode_forward(
            start_pos=positions + torch.tensor([1, 2, 1]), sampling_params=greedy, **base
        )
    assert info.value.row == 1
    fresh.decode.cleanup_transients()


def test_abandoned_outputs_leave_no_step_to_continue(fresh: Lane) -> None:
    tokens, positions = _start(fresh)
    greedy = [SamplingParams(temperature=0.0)] * 3
    lease = fresh.executor.decode_forward(
        tokens=tokens,
        start_pos=positions,
        page_table=_table(),
        sampling_params=greedy,
        read_from_device=False,
    )
    assert isinstance(lease, DecodeOutputLease)
    assert fresh.decode.drain_external_outputs() == 1
    with pytest.raises(RequestError, match="sampled no tokens"):
        fresh.executor.decode_forward(
            tokens=tokens,
            start_pos=positions + 1,
            page_table=_table(),
            sampling_params=greedy,
            tokens_from_device=True,
        )
    fresh.decode.cleanup_transients()
