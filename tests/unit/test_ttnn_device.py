"""``TtnnDevice`` over the recording fake ttnn: the device-port contract and TT call sequences."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from llmrt.device import Device
from llmrt.device.ttnn import (
    TTNN_CALLS,
    TTNN_METHODS,
    TTNN_NAMES,
    TtnnDevice,
    missing_ttnn_message,
    open_ttnn_device,
    stage,
    staging_plan,
    unstage,
)
from llmrt.errors import (
    CleanupError,
    ConfigError,
    DeviceError,
    TraceStateError,
    UnsupportedError,
)
from llmrt.testing.fake_ttnn import FakeTtnn, InjectedTtnnFailure, TtnnRuleViolation
from llmrt.testing.faulty_device import FaultyDevice, InjectedFault

MESH_SHAPES = [(1, 1), (1, 2)]


def open_device(
    shape: tuple[int, int] = (1, 1), *, fake: FakeTtnn | None = None, **options: Any
) -> tuple[TtnnDevice, FakeTtnn]:
    """A device over a fake that lets these tests' small torch programs run on its tensors;
    a test capturing a program runs it eagerly first (ttnn needs it compiled)."""
    fake = fake or FakeTtnn(
        system_mesh_shape=shape, allocation_while_trace_live="warn", torch_ops="allow"
    )
    mesh = fake.open_mesh_device(fake.MeshShape(*shape), trace_region_size=1 << 20)
    return TtnnDevice(mesh, ttnn_module=fake, **options), fake


@pytest.fixture(params=MESH_SHAPES, ids=lambda s: f"mesh{s[0]}x{s[1]}")
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[TtnnDevice, FakeTtnn]]:
    device, fake = open_device(request.param)
    yield device, fake
    assert fake.violations == ()


@pytest.fixture
def device(pair: tuple[TtnnDevice, FakeTtnn]) -> TtnnDevice:
    return pair[0]


def warm_capture(device: Any, program: Callable[[], Any]) -> Any:
    """Run ``program`` eagerly once (ttnn compiles each program before a capture), then
    capture it."""
    program()
    return device.capture_trace(program)


def host(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def affine(*, x: Any, scale: float) -> Any:
    return x * scale + 1


def calls_since(fake: FakeTtnn, start: int) -> list[str]:
    return [c.name for c in fake.calls[start:]]


# the device-port contract


def test_satisfies_the_port(device: TtnnDevice) -> None:
    assert isinstance(device, Device)
    assert device.kind == "ttnn"
    assert device.torch_device == torch.device("cpu")
    assert device.parent is None
    assert not device.capturing
    assert device.id == f"ttnn:{device.mesh_device.id()}"


def test_allocate_is_zeroed_and_upload_copies(device: TtnnDevice) -> None:
    zeros = device.allocate(shape=(4,), dtype=torch.int64)
    assert device.read(zeros, blocking=True).dtype == torch.int64
    assert device.read(zeros, blocking=True).tolist() == [0, 0, 0, 0]
    source = host(1, 2, 3)
    uploaded = device.upload(source)
    source.fill_(9)
    assert device.read(uploaded, blocking=True).tolist() == [1, 2, 3]
    assert device.stats().live_tensors == 2


def test_allocate_accepts_only_row_major_order(device: TtnnDevice) -> None:
    t = device.allocate(shape=(2, 3), dtype=torch.float32, dim_order=(0, 1))
    assert device.read(t, blocking=True).shape == (2, 3)
    with pytest.raises(UnsupportedError, match=r"dim_order \(1, 0\): ttnn tensors are row-major"):
        device.allocate(shape=(2, 3), dtype=torch.float32, dim_order=(1, 0))
    assert device.stats().live_tensors == 1


def test_refresh_then_replay_gives_the_new_result(device: TtnnDevice) -> None:
    x = device.upload(host(1, 2, 3))
    trace = warm_capture(device, functools.partial(affine, x=x, scale=2.0))
    out = trace.outputs
    assert device.read(out, blocking=True).tolist() == [3, 5, 7]

    device.refresh(x, host(10, 20, 30))
    device.execute_trace(trace, blocking=True)

    assert trace.outputs is out
    assert device.read(out, blocking=True).tolist() == [21, 41, 61]
    assert device.stats().replays == 1


def test_replay_without_refresh_gives_the_stale_result(device: TtnnDevice) -> None:
    source = host(1, 2, 3)
    x = device.upload(source)
    trace = warm_capture(device, functools.partial(affine, x=x, scale=2.0))

    source.copy_(host(10, 20, 30))
    device.execute_trace(trace, blocking=True)
    assert device.read(trace.outputs, blocking=True).tolist() == [3, 5, 7]

    device.refresh(x, host(10, 20, 30))
    assert device.read(trace.outputs, blocking=True).tolist() == [3, 5, 7]
    device.execute_trace(trace, blocking=True)
    assert device.read(trace.outputs, blocking=True).tolist() == [21, 41, 61]


def test_values_bound_at_capture_stay_baked(device: TtnnDevice) -> None:
    scale = 2.0
    x = device.upload(host(1, 2, 3))
    trace = warm_capture(device, functools.partial(affine, x=x, scale=scale))

    scale = 100.0
    x = device.upload(host(7, 7, 7))
    device.execute_trace(trace, blocking=True)

    assert device.read(trace.outputs, blocking=True).tolist() == [3, 5, 7]
    fake = device.mesh_device._fake
    assert len(fake.warnings) == 1
    assert "while trace(s) [0] are live" in fake.warnings[0]


def test_replay_rewrites_every_output_in_place(device: TtnnDevice) -> None:
    x = device.upload(host(1, 2))

    def program() -> dict[str, Any]:
        return {"sum": x.sum(), "pair": (x * 2, x + 1), "label": "baked"}

    trace = warm_capture(device, program)
    total, (doubled, shifted) = trace.outputs["sum"], trace.outputs["pair"]
    device.refresh(x, host(5, 6))
    device.execute_trace(trace, blocking=True)

    assert trace.outputs["sum"] is total
    assert device.read(total, blocking=True).item() == 11
    assert device.read(doubled, blocking=True).tolist() == [10, 12]
    assert device.read(shifted, blocking=True).tolist() == [6, 7]
    assert trace.outputs["label"] == "baked"


@pytest.mark.parametrize(
    ("op", "call"),
    [
        ("upload", lambda d, t: d.upload(host(1))),
        ("allocate", lambda d, t: d.allocate(shape=(1,), dtype=torch.float32)),
        ("refresh", lambda d, t: d.refresh(t, host(1))),
        ("read", lambda d, t: d.read(t, blocking=True)),
        ("read", lambda d, t: d.read(t, blocking=False)),
        ("record_event", lambda d, t: d.record_event()),
        ("synchronize", lambda d, t: d.synchronize()),
        ("deallocate", lambda d, t: d.deallocate(t)),
    ],
)
def test_capture_rejects_host_traffic(
    pair: tuple[TtnnDevice, FakeTtnn], op: str, call: Callable[[TtnnDevice, Any], Any]
) -> None:
    device, fake = pair
    t = device.upload(host(0))
    before = device.stats()
    start = len(fake.calls)

    def program() -> Any:
        call(device, t)
        return t + 1

    with pytest.raises(DeviceError, match=rf"{op}: .*during trace capture"):
        device.capture_trace(program)
    assert not device.capturing
    assert device.stats().live_traces == 0
    assert device.stats().allocations == before.allocations
    assert calls_since(fake, start) == ["begin_trace_capture", "end_trace_capture", "release_trace"]
    device.refresh(t, host(3))
    assert device.read(t, blocking=True).tolist() == [3]


def test_nested_capture_raises(device: TtnnDevice) -> None:
    x = device.upload(host(1))

    def outer() -> Any:
        device.capture_trace(lambda: x + 1)
        return x + 2

    with pytest.raises(TraceStateError, match="nested trace capture"):
        device.capture_trace(outer)
    assert device.stats().live_traces == 0
    assert not device.capturing


def test_failed_capture_registers_nothing_and_releases_the_ttnn_trace(
    pair: tuple[TtnnDevice, FakeTtnn],
) -> None:
    device, fake = pair
    x = device.upload(host(1))

    def broken() -> Any:
        raise ValueError("boom")

    start = len(fake.calls)
    with pytest.raises(ValueError, match="boom"):
        device.capture_trace(broken)
    assert calls_since(fake, start) == ["begin_trace_capture", "end_trace_capture", "release_trace"]
    assert not device.capturing
    assert device.stats().live_traces == 0
    assert device.stats().captures == 0
    trace = warm_capture(device, lambda: x * 3)
    assert trace.trace_id == 0
    device.release_trace(trace)


def test_release_is_idempotent_and_replay_after_release_raises(
    pair: tuple[TtnnDevice, FakeTtnn],
) -> None:
    device, fake = pair
    x = device.upload(host(1))
    trace = warm_capture(device, lambda: x * 3)
    assert device.live_trace_count == 1

    device.release_trace(trace)
    device.release_trace(trace)

    assert device.live_trace_count == 0
    assert fake.call_names().count("release_trace") == 1
    with pytest.raises(TraceStateError, match="released"):
        device.execute_trace(trace)


def test_foreign_trace_is_rejected() -> None:
    fake = FakeTtnn(system_mesh_shape=(1, 2), torch_ops="allow")
    device, _ = open_device((1, 2), fake=fake)
    other, _ = open_device((1, 1), fake=fake)
    x = other.upload(host(1))
    trace = warm_capture(other, lambda: x + 1)
    with pytest.raises(TraceStateError, match=r"belongs to ttnn:1, not ttnn:0"):
        device.execute_trace(trace)
    same_id, _ = open_device((1, 1), fake=FakeTtnn(torch_ops="allow"), device_id="ttnn:1")
    with pytest.raises(TraceStateError, match="was not captured by"):
        same_id.execute_trace(trace)
    lane0, lane1 = device.lanes(2)
    y = lane0.upload(host(1))
    lane_trace = warm_capture(lane0, lambda: y + 1)
    with pytest.raises(TraceStateError, match=r"belongs to .*lane0"):
        lane1.execute_trace(lane_trace)
    assert fake.violations == ()


def test_non_blocking_read_is_valid_only_after_its_event(device: TtnnDevice) -> None:
    t = device.upload(host(1, 2, 3))
    earlier = device.record_event()
    pending = device.read(t, blocking=False)
    event = device.record_event()
    device.refresh(t, host(7, 8, 9))

    device.event_synchronize(earlier)
    assert torch.isnan(pending).all()
    assert device.stats().pending_reads == 1
    device.event_synchronize(event)

    assert pending.tolist() == [1, 2, 3]
    assert device.stats().pending_reads == 0


def test_synchronize_completes_pending_reads(device: TtnnDevice) -> None:
    t = device.upload(host(4, 5))
    pending = device.read(t, blocking=False)
    device.synchronize()
    assert pending.tolist() == [4, 5]


def test_event_from_another_lane_is_rejected() -> None:
    device, _ = open_device((1, 2))
    lane0, lane1 = device.lanes(2)
    with pytest.raises(DeviceError, match="was not recorded on"):
        lane1.event_synchronize(lane0.record_event())


def test_refresh_mismatch_names_both_tensors(device: TtnnDevice) -> None:
    dst = device.allocate(shape=(2, 3), dtype=torch.float32)
    with pytest.raises(DeviceError, match=r"shape=\(2, 4\).*shape=\(2, 3\)"):
        device.refresh(dst, torch.zeros(2, 4))
    with pytest.raises(DeviceError, match=r"dtype=int32.*dtype=float32"):
        device.refresh(dst, torch.zeros(2, 3, dtype=torch.int32))


def test_deallocation_is_counted_and_never_repeated(pair: tuple[TtnnDevice, FakeTtnn]) -> None:
    device, fake = pair
    a = device.allocate(shape=(2,), dtype=torch.float32)
    b = device.upload(host(1))
    assert device.live_tensor_count == 2
    device.deallocate(a)
    assert device.live_tensor_count == 1
    with pytest.raises(DeviceError, match="already deallocated"):
        device.deallocate(a)
    with pytest.raises(DeviceError, match="already deallocated"):
        device.read(a, blocking=True)
    device.deallocate(b)
    assert device.stats().live_tensors == 0
    assert device.stats().deallocations == 2
    assert fake.call_names().count("deallocate") == 2


def test_lanes_are_submeshes_with_distinct_stable_ids() -> None:
    device, fake = open_device((1, 2))
    lanes = device.lanes(2)
    assert [lane.id for lane in lanes] == [f"{device.id}/lane0", f"{device.id}/lane1"]
    assert all(lane.parent is device for lane in lanes)
    assert [c.detail for c in fake.calls if c.name == "MeshDevice.create_submeshes"] == [
        "MeshShape([1, 1])"
    ]
    assert all(isinstance(lane, TtnnDevice) and lane.num_devices == 1 for lane in lanes)
    assert device.lanes(2) is lanes
    with pytest.raises(DeviceError, match="already split into 2 lanes"):
        device.lanes(3)
    with pytest.raises(DeviceError, match="lane sub-device"):
        lanes[0].lanes(2)
    with pytest.raises(ConfigError, match="lanes: must be a positive integer"):
        device.lanes(0)
    single, _ = open_device((1, 1))
    with pytest.raises(ConfigError, match="lanes: must divide the mesh"):
        single.lanes(2)


@pytest.mark.parametrize(
    ("mesh", "lanes", "lane_shape"),
    [((1, 8), 1, (1, 8)), ((1, 8), 4, (1, 2)), ((4, 8), 4, (1, 8)), ((4, 8), 32, (1, 1)),
     ((2, 4), 2, (1, 4)), ((4, 8), 2, (2, 8))],
)  # fmt: skip
def test_lanes_are_chips_of_one_mesh_row_where_a_row_holds_whole_lanes(
    mesh: tuple[int, int], lanes: int, lane_shape: tuple[int, int]
) -> None:
    """A Galaxy's four lanes are its 1x8 rows (a tensor-parallel lane's chips share a row's
    links, as tt_transformers lays them out), not 4x2 blocks; lanes wider than a row take
    whole rows."""
    device, _ = open_device(mesh)
    made = device.lanes(lanes)
    assert {tuple(lane.mesh_device.shape) for lane in made} == {lane_shape}


def test_lane_owns_its_tensors() -> None:
    device, _ = open_device((1, 2))
    lane0, lane1 = device.lanes(2)
    t = lane0.allocate(shape=(1,), dtype=torch.float32)
    with pytest.raises(DeviceError, match=r"owned by .*lane0, not .*lane1"):
        lane1.deallocate(t)
    lane0.deallocate(t)
    assert lane0.stats().live_tensors == 0


def test_refresh_targets_only_tensors_this_device_allocated() -> None:
    device, _ = open_device((1, 2))
    dst = device.upload(host(1, 2))
    stray = dst * 1
    with pytest.raises(DeviceError, match="was not allocated by"):
        device.refresh(stray, host(3, 4))
    with pytest.raises(DeviceError, match="expected a ttnn device tensor"):
        device.refresh(host(3, 4), dst)
    lane0, lane1 = device.lanes(2)
    lane_dst = lane0.allocate(shape=(2,), dtype=torch.float32)
    with pytest.raises(DeviceError, match=r"is owned by .*lane0, not .*lane1"):
        lane1.refresh(lane_dst, host(3, 4))
    other_mesh, _ = open_device((1, 1))
    with pytest.raises(DeviceError, match=r"is not on ttnn:0/lane1"):
        lane1.read(other_mesh.upload(host(1)), blocking=True)


def test_works_through_the_fault_injecting_wrapper() -> None:
    inner, _ = open_device((1, 1))
    device = FaultyDevice(inner, fail={"release_trace": 1})
    x = device.upload(host(1))
    trace = warm_capture(device, lambda: x + 1)
    with pytest.raises(InjectedFault):
        device.release_trace(trace)
    device.release_trace(trace)
    assert inner.stats().live_traces == 0


# staging: dtypes and layouts


def test_runtime_dtypes_round_trip_through_their_staging(pair: tuple[TtnnDevice, FakeTtnn]) -> None:
    device, fake = pair
    values = {
        torch.int64: torch.tensor([[1, 50_000, 128_255]]),
        torch.int32: torch.tensor([[0, 5, -1, -1]], dtype=torch.int32),
        torch.bool: torch.tensor([True, False, True]),
        torch.uint8: torch.tensor([0, 7, 255], dtype=torch.uint8),
        torch.float32: torch.randn(3, 5),
        torch.bfloat16: torch.randn(3, 5).to(torch.bfloat16),
    }
    for dtype, value in values.items():
        t = device.upload(value)
        back = device.read(t, blocking=True)
        assert back.dtype == dtype
        assert torch.equal(back, value), dtype
    staged = {c.detail.split("dtype=")[1].rstrip(")") for c in fake.calls if c.name == "from_torch"}
    assert "int64" not in staged


def test_staging_plans_match_what_ttnn_needs() -> None:
    assert staging_plan(torch.int64).tt_dtype == "UINT32"  # ttnn.embedding's id dtype
    assert staging_plan(torch.int32).tt_dtype == "INT32"  # page tables hold -1
    assert staging_plan(torch.int64).layout == "ROW_MAJOR"
    assert staging_plan(torch.float32).layout == "TILE"
    assert staging_plan(torch.float32, float_layout="row_major").layout == "ROW_MAJOR"
    bfp8 = staging_plan(torch.bfloat16, float_dtypes={torch.bfloat16: "bfloat8_b"})
    assert (bfp8.tt_dtype, bfp8.layout, bfp8.staged_dtype) == ("BFLOAT8_B", "TILE", torch.float32)
    forced = staging_plan(
        torch.bfloat16, float_layout="row_major", float_dtypes={torch.bfloat16: "bfloat8_b"}
    )
    assert forced.layout == "TILE"
    with pytest.raises(ConfigError, match=r"float_dtypes\[torch.int32\]"):
        staging_plan(torch.int32, float_dtypes={torch.int32: "bfloat8_b"})
    with pytest.raises(DeviceError, match=r"no ttnn staging for torch dtype torch\.float64"):
        staging_plan(torch.float64)
    plan = staging_plan(torch.int64)
    assert unstage(stage(torch.tensor([0, 7]), plan), plan).dtype == torch.int64


def test_int64_outside_the_token_id_range_is_rejected_with_its_range(device: TtnnDevice) -> None:
    with pytest.raises(DeviceError, match=r"upload: int64 tensor .* holds -1\.\.7, outside 0\.\."):
        device.upload(torch.tensor([-1, 7]))
    with pytest.raises(DeviceError, match=r"holds 0\.\.2147483648, outside 0\.\.2147483647"):
        device.upload(torch.tensor([0, 2**31]))


def test_bfloat8_kv_override_uploads_in_tile_layout() -> None:
    device, fake = open_device((1, 1), float_dtypes={torch.bfloat16: "bfloat8_b"})
    kv = device.allocate(shape=(2, 3, 5), dtype=torch.bfloat16)
    assert kv.dtype is fake.bfloat8_b
    assert kv.layout is fake.TILE_LAYOUT
    assert tuple(kv.padded_shape) == (2, 32, 32)
    assert device.read(kv, blocking=True).dtype == torch.bfloat16


def test_sharded_uploads_split_and_reads_concatenate() -> None:
    device, fake = open_device((1, 2), mesh_mapper="shard", shard_dim=0)
    value = torch.arange(8, dtype=torch.int32).reshape(4, 2)
    t = device.upload(value)
    assert tuple(t.shape) == (2, 2)
    assert torch.equal(device.read(t, blocking=True), value)
    assert torch.equal(device.read(t * 2, blocking=True), value * 2)
    assert fake.violations == ()


def test_invalid_options_are_rejected() -> None:
    fake = FakeTtnn(torch_ops="allow")
    mesh = fake.open_mesh_device(trace_region_size=1)
    with pytest.raises(ConfigError, match=r"device\.mesh_mapper: must be 'replicate' or 'shard'"):
        TtnnDevice(mesh, ttnn_module=fake, mesh_mapper="scatter")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"device\.float_layout"):
        TtnnDevice(mesh, ttnn_module=fake, float_layout="tiles")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"device\.cq_id"):
        TtnnDevice(mesh, ttnn_module=fake, cq_id=-1)


# opening, closing and the missing-ttnn message


def test_missing_ttnn_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ttnn", None)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    with pytest.raises(DeviceError) as caught:
        open_ttnn_device([1, 2])
    message = str(caught.value)
    assert message == missing_ttnn_message()
    assert message == (
        "device.backend=ttnn needs the ttnn package (pip install 'llmrt[tt]') on CPython 3.10 "
        f"or 3.12 with a Tenstorrent device; this interpreter is {version}"
    )
    assert "\n" not in message


def test_open_ttnn_device_owns_the_mesh_and_close_releases_everything() -> None:
    fake = FakeTtnn(system_mesh_shape=(1, 2), torch_ops="allow")
    device = open_ttnn_device([1, 2], ttnn_module=fake, trace_region_size=4096)
    x = device.upload(host(1, 2))
    lane_trace_device = device.lanes(2)[1]
    y = lane_trace_device.upload(host(3))
    warm_capture(device, lambda: x + 1)
    warm_capture(lane_trace_device, lambda: y + 1)
    device.close()
    device.close()
    assert fake.call_names()[-3:] == ["release_trace", "release_trace", "close_mesh_device"]
    assert device.stats().live_traces == 0
    assert fake.violations == ()
    with pytest.raises(ConfigError, match=r"device.mesh_shape: must be two positive integers"):
        open_ttnn_device([2], ttnn_module=fake)
    with pytest.raises(DeviceError, match=r"device.mesh_shape=\[1, 4\]: ttnn.open_mesh_device"):
        open_ttnn_device([1, 4], ttnn_module=fake)


def test_fake_exposes_every_call_the_backend_makes() -> None:
    fake = FakeTtnn(torch_ops="allow")
    for name, keywords in TTNN_CALLS.items():
        params = inspect.signature(getattr(fake, name)).parameters
        assert set(keywords) <= set(params), name
    classes = {"Tensor": fake.Tensor, "MeshDevice": fake.MeshDevice}
    for dotted, keywords in TTNN_METHODS.items():
        owner, method = dotted.split(".")
        params = inspect.signature(getattr(classes[owner], method)).parameters
        assert set(keywords) <= set(params), dotted
    for name in TTNN_NAMES:
        assert hasattr(fake, name), name


# call sequences


def test_eager_prefill_sequence(pair: tuple[TtnnDevice, FakeTtnn]) -> None:
    device, fake = pair
    weight = device.upload(torch.randn(11, 4))
    start = len(fake.calls)
    tokens = device.upload(torch.tensor([[3, 1, 4]]))
    logits = torch.matmul(torch.nn.functional.embedding(tokens, weight).sum(dim=1), weight.T)
    value = device.read(logits, blocking=True)
    device.deallocate(logits)
    device.deallocate(tokens)

    assert calls_since(fake, start) == [
        "from_torch",
        "Tensor.cpu",
        "to_torch",
        "deallocate",
        "deallocate",
    ]
    expected = torch.nn.functional.embedding(
        torch.tensor([[3, 1, 4]]), device.read(weight, blocking=True)
    ).sum(dim=1)
    assert torch.allclose(value, expected @ device.read(weight, blocking=True).T)
    assert device.stats().live_tensors == 1


BLOCK = 4


def decode_step(*, emb: Any, tokens: Any, positions: Any, page_table: Any, kv: Any) -> Any:
    """A decode-like program: embed, write KV at the paged position, attend over the block."""
    hidden = torch.nn.functional.embedding(tokens, emb)
    column = torch.div(positions, BLOCK, rounding_mode="floor").long()
    block = torch.gather(page_table, 1, column.unsqueeze(1)).squeeze(1)
    kv.index_put_((block.long(), torch.remainder(positions, BLOCK).long()), hidden)
    context = torch.index_select(kv, 0, block.long()).sum(dim=1)
    return torch.matmul(hidden + context, emb.T)


def test_traced_decode_loop_with_async_reads(pair: tuple[TtnnDevice, FakeTtnn]) -> None:
    device, fake = pair
    torch.manual_seed(0)
    emb_host = torch.randn(11, 4)
    page_table_host = torch.tensor([[0, 1, -1], [2, 3, -1]], dtype=torch.int32)
    kv_host = torch.zeros(4, BLOCK, 4)

    emb = device.upload(emb_host)
    page_table = device.upload(page_table_host)
    kv = device.allocate(shape=(4, BLOCK, 4), dtype=torch.float32)
    tokens = device.allocate(shape=(2,), dtype=torch.int64)
    positions = device.allocate(shape=(2,), dtype=torch.int32)
    program = functools.partial(
        decode_step, emb=emb, tokens=tokens, positions=positions, page_table=page_table, kv=kv
    )
    trace = warm_capture(device, program)
    kv_host[0, 0] = emb_host[0]
    kv_host[2, 0] = emb_host[0]

    steps = [([5, 7], [1, 1]), ([2, 9], [2, 2]), ([10, 0], [5, 3])]
    start = len(fake.calls)
    reads: list[tuple[torch.Tensor, Any]] = []
    for step_tokens, step_positions in steps:
        device.refresh(tokens, torch.tensor(step_tokens))
        device.refresh(positions, torch.tensor(step_positions, dtype=torch.int32))
        device.execute_trace(trace, blocking=False)
        reads.append((device.read(trace.outputs, blocking=False), device.record_event()))
    values = []
    for pending, event in reads:
        device.event_synchronize(event)
        values.append(pending.clone())

    per_step = [
        "from_torch",
        "copy_host_to_device_tensor",
        "from_torch",
        "copy_host_to_device_tensor",
        "execute_trace",
        "Tensor.cpu",
        "record_event",
    ]
    assert calls_since(fake, start) == per_step * 3 + ["event_synchronize", "to_torch"] * 3
    for (step_tokens, step_positions), value in zip(steps, values, strict=True):
        expected = decode_step(
            emb=emb_host,
            tokens=torch.tensor(step_tokens),
            positions=torch.tensor(step_positions, dtype=torch.int32),
            page_table=page_table_host,
            kv=kv_host,
        )
        assert torch.allclose(value, expected), (step_tokens, step_positions)
    assert torch.allclose(device.read(kv, blocking=True), kv_host)
    assert fake.warnings == ()

    device.release_trace(trace)
    for tensor in (emb, page_table, kv, tokens, positions):
        device.deallocate(tensor)
    assert device.stats() == device.stats().__class__(
        live_tensors=0,
        live_traces=0,
        pending_reads=0,
        allocations=5,
        deallocations=5,
        captures=1,
        replays=3,
    )


def test_capture_failure_in_end_trace_capture_still_releases() -> None:
    device, fake = open_device((1, 1))
    x = device.upload(host(1))
    x + 1
    fake.inject("end_trace_capture", 1)
    start = len(fake.calls)
    with pytest.raises(
        DeviceError, match=r"capture_trace: ttnn\.end_trace_capture failed"
    ) as caught:
        device.capture_trace(lambda: x + 1)
    assert isinstance(caught.value.__cause__, InjectedTtnnFailure)
    assert calls_since(fake, start) == [
        "begin_trace_capture",
        "add",
        "end_trace_capture",
        "end_trace_capture",
        "release_trace",
    ]
    assert device.stats().live_traces == 0
    assert not device.capturing


def test_capture_cleanup_failures_keep_the_primary_error() -> None:
    device, fake = open_device((1, 1))
    x = device.upload(host(1))
    fake.inject("release_trace", 1)

    def broken() -> Any:
        x + 1
        raise ValueError("program failed")

    x + 1
    with pytest.raises(CleanupError) as caught:
        device.capture_trace(broken)
    assert isinstance(caught.value.primary, ValueError)
    assert [step for step, _ in caught.value.failures] == ["release_trace"]
    assert not device.capturing


def release_then_deallocate(device: TtnnDevice, trace: Any, inputs: list[Any]) -> list[str]:
    """The runtime's cleanup order: retry ``release_trace`` until it succeeds, then free inputs."""
    failures: list[str] = []
    for _ in range(3):
        try:
            device.release_trace(trace)
            break
        except DeviceError as exc:
            failures.append(str(exc))
    for tensor in inputs:
        device.deallocate(tensor)
    return failures


