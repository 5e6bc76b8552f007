"""``EagerExecutor`` / ``TracedExecutor``: the three trace modes give identical greedy tokens
(ragged waves, a chunked long prompt, a cached prefix, a late-joining slot, page-table growth),
coverage misses raise before any KV write, the compile gate after activation, eager execution
of compiled signatures in ``decode_only`` mode, and composition identity checks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from lane_fixtures import (  # noqa: F401 (single_torch_thread: autouse)
    Lane,
    add_tracing,
    build_lane,
    make_rows,
    page_table,
    prompt,
    run_prefill,
    single_torch_thread,
    tiny_llama,
)

from llmrt.device.torch import TorchDevice
from llmrt.errors import CompileGateClosed, IdentityError, TraceCoverageError
from llmrt.families.base import CausalLM
from llmrt.runtime.config import TraceConfig
from llmrt.runtime.execution import TracedExecutor
from llmrt.runtime.program_compiler import ProgramCompiler
from llmrt.runtime.trace_compiler import TraceCompiler
from llmrt.sampling.params import SamplingParams

BS = 4
NUM_BLOCKS = 64
CHUNK = 16  # buckets 8 and 16; warmup covers b1/b2 at 8, b1 at 16, chunked b1 at 8 and 16
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return tiny_llama()


@pytest.fixture
def make(model: CausalLM) -> Iterator[Callable[..., Lane]]:
    """Builds traced lanes over the shared model (use one at a time: each binds the model);
    every lane is cleaned up and checked for leaks at teardown."""
    made: list[Lane] = []

    def build(mode: str, *, warm: bool = True, width_ladder: int | None = None) -> Lane:
        lane = build_lane(
            model=model,
            block_size=BS,
            num_blocks=NUM_BLOCKS,
            max_chunk=CHUNK,
            width_ladder=width_ladder,
        )
        tracing = add_tracing(lane, mode=mode)
        if warm:
            tracing.warm()
        made.append(lane)
        return lane

    yield build
    for lane in made:
        lane.cleanup()
        assert lane.live_tensors() == lane.baseline_live
        assert lane.inner.stats().live_traces == 0


def _traced(lane: Lane) -> TracedExecutor:
    assert lane.tracing is not None
    return lane.tracing.executor


# -- one serving scenario under every trace mode ---------------------------------------


def _scenario(lane: Lane, steps: int = 12, join_at: int = 4) -> tuple[list[list[int]], list[Any]]:
    """Prefill three ragged prompts (two share a padded wave, one is chunked), decode with
    lazily grown page tables; a fourth request with a cached prefix joins at ``join_at``."""
    executor = _traced(lane)
    traces = executor.trace_compiler
    free = iter(range(30, NUM_BLOCKS))
    a, b, c = prompt(5, seed=1), prompt(7, seed=2), prompt(40, seed=3)
    blocks = [[0, 1], [2, 3], list(range(4, 14))]
    out = executor.prefill_forward(rows=make_rows([a, b, c], blocks), sampling_params=GREEDY)
    assert out.tokens is not None
    tokens, positions = out.tokens.tolist(), [5, 7, 40]
    history: list[list[int]] = [list(tokens)]
    decisions: list[Any] = []
    for step in range(steps):
        if step == join_at:
            # The cached prefix is c's first two blocks (positions 0..7), shared read-only.
            d = c[:8] + prompt(6, seed=4)
            d_blocks = [4, 5, next(free), next(free)]
            joined = executor.prefill_forward(
                rows=make_rows([d], [d_blocks], cached=[8], slots=[3]), sampling_params=GREEDY
            )
            assert joined.tokens is not None
            blocks.append(d_blocks)
            tokens.append(int(joined.tokens[0]))
            positions.append(len(d))
            history.append([int(joined.tokens[0])])
        for row, pos in enumerate(positions):
            while len(blocks[row]) <= pos // BS:  # a row crossing into a new block
                blocks[row].append(next(free))
        out = executor.decode_forward(
            tokens=tokens,
            start_pos=positions,
            page_table=page_table(blocks, width=lane.layout.width),
            sampling_params=[GREEDY] * len(tokens),
        )
        assert out.tokens is not None
        tokens, positions = out.tokens.tolist(), [p + 1 for p in positions]
        history.append(list(tokens))
        decode = [a for a in traces.artifacts.values() if a.plan.operation == "decode"]
        decisions.append(decode[0].replay_state.get("last_refresh") if decode else None)
    lane.notes["rows"] = (tokens, positions, blocks)  # where each request stands now
    return history, decisions


def _short_rows_step(lane: Lane) -> list[int]:
    """After ``_scenario``: one more greedy step of its two short requests alone."""
    tokens, positions, blocks = lane.notes["rows"]
    out = _traced(lane).decode_forward(
        tokens=tokens[:2],
        start_pos=positions[:2],
        page_table=page_table(blocks[:2], width=lane.layout.width),
        sampling_params=[GREEDY] * 2,
    )
    assert out.tokens is not None
    return [int(t) for t in out.tokens.tolist()]


def test_every_trace_mode_gives_identical_greedy_tokens(make: Callable[..., Lane]) -> None:
    results: dict[str, tuple[list[list[int]], list[torch.Tensor]]] = {}
    for mode in ("none", "decode_only", "all"):
        lane = make(mode)
        history, decisions = _scenario(lane)
        traces = _traced(lane).trace_compiler
        counts = traces.replay_counts()
        if mode == "none":
            assert counts == {} and lane.inner.stats().replays == 0
            assert not lane.compiler.gate_closed
        else:
            assert counts.pop("decode[b8 w64]") == 12, "every decode step replayed the trace"
            # The table's every branch ran: first replay, page-table growth, steady state,
            # and the slot join (positions no longer follow the device feedback).
            assert decisions[0] == "full" and decisions[4] == "full"
            assert {"page_table", "fields"} <= set(decisions)
        if mode == "decode_only":
            assert counts == {}, "prefill ran eagerly"
        if mode == "all":
            assert counts["prefill[regular b2 s8 w64]"] == 1  # the 5- and 7-token wave
            # One 16-token chunk trace replays twice for the 40-token prompt (host loop with
            # refreshed offsets); its 8-token tail and the cached-prefix request share s8.
            assert counts["prefill[chunked b1 s16 w64]"] == 2
            assert counts["prefill[chunked b1 s8 w64]"] == 2
        results[mode] = (history, lane.snapshot())
        lane.cleanup()
    want_tokens, want_kv = results["none"]
    assert len(want_tokens) == 14 and len(want_tokens[-1]) == 4
    for mode in ("decode_only", "all"):
        tokens, kv = results[mode]
        assert tokens == want_tokens, f"{mode} differs from eager"
        for index, (got, want) in enumerate(zip(kv, want_kv, strict=True)):
            assert torch.equal(got, want), f"{mode}: KV tensor {index} differs from eager"


def test_a_width_ladder_switches_traces_as_positions_grow(make: Callable[..., Lane]) -> None:
    """With a page-table width ladder (12 blocks of 4 first: 12, 24, 48, 64), each decode
    step runs the trace of the narrowest width that holds its furthest position: 40-47 fit
    12 blocks, 48-51 need 13, and a later step of the short requests alone fits 12 again.
    Tokens and KV equal the eager full-width run's."""
    eager = make("none")
    want_tokens, _ = _scenario(eager)
    want_kv = eager.snapshot()
    want_short = _short_rows_step(eager)
    eager.cleanup()
    lane = make("decode_only", width_ladder=48)
    decode = lane.decode.config
    assert decode.widths == (12, 24, 48, 64)
    # Warmup captured the batch size at every width, the widest first (their buffers share
    # one CUDA graph pool, sized by the first capture), not by the description's text order.
    order = [a.plan.description for a in _traced(lane).trace_compiler.capture_order()]
    assert order == [f"decode[b8 w{w}]" for w in (64, 48, 24, 12)]
    tokens, _ = _scenario(lane)
    counts = _traced(lane).trace_compiler.replay_counts()
    assert counts == {
        "decode[b8 w12]": 8,
        "decode[b8 w24]": 4,
        "decode[b8 w48]": 0,
        "decode[b8 w64]": 0,
    }
    assert tokens == want_tokens
    for index, (got, want) in enumerate(zip(lane.snapshot(), want_kv, strict=True)):
        assert torch.equal(got, want), f"KV tensor {index} differs from the full-width run"
    # Back to the narrow trace once the long rows leave (positions 17 and 19: 5 blocks): its
    # inputs still hold the step before the switch, so the replay rewrites them all.
    assert _short_rows_step(lane) == want_short
    w12 = next(
        a
        for a in _traced(lane).trace_compiler.artifacts.values()
        if a.plan.description == "decode[b8 w12]"
    )
    assert w12.replays == 9 and w12.replay_state["last_refresh"] == "full"


