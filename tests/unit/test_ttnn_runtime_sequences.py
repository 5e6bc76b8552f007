"""The runtime's TT call sequences: real runtime objects over ``TtnnDevice`` + ``FakeTtnn``.

The paged-KV manager, output reader, prefill and decode runtimes, program compiler, eager and
traced executors, trace compiler and model executor run a TTTv2-style toy model
(``llmrt.testing.ttnn_toy_model``) whose forwards use only ttnn ops. The fake rejects torch
functions and methods on device tensors (``torch_ops="reject"``, as a real ``ttnn.Tensor``)
and raises on every TT rule (allocation while a trace is live, host traffic inside a capture,
host reads before their event, deallocating a live trace's tensors, double deallocation), so
a runtime that only works on torch tensors, or breaks a TT rule, fails here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import pytest
import torch
from lane_fixtures import build_runtimes

from llmrt.device.ttnn import TtnnDevice
from llmrt.errors import CleanupError, DeviceError
from llmrt.runtime.config import PagedKVCacheConfig, PageTableLayout, TraceConfig, WarmupConfig
from llmrt.runtime.decode import DecodeOutput, DecodeOutputLease, DecodeRuntime
from llmrt.runtime.execution import EagerExecutor, TracedExecutor
from llmrt.runtime.model_executor import CLEANUP_STEPS, ModelExecutor
from llmrt.runtime.output_reader import OutputReader
from llmrt.runtime.paged_kv_cache import PagedKVCacheManager
from llmrt.runtime.prefill.plan import PrefillRow
from llmrt.runtime.prefill.runtime import PrefillRuntime
from llmrt.runtime.program_compiler import ProgramCompiler
from llmrt.runtime.trace_compiler import TraceCompiler
from llmrt.runtime.warmup import WarmupCoordinator, WarmupCoordinatorConfig
from llmrt.sampling.params import SamplingParams
from llmrt.testing.fake_ttnn import FakeTtnn, InjectedTtnnFailure, TtnnCall
from llmrt.testing.ttnn_toy_model import MODEL_OPS as TOY_MODEL_OPS
from llmrt.testing.ttnn_toy_model import ToyTtnnModel

BLOCK = 4
NUM_BLOCKS = 16
CAPACITY = 2
MODEL_OPS = frozenset(TOY_MODEL_OPS)
ALLOCATING = frozenset({"to_device", "allocate_tensor_on_device"})
GREEDY = SamplingParams(temperature=0.0)

PROMPTS = ([3, 17, 5, 9, 30], [8, 1, 22])
BLOCKS = ([0, 1, 2], [5, 6, 7])


@pytest.fixture(autouse=True)
def single_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@attrs.define(eq=False)
class TtLane:
    """One lane assembled by hand over a fake mesh, as the containers would build it."""

    fake: FakeTtnn
    device: TtnnDevice
    model: ToyTtnnModel
    kv: PagedKVCacheManager
    reader: OutputReader
    prefill: PrefillRuntime
    decode: DecodeRuntime
    compiler: ProgramCompiler
    eager: EagerExecutor
    traced: TracedExecutor | None = None
    warmup: WarmupCoordinator | None = None
    executor: ModelExecutor | None = None
    freed: list[Any] = attrs.Factory(list)  # every tensor passed to ttnn.deallocate, in order
    kv_tensors: list[Any] = attrs.Factory(list)  # every K then every V tensor, as bound

    @property
    def runner(self) -> EagerExecutor | TracedExecutor:
        return self.traced if self.traced is not None else self.eager


def build_lane(*, trace_mode: str = "none", fake: FakeTtnn | None = None) -> TtLane:
    """KV, reader, runtimes, compiler, eager (and traced) executor and the model executor."""
    fake = fake or FakeTtnn(torch_ops="reject")
    freed: list[Any] = []
    deallocate = fake.deallocate

    def recording_deallocate(tensor: Any, force: bool = True) -> None:
        freed.append(tensor)  # kept alive, so identities stay distinct
        deallocate(tensor, force=force)

    fake.deallocate = recording_deallocate  # type: ignore[method-assign]
    mesh = fake.open_mesh_device(fake.MeshShape(1, 1), trace_region_size=1 << 20)
    device = TtnnDevice(mesh, ttnn_module=fake)
    model = ToyTtnnModel(mesh_device=mesh, ttnn_module=fake)
    kv = PagedKVCacheManager(
        model=model,
        device=device,
        config=PagedKVCacheConfig(
            block_size=BLOCK, max_num_blocks=NUM_BLOCKS, num_blocks=NUM_BLOCKS
        ),
    )
    kv.configure()
    context = kv.allocate()
    layout = PageTableLayout.resolve(
        block_size=BLOCK,
        model_max_sequence_length=model.config.max_position_embeddings,
        physical_num_blocks=NUM_BLOCKS,
        max_prefill_chunk_size=16,
    )
    reader, prefill, decode, compiler, eager = build_runtimes(
        model=model, device=device, kv=kv, layout=layout, lane_capacity=CAPACITY, max_batch_size=2
    )
    lane = TtLane(
        fake=fake,
        device=device,
        model=model,
        kv=kv,
        reader=reader,
        prefill=prefill,
        decode=decode,
        compiler=compiler,
        eager=eager,
        freed=freed,
        kv_tensors=[*context.keys, *context.values],
    )
    trace = TraceConfig(mode=trace_mode)
    if trace.enabled:
        traces = TraceCompiler(program_compiler=compiler, device=device)
        lane.traced = TracedExecutor(
            eager_executor=eager, trace_compiler=traces, trace_config=trace
        )
    lane.warmup = WarmupCoordinator(
        WarmupCoordinatorConfig.resolve(
            warmup=WarmupConfig(prefill_seq_lens=(8,), prefill_batch_sizes=(1, 2)),
            trace=trace,
            execution=lane.runner,
        ),
        execution=lane.runner,
    )
    lane.executor = ModelExecutor(
        kv_cache=kv, output_reader=reader, eager=eager, traced=lane.traced, warmup=lane.warmup
    )
    return lane


def rows(prompts: Sequence[Sequence[int]], *, cached: Sequence[int] = (0, 0)) -> list[PrefillRow]:
    return [
        PrefillRow(
            source_row=i,
            tokens=torch.tensor(list(prompt), dtype=torch.int64),
            cached_tokens=cached[i],
            slot=i,
            block_ids=tuple(BLOCKS[i][: -(-len(prompt) // BLOCK)]),
        )
        for i, prompt in enumerate(prompts)
    ]


def page_table(width: int = 3) -> torch.Tensor:
    return torch.tensor([list(b[:width]) for b in BLOCKS], dtype=torch.int32)


def names(calls: Sequence[TtnnCall]) -> list[str]:
    return [c.name for c in calls]


def collapse(calls: Sequence[TtnnCall]) -> list[str]:
    """Call names with each run of model ops folded into one ``"model"``."""
    out: list[str] = []
    for name in names(calls):
        name = "model" if name in MODEL_OPS else name
        if not (name == "model" and out and out[-1] == "model"):
            out.append(name)
    return out


def allocations(calls: Sequence[TtnnCall]) -> list[TtnnCall]:
    """Calls that allocate device memory (``from_torch`` with a device, ``to_device``, ...)."""
    return [
        c
        for c in calls
        if c.name in ALLOCATING or (c.name == "from_torch" and c.mesh_id is not None)
    ]


def greedy_reference(model: ToyTtnnModel, history: Sequence[int]) -> int:
    return int(torch.argmax(model.reference_logits(history)))


def decode_inputs(histories: Sequence[Sequence[int]]) -> dict[str, Any]:
    return {
        "tokens": [h[-1] for h in histories],
        "start_pos": [len(h) - 1 for h in histories],
        "page_table": page_table(),
    }


def assert_clean(lane: TtLane) -> None:
    """Full teardown through the model executor; nothing leaks, nothing freed twice."""
    assert lane.executor is not None
    lane.executor.cleanup()
    lane.model.close()
    stats = lane.device.stats()
    assert (stats.live_tensors, stats.live_traces, stats.pending_reads) == (0, 0, 0)
    assert lane.fake.violations == ()
    assert len({id(t) for t in lane.freed}) == len(lane.freed)  # nothing freed twice
    assert all(not t.is_allocated() for t in lane.kv_tensors)


# (1) eager prefill


def test_eager_prefill_uploads_runs_ttnn_ops_and_reads_back() -> None:
    lane = build_lane()
    fake = lane.fake
    assert len(allocations(fake.calls)) == 2 + 4  # two model weights, then K and V of two layers
    assert lane.device.stats().live_tensors == 4
    start = len(fake.calls)

    out = lane.eager.prefill_forward(rows=rows(PROMPTS), sampling_params=GREEDY)

    calls = fake.calls[start:]
    step = ["from_torch"] * 5 + ["model"] + ["deallocate"] * 5
    read = ["Tensor.cpu", "record_event", "event_synchronize", "to_torch"]
    assert collapse(calls) == step + read
    assert {c.name for c in calls} >= MODEL_OPS
    mesh_id = lane.device.mesh_device.id()
    assert all(c.mesh_id == mesh_id for c in calls if c.name in MODEL_OPS)
    assert "begin_trace_capture" not in names(fake.calls)
    assert out.tokens is not None
    assert out.tokens.tolist() == [greedy_reference(lane.model, p) for p in PROMPTS]
    assert lane.device.stats().live_tensors == 4
    assert lane.reader.pending_count == 0
    assert fake.violations == ()
    assert_clean(lane)


def test_eager_prefill_logits_follow_the_kv_written_through_the_page_table() -> None:
    lane = build_lane()
    first = lane.eager.prefill_forward(rows=rows(PROMPTS))
    assert first.logits is not None
    for row, prompt in enumerate(PROMPTS):
        assert torch.equal(first.logits[row], lane.model.reference_logits(prompt))

    # A second call with a cached prefix reads the first call's KV through the page table.
    suffixes = ([11, 4], [19])
    grown = [p + s for p, s in zip(PROMPTS, suffixes, strict=True)]
    second = lane.eager.prefill_forward(rows=rows(grown, cached=[BLOCK, 0]))
    assert second.logits is not None
    for row, history in enumerate(grown):
        assert torch.equal(second.logits[row], lane.model.reference_logits(history))
    assert lane.fake.violations == ()
    assert_clean(lane)


def test_the_lanes_fake_refuses_torch_on_device_tensors_as_ttnn_does() -> None:
    """What the runtime must not do with a program's outputs on ttnn (argmax, clone, add_)."""
    lane = build_lane()
    x = lane.device.upload(torch.ones(2))
    with pytest.raises(RuntimeError, match="torch function on a ttnn tensor"):
        torch.argmax(x)
    for method in ("clone", "add_"):
        with pytest.raises(AttributeError, match=method):
            getattr(x, method)
    lane.device.deallocate(x)
    assert [v.rule for v in lane.fake.violations] == ["torch function on a ttnn tensor"]