def test_cleanup_retries_release_before_deallocating_inputs() -> None:
    device, fake = open_device((1, 1))
    x = device.upload(host(1, 2))
    y = device.allocate(shape=(2,), dtype=torch.float32)
    trace = warm_capture(device, lambda: x + y)
    fake.inject("release_trace", 1)

    start = len(fake.calls)
    failures = release_then_deallocate(device, trace, [x, y])

    assert failures == [
        f"release_trace: ttnn.release_trace failed on {device.id}: "
        "InjectedTtnnFailure: injected ttnn failure: release_trace call #1"
    ]
    assert calls_since(fake, start) == [
        "release_trace",
        "release_trace",
        "deallocate",
        "deallocate",
    ]
    assert device.stats().live_tensors == 0
    assert device.stats().live_traces == 0
    assert fake.violations == ()
    with pytest.raises(DeviceError, match="already deallocated"):
        device.deallocate(x)
    assert fake.call_names().count("deallocate") == 2


def test_deallocating_a_live_traces_input_is_caught_by_the_fake() -> None:
    device, _ = open_device((1, 1))
    x = device.upload(host(1, 2))
    trace = warm_capture(device, lambda: x * 2)
    with pytest.raises(DeviceError, match="release_trace before deallocating") as caught:
        device.deallocate(x)
    assert isinstance(caught.value.__cause__, TtnnRuleViolation)
    assert device.stats().live_tensors == 1
    device.release_trace(trace)
    device.deallocate(x)
    assert device.stats().live_tensors == 0


def test_capture_warmup_runs_precede_begin_trace_capture() -> None:
    device, fake = open_device((1, 1), capture_warmup_runs=1)
    x = device.upload(host(1, 2))
    seen: list[bool] = []

    def program() -> Any:
        seen.append(device.capturing)
        return x + 1

    start = len(fake.calls)
    trace = device.capture_trace(program)
    assert seen == [False, True]
    assert calls_since(fake, start) == ["add", "begin_trace_capture", "add", "end_trace_capture"]
    device.release_trace(trace)


def test_ttnn_failures_become_device_errors_naming_the_call() -> None:
    device, fake = open_device((1, 1), fake=FakeTtnn(fail={"execute_trace": 2}, torch_ops="allow"))
    x = device.upload(host(1))
    trace = warm_capture(device, lambda: x + 1)
    device.execute_trace(trace)
    with pytest.raises(DeviceError, match=r"execute_trace: ttnn.execute_trace failed on ttnn:0"):
        device.execute_trace(trace)
    assert device.stats().replays == 1
    assert [c.injected for c in fake.calls if c.name == "execute_trace"] == [False, True]
