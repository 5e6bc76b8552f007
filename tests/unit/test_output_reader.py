"""OutputReader: blocking reads, submit/complete with events, foreign handles, drain, and no
silent fallback: a failed event record or partial copy is a logged error."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from llmrt.device.torch import TorchDevice
from llmrt.errors import DeviceError
from llmrt.runtime.output_reader import OutputReader, PendingRead
from llmrt.testing import FaultyDevice


def _outputs(device: Any) -> dict[str, Any]:
    """A nested device output: dict of tuple/list/tensors plus a non-tensor leaf."""
    return {
        "logits": device.upload(torch.arange(12, dtype=torch.float32).reshape(3, 4)),
        "pair": (
            device.upload(torch.tensor([7, 8, 9])),
            [device.upload(torch.tensor([True, False])), "tag"],
        ),
        "count": 3,
    }


def _assert_values(host: dict[str, Any]) -> None:
    assert torch.equal(host["logits"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert isinstance(host["pair"], tuple) and isinstance(host["pair"][1], list)
    assert torch.equal(host["pair"][0], torch.tensor([7, 8, 9]))
    assert torch.equal(host["pair"][1][0], torch.tensor([True, False]))
    assert host["pair"][1][1] == "tag" and host["count"] == 3


def _poisoned(host: dict[str, Any]) -> bool:
    """CPU non-blocking reads hold NaN / int max / True until their event is synchronized."""
    return bool(
        torch.isnan(host["logits"]).all()
        and (host["pair"][0] == torch.iinfo(torch.int64).max).all()
        and host["pair"][1][0].all()
    )


def test_blocking_read_of_nested_values_is_a_host_copy() -> None:
    device = TorchDevice("cpu")
    reader = OutputReader(device=device)
    value = _outputs(device)
    host = reader.read(value)
    _assert_values(host)
    assert host["logits"] is not value["logits"]
    value["logits"].zero_()
    assert host["logits"].sum() == 66  # unaffected by later device writes
    assert reader.pending_count == 0


@pytest.mark.parametrize("by", ["handle", "host_value"])
def test_submit_then_complete(by: str) -> None:
    device = TorchDevice("cpu")
    reader = OutputReader(device=device)
    value = _outputs(device)
    pending = reader.submit(value)
    assert isinstance(pending, PendingRead)
    assert len(pending.events) == 1 and not pending.completed
    assert reader.pending_count == 1
    assert _poisoned(pending.host_value), "host value must not be valid before complete()"

    host = reader.complete(pending if by == "handle" else pending.host_value)
    assert host is pending.host_value
    assert pending.completed and reader.pending_count == 0
    assert device.stats().pending_reads == 0
    _assert_values(host)


def test_the_read_snapshots_the_value_at_submit_time() -> None:
    device = TorchDevice("cpu")
    reader = OutputReader(device=device)
    value = {"x": device.upload(torch.tensor([1.0, 2.0]))}
    pending = reader.submit(value)
    value["x"].add_(10)  # the next step overwrites the device buffer
    assert torch.equal(reader.complete(pending)["x"], torch.tensor([1.0, 2.0]))


def test_reads_complete_independently_and_in_any_order() -> None:
    device = TorchDevice("cpu")
    reader = OutputReader(device=device)
    first = reader.submit(device.upload(torch.tensor([1.0])))
    second = reader.submit(device.upload(torch.tensor([2.0])))
    assert first.sequence < second.sequence
    assert torch.equal(reader.complete(second), torch.tensor([2.0]))
    assert reader.pending_count == 1
    assert torch.equal(reader.complete(first.host_value), torch.tensor([1.0]))
    assert reader.pending_count == 0


def test_foreign_and_stale_handles_are_rejected() -> None:
    device = TorchDevice("cpu")
    reader, other = OutputReader(device=device), OutputReader(device=device)
    pending = reader.submit({"x": device.upload(torch.ones(2))})
    theirs = other.submit({"x": device.upload(torch.ones(2))})

    with pytest.raises(DeviceError, match="belongs to another OutputReader"):
        reader.complete(theirs)
    with pytest.raises(DeviceError, match="is not a host value this reader submitted"):
        reader.complete(theirs.host_value)
    with pytest.raises(DeviceError, match="is not a host value this reader submitted"):
        reader.complete({"x": torch.ones(2)})
    assert reader.pending_count == 1 and other.pending_count == 1

    reader.complete(pending)
    with pytest.raises(DeviceError, match="is not pending"):
        reader.complete(pending)
    with pytest.raises(DeviceError, match="is not a host value"):
        reader.complete(pending.host_value)
    other.complete(theirs)


def test_drain_retires_everything_and_is_idempotent() -> None:
    inner = TorchDevice("cpu")
    device = FaultyDevice(inner, fail={})
    reader = OutputReader(device=device)
    handles = [reader.submit({"x": device.upload(torch.full((2,), float(i)))}) for i in range(3)]
    assert reader.pending_count == 3 and inner.stats().pending_reads == 3

    assert reader.drain() == 3
    assert reader.pending_count == 0 and inner.stats().pending_reads == 0
    assert all(h.completed for h in handles)
    assert len(device.calls_of("synchronize")) == 1
    # Drained destinations hold the real values (the device was synchronized).
    assert [float(h.host_value["x"][0]) for h in handles] == [0.0, 1.0, 2.0]
    with pytest.raises(DeviceError, match="is not pending"):
        reader.complete(handles[0])

    assert reader.drain() == 0
    assert len(device.calls_of("synchronize")) == 1  # nothing pending: no device work


@pytest.mark.parametrize(
    ("op", "call"), [("record_event", 1), ("read", 1), ("read", 2), ("read", 3)]
)
def test_a_failed_async_read_is_a_logged_error_not_a_silent_fallback(op: str, call: int) -> None:
    inner = TorchDevice("cpu")
    device = FaultyDevice(inner, fail={op: call})
    reader = OutputReader(device=device, lane=3)
    value = _outputs(device)
    with capture_logs() as logs, pytest.raises(DeviceError) as info:
        reader.submit(value)
    where = "record_event" if op == "record_event" else "non-blocking read"
    assert f"asynchronous output read failed at {where}" in str(info.value)
    assert "injected fault" in str(info.value)
    assert isinstance(info.value.__cause__, DeviceError)
    (failed,) = [e for e in logs if e["event"] == "output.read_failed"]
    assert failed["lane"] == 3 and failed["log_level"] == "warning"
    # Copies already started were waited out; nothing is pending or owned by the reader.
    assert len(device.calls_of("synchronize")) == 1
    assert inner.stats().pending_reads == 0
    assert reader.pending_count == 0
    # No blocking re-read happened behind the caller's back (three tensors in the value).
    assert len(device.calls_of("read")) == (3 if op == "record_event" else call)