# -- coverage misses and the compile gate ----------------------------------------------


def _partially_warmed(lane: Lane) -> None:
    """Compile (and register) decode and only the single-row 8-token prefill, then capture:
    full warmup covers every geometry the planner forms, so misses need a narrower one."""
    assert lane.tracing is not None
    lane.tracing.warmup.warmup_decode()
    assert not lane.tracing.warmup.captured, "prefill is not warm: no capture yet"
    single = lane.prefill.prepare(rows=make_rows([prompt(5, seed=9)], [[60, 61]]))
    programs = lane.tracing.executor.compile_prefill(single)
    assert [p.description for p in programs] == ["prefill[regular b1 s8 w64]"]
    lane.tracing.executor.capture_all()
    assert lane.compiler.gate_closed


def test_a_prefill_trace_miss_raises_before_any_kv_write(make: Callable[..., Lane]) -> None:
    lane = make("all", warm=False)
    _partially_warmed(lane)
    before = lane.snapshot()
    stats = lane.inner.stats()
    # A covered single 5-token row plus an uncovered two-row wave padded to 16: the covered
    # request comes first in the plan, yet nothing may run.
    rows = make_rows(
        [prompt(5, seed=1), prompt(12, seed=2), prompt(11, seed=3)], [[0, 1], [2, 3, 4], [5, 6, 7]]
    )
    with pytest.raises(TraceCoverageError) as exc:
        _traced(lane).prefill_forward(rows=rows, sampling_params=GREEDY)
    assert exc.value.operation == "prefill"
    assert exc.value.missing == ("prefill[regular b2 s16 w64]",)
    assert "prefill[regular b2 s16 w64]" in str(exc.value)
    after = lane.inner.stats()
    assert (after.replays, after.allocations) == (stats.replays, stats.allocations)
    for index, (old, new) in enumerate(zip(before, lane.snapshot(), strict=True)):
        assert torch.equal(old, new), f"KV tensor {index} changed"
    assert "prefill[regular b2 s16 w64]" not in {
        p.description for p in lane.compiler.programs.values()
    }, "a traced miss never falls back to eager compilation"


