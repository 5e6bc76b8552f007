"""The device-port contract, run against every available backend."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from llmrt.device import Device, TorchDevice
from llmrt.errors import ConfigError, DeviceError, TraceStateError
from llmrt.testing.devices import requires_cuda


@pytest.fixture
def device(torch_device: str) -> Iterator[TorchDevice]:
    """A fresh device on every torch device (the plugin's ``torch_device``)."""
    yield TorchDevice(torch_device)


def host(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def affine(*, x: torch.Tensor, scale: float) -> torch.Tensor:
    return x * scale + 1


def test_satisfies_the_port(device: TorchDevice) -> None:
    assert isinstance(device, Device)
    assert device.kind in ("cpu", "cuda")
    assert device.parent is None
    assert not device.capturing
    assert device.allocate(shape=(2, 3), dtype=torch.int32).device == device.torch_device


def test_allocate_is_zeroed_and_upload_copies(device: TorchDevice) -> None:
    zeros = device.allocate(shape=(4,), dtype=torch.int64)
    assert zeros.dtype == torch.int64
    assert device.read(zeros, blocking=True).tolist() == [0, 0, 0, 0]
    source = host(1, 2, 3)
    uploaded = device.upload(source)
    source.fill_(9)
    assert device.read(uploaded, blocking=True).tolist() == [1, 2, 3]
    assert device.stats().live_tensors == 2


def test_refresh_then_replay_gives_the_new_result(device: TorchDevice) -> None:
    x = device.upload(host(1, 2, 3))
    trace = device.capture_trace(functools.partial(affine, x=x, scale=2.0))
    out = trace.outputs
    assert device.read(out, blocking=True).tolist() == [3, 5, 7]

    device.refresh(x, host(10, 20, 30))
    device.execute_trace(trace, blocking=True)

    assert trace.outputs is out
    assert device.read(out, blocking=True).tolist() == [21, 41, 61]
    assert device.stats().replays == 1


def test_replay_without_refresh_gives_the_stale_result(device: TorchDevice) -> None:
    source = host(1, 2, 3)
    x = device.upload(source)
    trace = device.capture_trace(functools.partial(affine, x=x, scale=2.0))

    source.copy_(host(10, 20, 30))  # the host changed, the device input was not refreshed
    device.execute_trace(trace, blocking=True)
    assert device.read(trace.outputs, blocking=True).tolist() == [3, 5, 7]

    device.refresh(x, host(10, 20, 30))  # refreshed, but not replayed: outputs stay stale
    assert device.read(trace.outputs, blocking=True).tolist() == [3, 5, 7]
    device.execute_trace(trace, blocking=True)
    assert device.read(trace.outputs, blocking=True).tolist() == [21, 41, 61]


def test_values_bound_at_capture_stay_baked(device: TorchDevice) -> None:
    scale = 2.0
    x = device.upload(host(1, 2, 3))
    trace = device.capture_trace(functools.partial(affine, x=x, scale=scale))

    scale = 100.0  # re-binding after capture must not reach the trace
    x = device.upload(host(7, 7, 7))  # a new tensor is not a refresh of the captured one
    device.execute_trace(trace, blocking=True)

    assert device.read(trace.outputs, blocking=True).tolist() == [3, 5, 7]


def test_replay_rewrites_every_output_in_place(device: TorchDevice) -> None:
    x = device.upload(host(1, 2))

    def program() -> dict[str, Any]:
        return {"sum": x.sum(), "pair": (x * 2, x + 1), "label": "baked"}

    trace = device.capture_trace(program)
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
    ],
)
def test_capture_rejects_host_traffic(device: TorchDevice, op: str, call: object) -> None:
    t = device.upload(host(0))
    before = device.stats()

    def program() -> torch.Tensor:
        call(device, t)  # type: ignore[operator]
        return t + 1

    with pytest.raises(DeviceError, match=rf"{op}: .*during trace capture"):
        device.capture_trace(program)
    assert not device.capturing
    assert device.stats().live_traces == 0
    assert device.stats().allocations == before.allocations
    device.refresh(t, host(3))  # the device is usable again
    assert device.read(t, blocking=True).tolist() == [3]


def test_nested_capture_raises(device: TorchDevice) -> None:
    x = device.upload(host(1))

    def outer() -> torch.Tensor:
        device.capture_trace(lambda: x + 1)
        return x + 2

    with pytest.raises(TraceStateError, match="nested trace capture"):
        device.capture_trace(outer)
    assert device.stats().live_traces == 0
    assert not device.capturing


