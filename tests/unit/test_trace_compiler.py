"""``TraceCompiler`` over hand-built capture plans (registry, aliases, capture order, replay,
counters, coverage misses, events), and the decode refresh-decision table on a real lane:
each decision case by case, and that a weaker decision than the table's gives wrong logits."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import pytest
import torch
from lane_fixtures import (  # noqa: F401 (single_torch_thread: autouse)
    Lane,
    add_tracing,
    build_lane,
    page_table,
    single_torch_thread,
    tiny_llama,
)
from structlog.testing import capture_logs

from llmrt.device.torch import TorchDevice
from llmrt.errors import CompileGateClosed, TraceCoverageError, TraceStateError
from llmrt.families.base import CausalLM
from llmrt.lifecycle.events import configure_logging
from llmrt.runtime.decode import DecodeRuntime
from llmrt.runtime.program_compiler import ProgramCompiler
from llmrt.runtime.tensor_resources import allocate_many
from llmrt.runtime.trace_compiler import (
    ArtifactState,
    TraceArtifact,
    TraceCapturePlan,
    TraceCompiler,
)
from llmrt.testing import FaultyDevice

# -- toy plans -------------------------------------------------------------------------


@attrs.frozen
class Bound:
    is_bound: bool = True


@attrs.frozen
class Sig:
    operation: str
    batch: int
    tag: str = ""

    def material(self) -> Mapping[str, Any]:
        return {"batch": self.batch, "tag": self.tag}

    def describe(self) -> str:
        return f"{self.operation}[b{self.batch}{self.tag}]"


@attrs.define
class Toy:
    device: Any
    programs: ProgramCompiler
    traces: TraceCompiler
    captured: list[str] = attrs.Factory(list)  # descriptions, in capture order

    def plan(self, sig: Sig, *, trace_tag: str | None = None) -> TraceCapturePlan:
        """Compile ``sig`` and plan its trace: ``out = 2 * x + 1`` over a persistent ``x``."""
        device = self.device
        key = self.programs.compile(
            sig, lambda: {"out": device.allocate(shape=(sig.batch,), dtype=torch.float32)}
        ).key
        material = {"batch": sig.batch, "tag": sig.tag if trace_tag is None else trace_tag}

        def allocate() -> list[torch.Tensor]:
            return allocate_many(device=device, specs=[((sig.batch,), torch.float32)])

        def prime(inputs: list[torch.Tensor]) -> None:
            device.refresh(inputs[0], torch.ones(sig.batch))

        def program(inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
            if device.capturing:
                self.captured.append(sig.describe())
            return {"out": inputs[0] * 2 + 1}

        return TraceCapturePlan(
            program_key=key,
            operation=sig.operation,
            batch_size=sig.batch,
            material=material,
            description=sig.describe(),
            allocate_inputs=allocate,
            prime_inputs=prime,
            program=program,
        )


def _toy(fail: Mapping[str, Any] | None = None) -> Toy:
    device = FaultyDevice(TorchDevice("cpu"), fail=fail or {})
    programs = ProgramCompiler(device=device, kv_cache=Bound())
    return Toy(
        device=device,
        programs=programs,
        traces=TraceCompiler(program_compiler=programs, device=device),
    )


def _set(device: Any, value: float) -> Callable[[Any, TraceArtifact], None]:
    def refresh(inputs: list[torch.Tensor], _artifact: TraceArtifact) -> None:
        device.refresh(inputs[0], torch.full(inputs[0].shape, value))

    return refresh


def test_registration_needs_a_program_compiled_by_this_lane() -> None:
    toy = _toy()
    plan = toy.plan(Sig("decode", 2))
    other = _toy()
    with pytest.raises(TraceStateError, match="not compiled"):
        other.traces.register_capture_plan(plan)
    key = toy.traces.register_capture_plan(plan)
    assert toy.traces.register_capture_plan(plan) == key, "re-registering is idempotent"
    assert toy.traces.is_registered(plan.program_key) and not toy.traces.has_trace(plan.program_key)
    assert len(toy.traces.artifacts) == 1


def test_aliases_share_one_artifact_one_capture_and_one_replay_counter() -> None:
    toy = _toy()
    first = toy.plan(Sig("decode", 4, tag="a"), trace_tag="shared")
    second = toy.plan(Sig("decode", 4, tag="b"), trace_tag="shared")
    assert first.program_key != second.program_key and first.trace_key == second.trace_key
    with capture_logs() as logs:
        k1 = toy.traces.register_capture_plan(first)
        k2 = toy.traces.register_capture_plan(second)
    assert k1 == k2
    assert [e["alias"] for e in logs if e["event"] == "trace.registered"] == [False, True]
    (artifact,) = toy.traces.artifacts.values()
    assert artifact.program_keys == [first.program_key, second.program_key]
    toy.traces.capture_all()
    assert toy.device.stats().captures == 1 and toy.captured == ["decode[b4a]"]
    a1 = toy.traces.artifact_for(first.program_key, operation="decode", description="x")
    a2 = toy.traces.artifact_for(second.program_key, operation="decode", description="y")
    assert a1 is a2 is artifact
    out = toy.traces.replay(a1, refresh=_set(toy.device, 3.0))
    assert torch.equal(out["out"], torch.full((4,), 7.0))
    out = toy.traces.replay(a2, refresh=_set(toy.device, 5.0))
    assert torch.equal(out["out"], torch.full((4,), 11.0))
    assert artifact.replays == 2
    assert toy.traces.replay_counts() == {"decode[b4a]": 2}
    assert toy.device.stats().replays == 2
    toy.traces.cleanup()


def test_capture_allocates_every_input_first_then_captures_decode_before_prefill() -> None:
    toy = _toy()
    sigs = [Sig("prefill", 1), Sig("decode", 2), Sig("prefill", 4), Sig("decode", 8)]
    for sig in sigs:
        toy.traces.register_capture_plan(toy.plan(sig))
    order = [a.plan.description for a in toy.traces.capture_order()]
    assert order == ["decode[b8]", "decode[b2]", "prefill[b4]", "prefill[b1]"]
    start = len(toy.device.calls)
    toy.traces.capture_all()
    ops = [c.op for c in toy.device.calls[start:]]
    first_capture = ops.index("capture_trace")
    assert ops.count("allocate") == 4 and "allocate" not in ops[first_capture:]
    assert toy.captured == order
    assert all(a.state is ArtifactState.CAPTURED for a in toy.traces.artifacts.values())
    assert toy.traces.active and toy.programs.gate_closed
    toy.traces.cleanup()


def test_after_activation_nothing_new_compiles_or_registers() -> None:
    toy = _toy()
    toy.traces.register_capture_plan(toy.plan(Sig("decode", 2)))
    late = toy.plan(Sig("prefill", 2))  # compiled before capture, registered after
    toy.traces.capture_all()
    with pytest.raises(CompileGateClosed):
        toy.traces.register_capture_plan(late)
    with pytest.raises(CompileGateClosed):
        toy.plan(Sig("prefill", 8))
    assert not toy.traces.is_registered(late.program_key)
    toy.traces.cleanup()


def test_replay_refreshes_then_executes_without_blocking() -> None:
    toy = _toy()
    plan = toy.plan(Sig("decode", 3))
    toy.traces.register_capture_plan(plan)
    toy.traces.capture_all()
    artifact = toy.traces.artifact_for(plan.program_key, operation="decode", description="d")
    assert torch.equal(artifact.outputs["out"], torch.full((3,), 3.0)), "primed at capture"
    inner = toy.device.inner
    flags: list[bool] = []
    real = inner.execute_trace

    def spy(trace: Any, *, blocking: bool = False) -> None:
        flags.append(blocking)
        real(trace, blocking=blocking)

    inner.execute_trace = spy  # type: ignore[method-assign]
    seen: list[str] = []

    def refresh(inputs: list[torch.Tensor], art: TraceArtifact) -> None:
        seen.append(f"refresh replays={art.replays}")
        toy.device.refresh(inputs[0], torch.tensor([0.0, 1.0, 2.0]))

    out = toy.traces.replay(artifact, refresh=refresh)
    assert seen == ["refresh replays=0"] and flags == [False]
    assert out is artifact.outputs and torch.equal(out["out"], torch.tensor([1.0, 3.0, 5.0]))
    ops = [c.op for c in toy.device.calls]
    assert ops[-2:] == ["refresh", "execute_trace"]
    toy.traces.cleanup()


def test_coverage_misses_name_the_missing_signature() -> None:
    toy = _toy()
    plan = toy.plan(Sig("decode", 2))
    with pytest.raises(TraceCoverageError) as exc:
        toy.traces.artifact_for(plan.program_key, operation="decode", description="decode[b2]")
    assert exc.value.operation == "decode" and exc.value.missing == ("decode[b2]",)
    assert "decode[b2]" in str(exc.value)
    toy.traces.register_capture_plan(plan)
    with pytest.raises(TraceCoverageError):  # registered but not captured yet
        toy.traces.artifact_for(plan.program_key, operation="decode", description="decode[b2]")
    (artifact,) = toy.traces.artifacts.values()
    with pytest.raises(TraceStateError, match="registered"):
        toy.traces.replay(artifact, refresh=_set(toy.device, 1.0))
    toy.traces.capture_all()
    toy.traces.cleanup()
    toy.traces.cleanup()  # idempotent
    assert artifact.state is ArtifactState.RELEASED
    with pytest.raises(TraceStateError, match="released"):
        toy.traces.replay(artifact, refresh=_set(toy.device, 1.0))
    with pytest.raises(TraceCoverageError):
        toy.traces.artifact_for(plan.program_key, operation="decode", description="decode[b2]")
    assert toy.device.stats().live_tensors == 0 and toy.device.stats().live_traces == 0


@pytest.mark.parametrize("level", ["info", "debug"])
def test_lifecycle_events_and_replay_only_at_debug(level: str) -> None:
    configure_logging(level=level, console=False)  # before building: the filter binds early
    toy = _toy()
    plan = toy.plan(Sig("decode", 2))
    with capture_logs() as logs:
        toy.traces.register_capture_plan(plan)
        toy.traces.capture_all()
        artifact = toy.traces.artifact_for(plan.program_key, operation="decode", description="d")
        toy.traces.replay(artifact, refresh=_set(toy.device, 2.0))
        toy.traces.replay(artifact, refresh=_set(toy.device, 2.0))
        toy.traces.cleanup()
    names = [e["event"] for e in logs if e.get("component") == "trace_compiler"]
    replays = ["trace.replayed"] * 2 if level == "debug" else []
    assert names == [
        "trace.registered",
        "trace.captured",
        "trace.activated",
        *replays,
        "trace.released",
    ]
    for event in logs:
        if event.get("component") == "trace_compiler":
            assert event["lane"] == 0 and event["object_id"] == f"{id(toy.traces):#x}"
    gate = [e for e in logs if e["event"] == "compile_gate.closed"]
    assert len(gate) == 1 and gate[0]["object_id"] == f"{id(toy.programs):#x}"
    if level == "debug":
        replayed = [e for e in logs if e["event"] == "trace.replayed"]
        assert [e["replays"] for e in replayed] == [1, 2]
        assert replayed[0]["signature"] == "decode[b2]" and replayed[0]["log_level"] == "debug"


# -- the decode refresh-decision table -------------------------------------------------

BS = 4
W = 64  # the page-table width of the layout below (256 positions / 4)
ROW0 = [0, 1]  # covers positions 0..7
ROW1 = [8, 9, 10]  # covers positions 0..11


@pytest.fixture(scope="module")
def model(torch_device: str) -> CausalLM:
    return tiny_llama(device=torch_device)


@pytest.fixture
def lane(model: CausalLM, torch_device: str) -> Iterator[Lane]:
    """A decode_only lane, warmed and captured (the decode trace has not replayed yet), on
    every torch device: on cuda the trace is a CUDA graph and replays must equal eager."""
    lane = build_lane(
        model=model, block_size=BS, num_blocks=64, max_chunk=16, torch_device=torch_device
    )
    add_tracing(lane, mode="decode_only", seq_lens=(8,), batch_sizes=(1,))
    assert lane.tracing is not None
    lane.tracing.warm()
    assert lane.tracing.warmup.captured
    yield lane
    lane.cleanup()
    assert lane.live_tensors() == lane.baseline_live
    assert lane.inner.stats().live_traces == 0


def _step(tokens: Sequence[int], pos: Sequence[int], blocks: Sequence[Sequence[int]], **kw: Any):
    return {
        "tokens": list(tokens),
        "start_pos": list(pos),
        "page_table": page_table(blocks, width=W),
        **kw,
    }


S0 = _step([3, 5], [6, 9], [ROW0, ROW1])
S1 = _step([4, 6], [7, 10], [ROW0, ROW1])
S2_CROSS = _step([3, 8], [8, 11], [[*ROW0, 2], ROW1])  # row 0 crosses into a new block
S1_RESET = _step([7, 2], [2, 3], [[20], [21]], reset_batch=True)  # a fresh batch
S1_AGAIN = _step([4, 6], [6, 9], [ROW0, ROW1])  # repeats a position: feedback is stale
EAGER = "eager"

# name -> (steps, decisions of the traced steps, the step whose refresh is weakened, to what)
CASES: dict[str, tuple[list[Any], list[str | None], int | None, str | None]] = {
    "first_replay": ([S0], ["full"], 0, "fields"),
    "steady_state": ([S0, S1], ["full", "fields"], None, None),
    "page_table_change": ([S0, S1, S2_CROSS], ["full", "fields", "page_table"], 2, "fields"),
    "reset_batch": ([S0, S1, S1_RESET], ["full", "fields", "full"], 2, "page_table"),
    "graph_switch": ([S0, (EAGER, S1), S2_CROSS], ["full", None, "full"], 2, "page_table"),
    "incompatible_feedback": ([S0, S1, S1_AGAIN], ["full", "fields", "full"], 2, "fields"),
}


def _run(lane: Lane, steps: Sequence[Any], *, traced: bool) -> tuple[list[torch.Tensor], list[Any]]:
    """Logits of every step and the decode trace's refresh decision after each traced step."""
    assert lane.tracing is not None
    (artifact,) = lane.tracing.traces.artifacts.values()
    logits, decisions = [], []
    for step in steps:
        eager = isinstance(step, tuple)
        args = step[1] if eager else step
        executor = lane.executor if eager or not traced else lane.tracing.executor
        before = artifact.replays
        out = executor.decode_forward(**args)
        logits.append(out.logits.clone())
        if traced:
            replayed = artifact.replays == before + 1
            assert replayed != eager
            decisions.append(artifact.replay_state["last_refresh"] if replayed else None)
    return logits, decisions