def test_a_decode_trace_miss_raises_before_any_kv_write(make: Callable[..., Lane]) -> None:
    lane = make("decode_only", warm=False)
    assert lane.tracing is not None
    lane.tracing.warmup.warmup_prefill()  # decode not warmed: nothing captured
    before = lane.snapshot()
    stats = lane.inner.stats()
    with pytest.raises(TraceCoverageError) as exc:
        _traced(lane).decode_forward(
            tokens=[3], start_pos=[5], page_table=page_table([[0, 1]], width=lane.layout.width)
        )
    assert exc.value.operation == "decode" and exc.value.missing == ("decode[b8 w64]",)
    assert lane.inner.stats().allocations == stats.allocations, "nothing was staged"
    for old, new in zip(before, lane.snapshot(), strict=True):
        assert torch.equal(old, new)
    assert not any(p.operation == "decode" for p in lane.compiler.programs.values())


def test_compile_after_activation_raises_before_any_kv_write(make: Callable[..., Lane]) -> None:
    lane = make("decode_only", warm=False)
    _partially_warmed(lane)
    programs = dict(lane.compiler.programs)
    before = lane.snapshot()
    rows = make_rows([prompt(12, seed=2), prompt(11, seed=3)], [[2, 3, 4], [5, 6, 7]])
    with pytest.raises(CompileGateClosed) as exc:  # eager prefill, unseen b2 s16 geometry
        _traced(lane).prefill_forward(rows=rows, sampling_params=GREEDY)
    assert exc.value.description == "prefill[regular b2 s16 w64]"
    for old, new in zip(before, lane.snapshot(), strict=True):
        assert torch.equal(old, new)
    assert lane.compiler.programs == programs
    prepared = lane.prefill.prepare(rows=rows)
    ran = []
    with pytest.raises(CompileGateClosed):
        lane.compiler.compile(prepared.signatures()[0], lambda: ran.append(1))
    assert ran == []