def test_failed_capture_registers_nothing(device: TorchDevice) -> None:
    x = device.upload(host(1))

    def broken() -> torch.Tensor:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        device.capture_trace(broken)
    assert not device.capturing
    assert device.stats().live_traces == 0
    assert device.stats().captures == 0
    trace = device.capture_trace(lambda: x * 3)
    assert trace.trace_id == 0
    device.release_trace(trace)


def test_release_is_idempotent_and_replay_after_release_raises(device: TorchDevice) -> None:
    x = device.upload(host(1))
    trace = device.capture_trace(lambda: x * 3)
    assert device.live_trace_count == 1

    device.release_trace(trace)
    device.release_trace(trace)

    assert device.live_trace_count == 0
    with pytest.raises(TraceStateError, match="released"):
        device.execute_trace(trace)


def test_foreign_trace_is_rejected(device: TorchDevice) -> None:
    other = TorchDevice(device.torch_device.type)
    x = other.upload(host(1))
    trace = other.capture_trace(lambda: x + 1)
    with pytest.raises(TraceStateError, match="was not captured by"):
        device.execute_trace(trace)
    lane0, lane1 = device.lanes(2)
    y = lane0.upload(host(1))
    lane_trace = lane0.capture_trace(lambda: y + 1)
    with pytest.raises(TraceStateError, match=r"belongs to .*lane0"):
        lane1.execute_trace(lane_trace)


def test_non_blocking_read_is_valid_only_after_its_event(device: TorchDevice) -> None:
    t = device.upload(host(1, 2, 3))
    earlier = device.record_event()
    pending = device.read(t, blocking=False)
    event = device.record_event()
    device.refresh(t, host(7, 8, 9))  # queued after the read: must not show in it

    if device.kind == "cpu":
        device.event_synchronize(earlier)  # recorded before the read: does not complete it
        assert not torch.equal(pending, host(1, 2, 3))
        assert device.stats().pending_reads == 1
    device.event_synchronize(event)

    assert pending.tolist() == [1, 2, 3]
    assert device.stats().pending_reads == 0


def test_synchronize_completes_pending_reads(device: TorchDevice) -> None:
    t = device.upload(host(4, 5))
    pending = device.read(t, blocking=False)
    device.synchronize()
    assert pending.tolist() == [4, 5]


def test_event_from_another_device_is_rejected(device: TorchDevice) -> None:
    lane0, lane1 = device.lanes(2)
    with pytest.raises(DeviceError, match="was not recorded on"):
        lane1.event_synchronize(lane0.record_event())


def test_refresh_mismatch_names_both_tensors(device: TorchDevice) -> None:
    dst = device.allocate(shape=(2, 3), dtype=torch.float32)
    with pytest.raises(DeviceError, match=r"shape=\(2, 4\).*shape=\(2, 3\)"):
        device.refresh(dst, torch.zeros(2, 4))
    with pytest.raises(DeviceError, match=r"dtype=int32.*dtype=float32"):
        device.refresh(dst, torch.zeros(2, 3, dtype=torch.int32))


def test_allocate_in_a_given_dim_order(device: TorchDevice) -> None:
    t = device.allocate(shape=(2, 3, 4), dtype=torch.float32, dim_order=(1, 0, 2))
    assert tuple(t.shape) == (2, 3, 4) and not t.is_contiguous()
    assert t.permute(1, 0, 2).is_contiguous()  # dim 1 outermost in memory
    assert device.read(t, blocking=True).abs().sum().item() == 0
    t[1, 2, 3] = 5.0
    assert device.read(t, blocking=True)[1, 2, 3].item() == 5.0
    device.deallocate(t)
    assert device.live_tensor_count == 0
    with pytest.raises(DeviceError, match=r"dim_order \(0, 0, 1\) is not a permutation"):
        device.allocate(shape=(2, 3, 4), dtype=torch.float32, dim_order=(0, 0, 1))
    assert device.live_tensor_count == 0


def test_deallocation_is_counted_and_never_repeated(device: TorchDevice) -> None:
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


def test_lanes_are_distinct_stable_sub_devices(device: TorchDevice) -> None:
    lanes = device.lanes(2)
    assert [lane.id for lane in lanes] == [f"{device.id}/lane0", f"{device.id}/lane1"]
    assert all(lane.parent is device for lane in lanes)
    assert all(lane.torch_device == device.torch_device for lane in lanes)
    assert device.lanes(2) is lanes
    with pytest.raises(DeviceError, match="already split into 2 lanes"):
        device.lanes(3)
    with pytest.raises(DeviceError, match="lane sub-device"):
        lanes[0].lanes(2)
    with pytest.raises(ConfigError, match="lanes: must be a positive integer"):
        device.lanes(0)