def test_sampling_with_penalties_runs_on_the_host_copy_of_the_logits() -> None:
    params = SamplingParams(temperature=0.8, seed=7, repetition_penalty=1.3, logprobs=2)
    results = []
    for _ in range(2):
        lane = build_lane()
        out = lane.eager.prefill_forward(
            rows=rows(PROMPTS), sampling_params=params, history=[(p, ()) for p in PROMPTS]
        )
        assert out.tokens is not None and out.logprobs is not None
        assert out.top_logprobs is not None and out.top_logprobs[0].shape == (2, 2)
        results.append(out.tokens.tolist())
        assert_clean(lane)
    assert results[0] == results[1]  # seeded: the same tokens on every lane
    assert all(0 <= t < 32 for t in results[0])


def test_traced_prefill_reads_are_submitted_before_the_next_replay() -> None:
    """Two chunked requests replay one prefill trace; each request's read is queued right after
    its replay (ttnn has no torch clone of trace outputs), so neither sees the other's logits."""
    prompts = ([3, 17, 5, 9, 30], [8, 1, 22, 19, 12])
    lane = build_lane(trace_mode="all")
    assert lane.traced is not None and lane.warmup is not None
    lane.warmup.warmup_prefill()
    lane.warmup.warmup_decode()
    first = lane.traced.prefill_forward(rows=rows(prompts), sampling_params=GREEDY)
    assert first.tokens is not None
    assert first.tokens.tolist() == [greedy_reference(lane.model, p) for p in prompts]

    grown = [[*prompts[0], 11, 4], [*prompts[1], 2, 6, 6]]
    start = len(lane.fake.calls)
    second = lane.traced.prefill_forward(rows=rows(grown, cached=[BLOCK, BLOCK]))

    refresh = ["from_torch", "copy_host_to_device_tensor"] * 5
    replay = ["execute_trace", "Tensor.cpu", "record_event"]
    completes = ["event_synchronize", "to_torch"] * 2
    assert collapse(lane.fake.calls[start:]) == (refresh + replay) * 2 + completes
    assert second.logits is not None
    for row, history in enumerate(grown):
        assert torch.equal(second.logits[row], lane.model.reference_logits(history))
    begin = names(lane.fake.calls).index("begin_trace_capture")
    assert allocations(lane.fake.calls[begin:]) == []
    assert_clean(lane)


