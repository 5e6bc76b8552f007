"""FaultyDevice: fails exactly the chosen calls, logs every call, delegates the rest."""

from __future__ import annotations

import pytest
import torch

from llmrt.device import Device, TorchDevice
from llmrt.errors import ConfigError, DeviceError
from llmrt.testing import FaultyDevice, InjectedFault


def test_fails_exactly_the_nth_call_and_delegates_the_others() -> None:
    inner = TorchDevice("cpu")
    device = FaultyDevice(inner, fail={"deallocate": 2})
    tensors = [device.allocate(shape=(1,), dtype=torch.float32) for _ in range(3)]

    device.deallocate(tensors[0])
    with pytest.raises(InjectedFault, match="deallocate call #2 on cpu:0") as caught:
        device.deallocate(tensors[1])
    device.deallocate(tensors[2])

    assert isinstance(caught.value, DeviceError)
    assert (caught.value.op, caught.value.call_number) == ("deallocate", 2)
    assert inner.stats().deallocations == 2  # the injected call was not delegated
    assert inner.stats().live_tensors == 1
    device.deallocate(tensors[1])  # call 4 succeeds: the tensor was never freed
    assert [c.injected for c in device.calls_of("deallocate")] == [False, True, False, False]


def test_several_call_numbers_and_operations() -> None:
    device = FaultyDevice(TorchDevice("cpu"), fail={"upload": [1, 3], "release_trace": 1})
    outcomes = []
    for _ in range(4):
        try:
            device.upload(torch.ones(1))
            outcomes.append("ok")
        except InjectedFault:
            outcomes.append("fault")
    assert outcomes == ["fault", "ok", "fault", "ok"]

    x = device.upload(torch.ones(1))
    trace = device.capture_trace(lambda: x + 1)
    with pytest.raises(InjectedFault):
        device.release_trace(trace)
    assert device.stats().live_traces == 1
    device.release_trace(trace)
    assert device.stats().live_traces == 0


def test_records_every_call_with_its_subject() -> None:
    device = FaultyDevice(TorchDevice("cpu"), fail={})
    t = device.upload(torch.zeros(2))
    device.refresh(t, torch.ones(2))
    device.read(t, blocking=True)
    device.synchronize()

    assert [c.op for c in device.calls] == ["upload", "refresh", "read", "synchronize"]
    assert len(device.calls_of("refresh", subject=t)) == 1
    assert "shape=(2,)" in device.calls_of("read")[0].summary
    assert device.calls_of("synchronize")[0].subject_id is None


def test_is_a_device_and_wraps_lanes_with_shared_counters() -> None:
    device = FaultyDevice(TorchDevice("cpu"), fail={"allocate": 2})
    assert isinstance(device, Device)
    lane0, lane1 = device.lanes(2)
    assert device.lanes(2) == (lane0, lane1)
    assert lane0.id == "cpu:0/lane0"
    assert lane0.parent is device

    lane0.allocate(shape=(1,), dtype=torch.float32)
    with pytest.raises(InjectedFault, match="on cpu:0/lane1"):
        lane1.allocate(shape=(1,), dtype=torch.float32)
    assert [c.device_id for c in device.calls_of("allocate")] == ["cpu:0/lane0", "cpu:0/lane1"]


@pytest.mark.parametrize(
    ("fail", "message"),
    [
        ({"dealocate": 1}, "fail.dealocate: is not a port operation"),
        ({"deallocate": 0}, "fail.deallocate: call numbers are integers >= 1, got 0"),
        ({"read": [1, "2"]}, "fail.read: call numbers are integers >= 1"),
    ],
)
def test_rejects_a_bad_fault_plan(fail: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        FaultyDevice(TorchDevice("cpu"), fail=fail)  # type: ignore[arg-type]