def _eager_then_reset(lane: Lane, steps: Sequence[Any]) -> list[torch.Tensor]:
    saved = lane.snapshot()
    want, _ = _run(lane, steps, traced=False)
    lane.restore(saved)
    lane.decode.cleanup_transients()  # forget the eager steps' device state
    return want


@pytest.mark.parametrize("case", list(CASES))
def test_refresh_decision_table(lane: Lane, case: str) -> None:
    steps, decisions, _, _ = CASES[case]
    want = _eager_then_reset(lane, steps)
    got, seen = _run(lane, steps, traced=True)
    assert seen == decisions
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {step} differs from eager"


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][2] is not None])
def test_a_missed_refresh_gives_wrong_logits(
    lane: Lane, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps, decisions, weak_step, weaker = CASES[case]
    want = _eager_then_reset(lane, steps)
    real = lane.decode.refresh_decision
    calls = iter(range(len(steps)))
    traced_steps = [i for i, s in enumerate(steps) if not isinstance(s, tuple)]

    def weakened(prepared: Any, artifact: TraceArtifact) -> str:
        index = traced_steps[next(calls)]
        decision = real(prepared, artifact)
        if index == weak_step:
            assert decision == decisions[index]
            return weaker  # type: ignore[return-value]
        return decision

    monkeypatch.setattr(lane.decode, "refresh_decision", weakened)
    got, _ = _run(lane, steps, traced=True)
    for step in range(weak_step):  # type: ignore[arg-type]
        assert torch.equal(got[step], want[step])
    wrong = got[weak_step]  # type: ignore[index]
    right = want[weak_step]  # type: ignore[index]
    assert not torch.allclose(wrong, right, atol=1e-3), f"{case}: a missed refresh went unnoticed"
    assert not torch.equal(wrong.argmax(-1), right.argmax(-1)), "the greedy token is wrong too"


def _prepare(decode: DecodeRuntime, step: Mapping[str, Any]) -> Any:
    return decode.prepare(**step)


def test_each_clause_of_the_decision_alone(lane: Lane) -> None:
    """refresh_decision on evolved prepared steps: each trigger on its own."""
    assert lane.tracing is not None
    decode = lane.decode
    (artifact,) = lane.tracing.traces.artifacts.values()
    steady = _prepare(decode, S0)
    steady = attrs.evolve(steady, feedback_compatible=True, page_table_changed=False)
    assert decode.refresh_decision(steady, artifact) == "full", "first replay"
    lane.tracing.executor.decode_forward(**S0)
    assert artifact.replays == 1
    follow = _prepare(decode, S1)
    assert follow.feedback_compatible and not follow.page_table_changed
    assert decode.refresh_decision(follow, artifact) == "fields"
    assert decode.refresh_decision(attrs.evolve(follow, reset_batch=True), artifact) == "full"
    stale = attrs.evolve(follow, feedback_compatible=False)
    assert decode.refresh_decision(stale, artifact) == "full"
    moved = attrs.evolve(follow, page_table_changed=True)
    assert decode.refresh_decision(moved, artifact) == "page_table"
    other = attrs.evolve(artifact, trace_key="another trace")
    assert other.replays == artifact.replays == 1
    assert decode.refresh_decision(follow, other) == "full", "graph switch"
    decode.note_submitted(follow, artifact=None)  # an eager step ran in between
    assert decode.refresh_decision(_prepare(decode, S2_CROSS), artifact) == "full"