# (2) traced decode with async reads

STEPS = 4


def eager_decode_histories(*, steps: int = STEPS) -> list[list[int]]:
    """Prompts plus greedy tokens from an eager lane (prefill, then blocking decode steps)."""
    lane = build_lane()
    first = lane.eager.prefill_forward(rows=rows(PROMPTS), sampling_params=GREEDY)
    assert first.tokens is not None
    histories = [[*p, int(t)] for p, t in zip(PROMPTS, first.tokens.tolist(), strict=True)]
    for _ in range(steps):
        out = lane.eager.decode_forward(
            **decode_inputs(histories), sampling_params=[GREEDY, GREEDY]
        )
        assert isinstance(out, DecodeOutput) and out.tokens is not None
        for history, token in zip(histories, out.tokens.tolist(), strict=True):
            history.append(int(token))
    assert lane.fake.violations == ()
    assert_clean(lane)
    return histories


def traced_decode_lane() -> TtLane:
    """Prefill the prompts eagerly, then warm up: compile, register, capture the decode trace."""
    lane = build_lane(trace_mode="decode_only")
    assert lane.traced is not None and lane.warmup is not None
    lane.traced.prefill_forward(rows=rows(PROMPTS), sampling_params=GREEDY)
    lane.warmup.warmup_prefill()
    lane.warmup.warmup_decode()
    assert lane.warmup.captured
    return lane


