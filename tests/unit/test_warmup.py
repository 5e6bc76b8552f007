"""``WarmupCoordinator``: an order-independent, idempotent coverage manifest; capture only once
prefill and decode are warm; a multi-lane ``CaptureBarrier`` that waits for every lane and
rejects mismatched readiness; config validation; and the warmup/capture lifecycle events."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch
from lane_fixtures import (  # noqa: F401 (single_torch_thread: autouse)
    Lane,
    Tracing,
    add_tracing,
    build_lane,
    page_table,
    single_torch_thread,
    tiny_llama,
)
from structlog.testing import capture_logs

from llmrt.device.torch import TorchDevice
from llmrt.errors import ConfigError, IdentityError, RequestError
from llmrt.families.base import CausalLM
from llmrt.lifecycle.events import configure_logging
from llmrt.runtime.config import TraceConfig, WarmupConfig
from llmrt.runtime.prefill.plan import PrefillRow
from llmrt.runtime.trace_compiler import ArtifactState, TraceCapturePlan
from llmrt.runtime.warmup import CaptureBarrier, WarmupCoordinatorConfig

BS = 4
CHUNK = 16


@pytest.fixture(scope="module")
def model(torch_device: str) -> CausalLM:
    return tiny_llama(device=torch_device)


@pytest.fixture
def make(model: CausalLM, torch_device: str) -> Iterator[Callable[..., Lane]]:
    """Builds un-warmed traced lanes (a fresh model per extra lane, so several can coexist)
    on every torch device (captures are CUDA graphs on cuda); all are cleaned up and checked
    for leaks at teardown."""
    made: list[Lane] = []

    def build(
        mode: str = "all",
        *,
        device: Any = None,
        lane_capacity: int = 8,
        num_blocks: int = 64,
        wave_rules: str = "spec",
        **tracing: Any,
    ) -> Lane:
        lane = build_lane(
            model=model if not made else tiny_llama(device=torch_device),
            device=device,
            torch_device=torch_device,
            block_size=BS,
            num_blocks=num_blocks,
            max_chunk=CHUNK,
            lane_capacity=lane_capacity,
            wave_rules=wave_rules,  # type: ignore[arg-type]
        )
        add_tracing(lane, mode=mode, **tracing)
        made.append(lane)
        return lane

    yield build
    for lane in made:
        lane.cleanup()
        assert lane.live_tensors() == lane.baseline_live
        assert lane.inner.stats().live_traces == 0


def _t(lane: Lane) -> Tracing:
    assert lane.tracing is not None
    return lane.tracing


def _states(lane: Lane) -> set[ArtifactState]:
    return {a.state for a in _t(lane).traces.artifacts.values()}


# -- manifest --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["none", "decode_only", "all"])
def test_the_manifest_does_not_depend_on_warmup_order(make: Callable[..., Lane], mode: str) -> None:
    first, second = make(mode), make(mode)
    _t(first).warm(decode_first=False)
    _t(second).warm(decode_first=True)
    a, b = _t(first).warmup.manifest(), _t(second).warmup.manifest()
    assert a == b and a.to_dict() == b.to_dict()
    assert _t(first).warmup.readiness() == _t(second).warmup.readiness()
    descriptions = {d for d, _ in a.eager_programs}
    assert "decode[b8 w64]" in descriptions and "prefill[regular b2 s8 w64]" in descriptions
    assert {k for _, k in a.eager_programs} == set(first.compiler.programs)
    traced = {"none": 0, "decode_only": 1, "all": len(a.eager_programs)}[mode]
    assert len(a.traced_programs) == len(a.trace_signatures) == traced
    assert a.aliases == ()


def test_the_manifest_records_aliases_independently_of_registration_order(
    make: Callable[..., Lane],
) -> None:
    """Two programs sharing one trace: whichever registered first, the manifest is the same."""
    manifests: list[Any] = []
    for lane in (make("all"), make("all")):
        _t(lane).warmup.warmup_prefill()
        plans = [_alias_plan(lane, tag) for tag in ("a", "b")]
        if manifests:
            plans.reverse()
        for plan in plans:
            _t(lane).traces.register_capture_plan(plan)
        manifests.append(_t(lane).warmup.manifest())
    assert manifests[0] == manifests[1]
    (alias,) = manifests[0].aliases
    assert alias[0] in manifests[0].traced_programs and alias[1] in manifests[0].trace_signatures


@attrs.frozen
class _AliasSig:
    tag: str
    operation: str = "decode"

    def material(self) -> dict[str, Any]:
        return {"alias_test": self.tag}

    def describe(self) -> str:
        return f"alias[{self.tag}]"


def _alias_plan(lane: Lane, tag: str) -> TraceCapturePlan:
    out = lane.device.allocate(shape=(1,), dtype=torch.float32)
    key = lane.compiler.compile(_AliasSig(tag), lambda: {"x": out}).key
    return TraceCapturePlan(
        program_key=key,
        operation="decode",
        batch_size=1,
        material={"alias_test": "shared"},
        description=f"alias[{tag}]",
        allocate_inputs=lambda: (),
        prime_inputs=lambda inputs: None,
        program=lambda inputs: {},
    )


def test_warming_twice_changes_nothing(make: Callable[..., Lane]) -> None:
    lane = make("all")
    tracing = _t(lane)
    tracing.warm()
    manifest = tracing.warmup.manifest()
    programs = dict(lane.compiler.programs)
    artifacts = dict(tracing.traces.artifacts)
    stats = lane.inner.stats()
    with capture_logs() as logs:
        tracing.warm(decode_first=True)
        tracing.warm()
    assert logs == [], "no compile, registration, capture or readiness event"
    assert tracing.warmup.manifest() == manifest
    assert lane.compiler.programs == programs
    assert tracing.traces.artifacts.keys() == artifacts.keys()
    assert all(tracing.traces.artifacts[k] is a for k, a in artifacts.items())
    assert lane.inner.stats() == stats, "no second capture, allocation or run"


def test_warmup_never_writes_kv(make: Callable[..., Lane]) -> None:
    lane = make("all")
    before = lane.snapshot()
    _t(lane).warm()
    for old, new in zip(before, lane.snapshot(), strict=True):
        assert torch.equal(old, new)


# -- capture gating --------------------------------------------------------------------


@pytest.mark.parametrize("decode_first", [False, True])
def test_capture_waits_for_both_prefill_and_decode(
    make: Callable[..., Lane], decode_first: bool
) -> None:
    lane = make("all")
    warmup = _t(lane).warmup
    (warmup.warmup_decode if decode_first else warmup.warmup_prefill)()
    assert not warmup.ready and not warmup.captured
    assert lane.inner.stats().captures == 0 and not lane.compiler.gate_closed
    assert _states(lane) == {ArtifactState.REGISTERED}
    (warmup.warmup_prefill if decode_first else warmup.warmup_decode)()
    assert warmup.ready and warmup.captured and _t(lane).traces.active
    assert lane.compiler.gate_closed
    assert _states(lane) == {ArtifactState.CAPTURED}
    assert lane.inner.stats().captures == len(_t(lane).traces.artifacts)


def test_eager_mode_never_captures_or_closes_the_gate(make: Callable[..., Lane]) -> None:
    lane = make("none")
    _t(lane).warm()
    assert _t(lane).warmup.ready and not _t(lane).warmup.captured
    assert _t(lane).traces.artifacts == {} and lane.inner.stats().captures == 0
    assert not lane.compiler.gate_closed


# -- lanes -----------------------------------------------------------------------------


def _two_lanes(
    make: Callable[..., Lane], torch_device: str, **second: Any
) -> tuple[Lane, Lane, CaptureBarrier]:
    devices = TorchDevice(torch_device).lanes(2)
    barrier = CaptureBarrier(lanes=2)
    lane0 = make("all", device=devices[0], barrier=barrier, lane_index=0)
    options = {"barrier": barrier, "lane_index": 1, **second}
    lane1 = make("all", device=devices[1], **options)
    return lane0, lane1, barrier


def test_the_barrier_holds_until_every_lane_is_ready(
    make: Callable[..., Lane], torch_device: str
) -> None:
    lane0, lane1, barrier = _two_lanes(make, torch_device)
    _t(lane0).warm()
    _t(lane1).warmup.warmup_decode()
    for lane in (lane0, lane1):
        assert not _t(lane).warmup.captured and not lane.compiler.gate_closed
        assert lane.inner.stats().captures == 0
        assert _states(lane) == {ArtifactState.REGISTERED}
    assert not barrier.captured
    _t(lane1).warmup.warmup_prefill()  # the last lane's readiness activates both
    assert barrier.captured
    for lane in (lane0, lane1):
        assert _t(lane).warmup.captured and lane.compiler.gate_closed
        assert _states(lane) == {ArtifactState.CAPTURED}
        assert lane.inner.stats().captures == len(_t(lane).traces.artifacts)
    assert _t(lane0).warmup.manifest() == _t(lane1).warmup.manifest()


def test_mismatched_lane_readiness_raises_and_captures_nothing(
    make: Callable[..., Lane], torch_device: str
) -> None:
    # decode[b4] vs decode[b8]
    lane0, lane1, barrier = _two_lanes(make, torch_device, lane_capacity=4)
    _t(lane0).warm()
    with pytest.raises(IdentityError, match="identical warmup readiness"):
        _t(lane1).warm()
    assert not barrier.captured
    for lane in (lane0, lane1):
        assert lane.inner.stats().captures == 0 and not lane.compiler.gate_closed


def test_two_coordinators_cannot_report_the_same_lane(
    make: Callable[..., Lane], torch_device: str
) -> None:
    lane0, lane1, barrier = _two_lanes(make, torch_device, lane_index=0)
    _t(lane0).warm()
    with pytest.raises(IdentityError, match="one warmup coordinator per lane"):
        _t(lane1).warm()
    assert not barrier.captured and lane0.inner.stats().captures == 0


# -- config ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("warmup", "field", "match"),
    [
        (WarmupConfig(prefill_seq_lens=(8, 24)), r"warmup.prefill_seq_lens\[1\]", "max_chunk"),
        (WarmupConfig(prefill_seq_lens=(12,)), r"warmup.prefill_seq_lens\[0\]", "pad to 16"),
        (
            WarmupConfig(prefill_seq_lens=(8,), prefill_batch_sizes=(1, 16)),
            r"warmup.prefill_batch_sizes\[1\]",
            "max_batch_size",
        ),
    ],
)
def test_warmup_hints_are_validated_against_the_lane(
    make: Callable[..., Lane], warmup: WarmupConfig, field: str, match: str
) -> None:
    lane = make("all")
    with pytest.raises(ConfigError, match=f"{field}.*{match}"):
        WarmupCoordinatorConfig.resolve(
            warmup=warmup, trace=TraceConfig(mode="all"), execution=_t(lane).executor
        )


def test_traced_coverage_includes_every_single_row_bucket(make: Callable[..., Lane]) -> None:
    lane = make("all", seq_lens=(8,), batch_sizes=(1, 2))
    cover = {(c.variant, c.seq_len, c.batch_size) for c in _t(lane).warmup.config.prefill_coverage}
    assert {
        ("regular", 8, 1),
        ("regular", 8, 2),
        ("regular", 16, 1),
        ("chunked", 8, 1),
        ("chunked", 16, 1),
    } <= cover


def test_traced_coverage_stays_within_the_lane_capacity(make: Callable[..., Lane]) -> None:
    """The planner never forms a wave above the lane's slot count, so warmup must not try."""
    lane = make("all", lane_capacity=4)
    coverage = _t(lane).warmup.config.prefill_coverage
    assert max(c.batch_size for c in coverage) == 4
    _t(lane).warm()
    assert _t(lane).warmup.captured