def test_decode_only_runs_compiled_prefill_signatures_eagerly(make: Callable[..., Lane]) -> None:
    lane = make("decode_only")
    programs = dict(lane.compiler.programs)
    captures = lane.inner.stats().captures
    before = lane.snapshot()
    rows = make_rows(
        [prompt(5, seed=1), prompt(7, seed=2), prompt(40, seed=3)],
        [[0, 1], [2, 3], list(range(4, 14))],
    )
    got = _traced(lane).prefill_forward(rows=rows)
    after = lane.snapshot()
    lane.restore(before)
    want = run_prefill(lane.prefill, rows)  # the runtime alone, no compiler or traces
    assert got.logits is not None and want.logits is not None
    assert torch.equal(got.logits, want.logits)
    for old, new in zip(after, lane.snapshot(), strict=True):
        assert torch.equal(old, new)
    assert lane.compiler.programs == programs, "nothing new compiled"
    assert lane.inner.stats().captures == captures
    assert _traced(lane).trace_compiler.replay_counts() == {"decode[b8 w64]": 0}


def test_a_padding_row_joining_the_batch_gets_a_full_refresh(make: Callable[..., Lane]) -> None:
    """The trace increments every row's device position, padding rows included, so a slot
    that joins at position 1 must not be treated as following the (host) padding value 0."""
    lane = make("decode_only")
    width = lane.layout.width
    steps = [
        {"tokens": [3], "start_pos": [6], "page_table": page_table([[0, 1]], width=width)},
        {"tokens": [4], "start_pos": [7], "page_table": page_table([[0, 1]], width=width)},
        {
            "tokens": [5, 9],
            "start_pos": [8, 1],
            "page_table": page_table([[0, 1, 2], [5]], width=width),
        },
        {
            "tokens": [6, 10],
            "start_pos": [9, 2],
            "page_table": page_table([[0, 1, 2], [5]], width=width),
        },
    ]
    saved = lane.snapshot()
    want = [lane.executor.decode_forward(**s).logits for s in steps]
    lane.restore(saved)
    lane.decode.cleanup_transients()
    traced = _traced(lane)
    (artifact,) = traced.trace_compiler.artifacts.values()
    decisions = []
    for step, expected in zip(steps, want, strict=True):
        got = traced.decode_forward(**step).logits
        decisions.append(artifact.replay_state["last_refresh"])
        assert got is not None and expected is not None
        assert torch.equal(got, expected), f"decisions so far: {decisions}"
    assert decisions == ["full", "fields", "full", "fields"]


def test_traced_decode_leases_keep_their_own_copy(make: Callable[..., Lane]) -> None:
    lane = make("decode_only")
    width = lane.layout.width
    traced = _traced(lane)
    first = traced.decode_forward(
        tokens=[3],
        start_pos=[6],
        page_table=page_table([[0, 1]], width=width),
        read_from_device=False,
    )
    copy = first.raw["logits"].clone()  # type: ignore[union-attr]
    traced.decode_forward(tokens=[4], start_pos=[7], page_table=page_table([[0, 1]], width=width))
    assert torch.equal(first.raw["logits"], copy), "the next replay rewrote a leased output"  # type: ignore[union-attr]
    host, _ = lane.decode.read_decode_output(first, async_read=False)  # type: ignore[arg-type]
    out = lane.decode.process_decode_output_host(host)
    assert out.logits is not None and torch.equal(out.logits, copy[:1])


# -- composition -----------------------------------------------------------------------


def test_traced_executor_composes_the_exact_eager_program_compiler(model: CausalLM) -> None:
    lane = build_lane(model=model, block_size=BS, num_blocks=NUM_BLOCKS, max_chunk=CHUNK)
    try:
        foreign = ProgramCompiler(device=lane.device, kv_cache=lane.kv)
        with pytest.raises(IdentityError, match="program compiler"):
            TracedExecutor(
                eager_executor=lane.executor,
                trace_compiler=TraceCompiler(program_compiler=foreign, device=lane.device),
                trace_config=TraceConfig(mode="all"),
            )
        with pytest.raises(IdentityError, match="lane device"):
            TracedExecutor(
                eager_executor=lane.executor,
                trace_compiler=TraceCompiler(
                    program_compiler=lane.compiler, device=TorchDevice("cpu")
                ),
                trace_config=TraceConfig(mode="all"),
            )
    finally:
        lane.cleanup()