def test_traced_decode_with_async_reads_matches_the_eager_lane() -> None:
    histories = eager_decode_histories()
    lane = traced_decode_lane()
    fake, traced = lane.fake, lane.traced
    assert traced is not None
    calls = fake.calls
    begin = names(calls).index("begin_trace_capture")
    end = names(calls).index("end_trace_capture")
    assert names(calls).count("begin_trace_capture") == 1
    assert allocations(calls[begin:]) == []
    assert all(t.is_allocated() for t in lane.kv_tensors)
    assert len(allocations(calls[:begin])) >= 2 + 4 + 3  # weights, KV, trace inputs came first
    assert set(names(calls[begin + 1 : end])) <= MODEL_OPS  # no host traffic inside the capture

    # Pipelined steps: each step's read is submitted before the next replay rewrites the outputs.
    start = len(fake.calls)
    pending: list[tuple[Any, tuple[Any, ...]]] = []
    for step in range(STEPS):
        inputs = decode_inputs([h[: len(PROMPTS[r]) + 1 + step] for r, h in enumerate(histories)])
        lease = traced.decode_forward(
            **inputs, sampling_params=[GREEDY, GREEDY], read_from_device=False
        )
        assert isinstance(lease, DecodeOutputLease) and lease.is_tokens
        host, events = lane.decode.read_decode_output(lease, async_read=True)
        assert len(events) == 1
        pending.append((host, events))
    submitted = collapse(fake.calls[start:])
    refresh = ["from_torch", "copy_host_to_device_tensor"]
    replay = ["execute_trace", "Tensor.cpu", "record_event"]
    # First replay: full refresh; then tokens and positions (no device position feedback on ttnn).
    assert submitted == refresh * 3 + replay + (refresh * 2 + replay) * (STEPS - 1)

    start = len(fake.calls)
    got = [
        lane.decode.process_decode_output_host(host, is_tokens=True).tokens for host, _ in pending
    ]
    assert collapse(fake.calls[start:]) == ["event_synchronize", "to_torch"] * STEPS
    for step, tokens in enumerate(got):
        assert tokens is not None
        expected = [h[len(PROMPTS[r]) + 1 + step] for r, h in enumerate(histories)]
        assert tokens.tolist() == expected
        for r, h in enumerate(histories):
            assert expected[r] == greedy_reference(lane.model, h[: len(PROMPTS[r]) + 1 + step])
    assert lane.decode.outstanding_leases == 0
    assert fake.violations == ()
    assert_clean(lane)