def test_lane_owns_its_tensors(device: TorchDevice) -> None:
    lane0, lane1 = device.lanes(2)
    t = lane0.allocate(shape=(1,), dtype=torch.float32)
    with pytest.raises(DeviceError, match=r"owned by .*lane0, not .*lane1"):
        lane1.deallocate(t)
    lane0.deallocate(t)
    assert lane0.stats().live_tensors == 0


def test_invalid_specs_are_rejected() -> None:
    with pytest.raises(ConfigError, match="device: must be 'cpu' or 'cuda"):
        TorchDevice("meta")
    with pytest.raises(ConfigError, match="device: the cpu backend has one device"):
        TorchDevice("cpu:1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message when CUDA is missing")
def test_cuda_without_cuda_says_so() -> None:
    with pytest.raises(DeviceError, match="CUDA is not available"):
        TorchDevice("cuda:0")


def test_refresh_targets_only_tensors_this_device_allocated(device: TorchDevice) -> None:
    dst = device.upload(host(1, 2))
    stray = dst * 1  # an op output, not a persistent device tensor
    with pytest.raises(DeviceError, match="was not allocated by"):
        device.refresh(stray, host(3, 4))
    if device.kind == "cpu":  # dst and host swapped: both are cpu tensors here
        with pytest.raises(DeviceError, match="was not allocated by"):
            device.refresh(host(3, 4), dst)
    lane0, lane1 = device.lanes(2)
    lane_dst = lane0.allocate(shape=(2,), dtype=torch.float32)
    with pytest.raises(DeviceError, match=r"is owned by .*lane0, not .*lane1"):
        lane1.refresh(lane_dst, host(3, 4))


@requires_cuda
def test_cuda_trace_is_a_graph_that_replays_without_python() -> None:
    device = TorchDevice("cuda:0", cuda_warmup_runs=2)
    x = device.upload(host(1, 2))
    seen: list[bool] = []

    def program() -> torch.Tensor:
        seen.append(torch.cuda.is_current_stream_capturing())
        return x * 2

    trace = device.capture_trace(program)
    assert seen == [False, False, True]  # two eager warm-up runs on a side stream, one capture
    device.refresh(x, host(5, 6))
    device.execute_trace(trace, blocking=True)
    assert len(seen) == 3
    assert device.read(trace.outputs, blocking=True).tolist() == [10, 12]
    pending = device.read(trace.outputs, blocking=False)
    assert pending.is_pinned()
    device.event_synchronize(device.record_event())
    assert pending.tolist() == [10, 12]
    device.release_trace(trace)
    assert device.stats().live_traces == 0


def test_large_cpu_allocation_is_zeroed_lazily_in_its_dim_order() -> None:
    """Big host tensors come from fresh zero pages: zero, writable, in the asked order."""
    device = TorchDevice("cpu")
    shape = (64, 4, 32, 64)  # 2 MiB of float32
    t = device.allocate(shape=shape, dtype=torch.float32, dim_order=(0, 2, 1, 3))
    assert tuple(t.shape) == shape and t.dtype == torch.float32
    assert t.permute(0, 2, 1, 3).is_contiguous()
    assert int(torch.count_nonzero(t)) == 0
    t[3, 1].fill_(2.0)
    assert float(device.read(t, blocking=True).sum()) == 2.0 * 32 * 64
    device.deallocate(t)
    assert device.stats().live_tensors == 0


def test_is_device_tensor_knows_torch_and_backend_tensors_and_nothing_else() -> None:
    """Torch tensors and objects with a backend tensor's surface (a ``ttnn.Tensor``) are
    device tensors; plain values and containers are not (they are checked first, before the
    costly protocol check)."""
    from llmrt.device.base import is_device_tensor

    class BackendLike:
        shape = (2, 3)
        dtype = "bfloat16"

        def storage_type(self) -> str:
            return "DEVICE"

        def is_allocated(self) -> bool:
            return True

    assert is_device_tensor(torch.zeros(2))
    assert is_device_tensor(BackendLike())
    for plain in (None, True, 3, 2.5, "t", b"t", (torch.zeros(1),), [torch.zeros(1)], {"a": 1}):
        assert not is_device_tensor(plain), plain
    assert not is_device_tensor(object())