def test_packed_wave_rules_cover_cached_waves_that_fit_the_kv_pool(
    make: Callable[..., Lane],
) -> None:
    """Cached rows join waves under packed rules, so warmup compiles those waves too; a
    geometry whose smallest instance cannot fit the KV pool never forms and is skipped."""
    spec = make("all", seq_lens=(16,), batch_sizes=(1, 2, 4, 8), num_blocks=14)
    packed = make(
        "all", seq_lens=(16,), batch_sizes=(1, 2, 4, 8), num_blocks=14, wave_rules="packed"
    )

    def waves(lane: Lane, variant: str) -> set[tuple[int, int]]:
        coverage = _t(lane).warmup.config.prefill_coverage
        return {
            (c.seq_len, c.batch_size)
            for c in coverage
            if c.variant == variant and c.batch_size > 1
        }

    assert waves(spec, "chunked") == set()
    # A b8 wave has at least 5 rows; padded to 16 tokens, a row has at least 9 new tokens,
    # 3 blocks of 4: 15 blocks, more than the 14 in the pool.
    assert waves(packed, "regular") == waves(spec, "regular") == {
        (8, 2), (8, 4), (8, 8), (16, 2), (16, 4)
    }
    assert waves(packed, "chunked") == {(8, 2), (8, 4), (8, 8), (16, 2), (16, 4)}
    _t(packed).warm()
    assert _t(packed).warmup.captured
    programs = {p.description for p in packed.compiler.programs.values()}
    assert "prefill[chunked b4 s16 w14]" in programs

    # What coverage dropped cannot be planned into the pool: 5 rows of 9 new tokens need 15.
    rows = [
        PrefillRow(
            source_row=i,
            tokens=torch.ones(9, dtype=torch.int64),
            slot=i,
            block_ids=tuple(range(3 * i, 3 * i + 3)),
        )
        for i in range(5)
    ]
    with pytest.raises(RequestError, match="block_ids"):
        packed.prefill.prepare(rows=rows)
    assert len(packed.prefill.prepare(rows=rows[:4]).requests) == 1  # b4: 12 blocks, fits