def test_an_eager_decode_lease_read_blocking_completes_the_submitted_read() -> None:
    lane = build_lane()
    lane.eager.prefill_forward(rows=rows(PROMPTS))
    histories = [[*p, 0] for p in PROMPTS]
    lease = lane.eager.decode_forward(
        **decode_inputs(histories), sampling_params=[GREEDY, GREEDY], read_from_device=False
    )
    assert isinstance(lease, DecodeOutputLease)
    assert lane.reader.pending_count == 1  # submitted when the program ran
    start = len(lane.fake.calls)
    host, events = lane.decode.read_decode_output(lease, async_read=False)
    assert events == ()
    assert names(lane.fake.calls[start:]) == ["event_synchronize", "to_torch"]
    out = lane.decode.process_decode_output_host(host, is_tokens=True)
    assert out.tokens is not None
    assert out.tokens.tolist() == [greedy_reference(lane.model, h) for h in histories]
    assert lane.decode.outstanding_leases == 0 and lane.reader.pending_count == 0
    assert_clean(lane)


def test_a_missed_position_refresh_changes_the_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy model sees stale trace inputs: refreshing only tokens (relying on device position
    feedback ttnn traces do not have) gives logits that differ from the reference."""
    histories = [[*p, 0] for p in PROMPTS]

    def run(lane: TtLane) -> list[bool]:
        assert lane.traced is not None
        matches = []
        for step in range(3):
            grown = [[*h, *[7, 9][:step]] for h in histories]
            out = lane.traced.decode_forward(**decode_inputs(grown))
            assert isinstance(out, DecodeOutput) and out.logits is not None
            matches.append(
                all(
                    torch.equal(out.logits[r], lane.model.reference_logits(h))
                    for r, h in enumerate(grown)
                )
            )
        return matches

    lane = traced_decode_lane()
    assert run(lane) == [True, True, True]
    assert_clean(lane)

    def tokens_only(self: DecodeRuntime, prepared: Any, inputs: Any, artifact: Any) -> str:
        decision = self.refresh_decision(prepared, artifact)
        if decision == "full":
            self._refresh_all(inputs, prepared)
        else:
            self.config.device.refresh(inputs.tokens, prepared.tokens)
        return decision

    monkeypatch.setattr(DecodeRuntime, "refresh_trace", tokens_only)
    stale = traced_decode_lane()
    assert run(stale) == [True, False, False]
    assert_clean(stale)


# (3) capture failure


@pytest.mark.parametrize("failing", ["begin_trace_capture", "end_trace_capture"])
def test_capture_failure_releases_the_artifacts_inputs_once_and_propagates(failing: str) -> None:
    lane = build_lane(trace_mode="decode_only")
    assert lane.traced is not None and lane.warmup is not None
    fake = lane.fake
    lane.warmup.warmup_prefill()
    fake.inject(failing, 1)
    start = len(fake.calls)

    with pytest.raises(DeviceError, match=rf"capture_trace: ttnn\.{failing} failed") as caught:
        lane.warmup.warmup_decode()

    assert isinstance(caught.value.__cause__, InjectedTtnnFailure)
    calls = fake.calls[start:]
    # Compile: stage, run, free the staged inputs, synchronize, free the program's output.
    compile_ = ["from_torch"] * 3 + ["model"] + ["deallocate"] * 3
    compile_ += ["synchronize_device", "deallocate"]
    allocate = ["from_torch"] * 3  # the trace's persistent inputs, before any capture
    prime = ["from_torch", "copy_host_to_device_tensor"] * 3
    capture = ["begin_trace_capture"]
    if failing == "end_trace_capture":  # ended again, then released, before the inputs go
        capture += ["model", "end_trace_capture", "end_trace_capture", "release_trace"]
    release = ["deallocate"] * 3
    assert collapse(calls) == compile_ + allocate + prime + capture + release
    injected = [c.injected for c in calls if c.name == failing]
    assert injected == ([True, False] if failing == "end_trace_capture" else [True])
    assert len(allocations(calls)) == 6
    assert lane.device.stats().live_tensors == 4  # only the KV cache is left
    assert lane.device.stats().live_traces == 0
    assert not lane.warmup.captured
    (artifact,) = lane.traced.trace_compiler.artifacts.values()
    # All or nothing: rolled back to registered (a retry captures it), gate reopened.
    assert artifact.state.value == "registered" and artifact.inputs is None
    assert not lane.traced.trace_compiler.program_compiler.gate_closed

    before = len(lane.freed)
    lane.traced.trace_compiler.cleanup()
    assert len(lane.freed) == before  # nothing released a second time
    assert fake.violations == ()
    assert_clean(lane)


# (4) cleanup


def cleanup_marks(monkeypatch: pytest.MonkeyPatch, fake: FakeTtnn) -> list[tuple[str, str, int]]:
    """``(event, step, fake call index)`` for every cleanup step the model executor runs."""
    import llmrt.runtime.model_executor as module

    marks: list[tuple[str, str, int]] = []
    emit = module.emit

    def spy(log: Any, event: str, **fields: Any) -> None:
        if event in ("cleanup.step", "cleanup.failed"):
            marks.append((event, fields["step"], len(fake.calls)))
        emit(log, event, **fields)

    monkeypatch.setattr(module, "emit", spy)
    return marks


def calls_per_step(
    fake: FakeTtnn, marks: Sequence[tuple[str, str, int]], start: int
) -> dict[str, list[str]]:
    per_step: dict[str, list[str]] = {}
    for _, step, end in marks:
        per_step[step] = names(fake.calls[start:end])
        start = end
    return per_step


def decoding_lane() -> tuple[TtLane, DecodeOutputLease]:
    """A traced lane after two decode steps, the second one's lease never read."""
    lane = traced_decode_lane()
    assert lane.traced is not None
    histories = [[*p, 0] for p in PROMPTS]
    lane.traced.decode_forward(**decode_inputs(histories), sampling_params=[GREEDY, GREEDY])
    lease = lane.traced.decode_forward(
        **decode_inputs([[*h, 1] for h in histories]),
        sampling_params=[GREEDY, GREEDY],
        read_from_device=False,
    )
    assert isinstance(lease, DecodeOutputLease)
    return lane, lease


def test_cleanup_runs_the_eight_steps_and_releases_traces_before_their_inputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lane, _ = decoding_lane()
    assert lane.executor is not None
    fake = lane.fake
    marks = cleanup_marks(monkeypatch, fake)
    start = len(fake.calls)

    lane.executor.cleanup()

    assert [(event, step) for event, step, _ in marks] == [
        ("cleanup.step", s) for s in CLEANUP_STEPS
    ]
    assert calls_per_step(fake, marks, start) == {
        # the unread lease's read: the device synchronize completes it
        "external_decode_leases": ["synchronize_device", "to_torch"],
        "pending_output_reads": [],
        "prefill_transients": [],
        "decode_transients": [],
        "traces": ["release_trace"] + ["deallocate"] * 3,
        "program_registry": [],
        "device_sampling_buffers": [],
        "paged_kv_cache": ["deallocate"] * 4,
    }
    lane.executor.cleanup()  # idempotent: no call at all
    assert len(fake.calls) == marks[-1][2]
    assert_clean(lane)


def test_a_failed_release_trace_is_retried_before_the_trace_inputs_go() -> None:
    lane, _ = decoding_lane()
    assert lane.traced is not None and lane.executor is not None
    fake, traces = lane.fake, lane.traced.trace_compiler
    fake.inject("release_trace", 1)
    start = len(fake.calls)

    with pytest.raises(CleanupError) as caught:
        traces.cleanup()
    assert [step for step, _ in caught.value.failures] == ["release_trace decode[b2 w16]"]
    assert names(fake.calls[start:]) == ["release_trace"]  # the inputs stay while it is live
    assert lane.device.stats().live_traces == 1

    retry = len(fake.calls)
    traces.cleanup()
    assert names(fake.calls[retry:]) == ["release_trace"] + ["deallocate"] * 3
    done = len(fake.calls)
    traces.cleanup()
    assert len(fake.calls) == done
    assert [c.injected for c in fake.calls if c.name == "release_trace"] == [True, False]
    assert fake.violations == ()
    assert_clean(lane)  # the model executor's eight steps: nothing is released twice


def test_model_executor_keeps_the_kv_cache_while_a_trace_is_live(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lane, _ = decoding_lane()
    assert lane.executor is not None
    fake = lane.fake
    fake.inject("release_trace", 1)
    marks = cleanup_marks(monkeypatch, fake)
    start = len(fake.calls)

    with pytest.raises(CleanupError) as caught:
        lane.executor.cleanup()
    assert "lane0/traces" in [step for step, _ in caught.value.failures]
    assert calls_per_step(fake, marks, start)["traces"] == ["release_trace"]
    assert fake.violations == ()  # nothing the live trace uses was deallocated

    lane.executor.cleanup()
    assert [c.injected for c in fake.calls if c.name == "release_trace"] == [True, False]
    assert_clean(lane)