def test_coverage_keeps_a_wave_its_fewest_rows_can_form(make: Callable[..., Lane]) -> None:
    """5 one-block rows pad to a b8 wave: it must be warmed even if 8 rows would not fit."""
    lane = make("all", seq_lens=(8,), batch_sizes=(1, 2, 4, 8), num_blocks=6)
    cover = {(c.variant, c.seq_len, c.batch_size) for c in _t(lane).warmup.config.prefill_coverage}
    assert ("regular", 8, 8) in cover
    _t(lane).warm()
    rows = [
        PrefillRow(source_row=i, tokens=torch.ones(3, dtype=torch.int64), slot=i, block_ids=(i,))
        for i in range(5)
    ]
    prepared = _t(lane).executor.prepare_prefill(rows=rows)
    (request,) = prepared.requests
    assert request.request.padded_batch_size == 8
    _t(lane).executor.preflight_prefill(prepared)  # compiled and traced: no coverage error


# -- lifecycle events ------------------------------------------------------------------


def test_warmup_capture_and_replay_lifecycle_events(model: CausalLM, torch_device: str) -> None:
    configure_logging(level="debug", console=False)  # before building: the filter binds early
    lane = build_lane(
        model=model, block_size=BS, num_blocks=64, max_chunk=CHUNK, torch_device=torch_device
    )
    try:
        tracing = add_tracing(lane, mode="decode_only", seq_lens=(8,), batch_sizes=(1,))
        with capture_logs() as logs:
            tracing.warm()
            tracing.executor.decode_forward(
                tokens=[3], start_pos=[5], page_table=page_table([[0, 1]], width=64)
            )
        names = [e["event"] for e in logs]
        ids = {
            "program_compiler": f"{id(lane.compiler):#x}",
            "trace_compiler": f"{id(tracing.traces):#x}",
            "warmup": f"{id(tracing.warmup):#x}",
        }
        for event in logs:
            if event.get("component") in ids:
                assert event["lane"] == 0 and event["object_id"] == ids[event["component"]]
        by_component = {(e["event"], e["component"]) for e in logs}
        assert {
            ("program.compiled", "program_compiler"),
            ("compile_gate.closed", "program_compiler"),
            ("trace.registered", "trace_compiler"),
            ("trace.captured", "trace_compiler"),
            ("trace.activated", "trace_compiler"),
            ("trace.replayed", "trace_compiler"),
            ("warmup.completed", "warmup"),
            ("lane.ready", "warmup"),
        } <= by_component
        assert names.count("program.compiled") == len(lane.compiler.programs)
        assert names.count("trace.registered") == names.count("trace.captured") == 1
        gate = names.index("compile_gate.closed")
        assert (
            max(i for i, n in enumerate(names) if n in ("program.compiled", "trace.registered"))
            < gate
        )
        assert gate < names.index("trace.captured") < names.index("trace.activated")
        assert names[-2:] == ["trace.replayed", "output.read"]  # then the blocking readback
        (registered,) = [e for e in logs if e["event"] == "trace.registered"]
        assert registered["signature"] == "decode[b8 w64]" and registered["alias"] is False
    finally:
        lane.cleanup()
