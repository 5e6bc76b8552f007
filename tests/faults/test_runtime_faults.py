"""Prefill and decode over a ``FaultyDevice``: failed uploads, deallocations, reads and
event waits. The error propagates (or, for a failed deallocation, is kept as a retryable
orphan), nothing leaks once the lane is cleaned up (``live_tensors`` returns to the
baseline), and every KV tensor is deallocated exactly once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch
from lane_fixtures import (  # noqa: F401 (single_torch_thread: autouse)
    Lane,
    assert_unchanged_outside,
    build_lane,
    make_rows,
    page_table,
    prompt,
    single_torch_thread,
    tiny_llama,
    written_mask,
)

from llmrt.device.torch import TorchDevice
from llmrt.errors import CleanupError, DeviceError
from llmrt.families.base import CausalLM
from llmrt.runtime.decode import DecodeOutput, DecodeOutputLease
from llmrt.testing import FaultyDevice, InjectedFault

BS = 4
NUM_BLOCKS = 32
CHUNK = 16
PREFILL_UPLOADS_PER_STEP = 5  # tokens, start_pos, seq_lens, page_table, last_token_index
DECODE_UPLOADS_PER_STEP = 3  # tokens, positions, page_table

LONG, SHORT = 40, 6  # the long prompt runs as 3 chunks, the short one as a single step
BLOCKS = (tuple(range(0, 10)), (20, 21))


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return tiny_llama()


def _lane(model: CausalLM, fail: Mapping[str, Any]) -> tuple[Lane, FaultyDevice]:
    device = FaultyDevice(TorchDevice("cpu"), fail=fail)
    lane = build_lane(
        model=model, device=device, block_size=BS, num_blocks=NUM_BLOCKS, max_chunk=CHUNK
    )
    assert device.calls_of("upload") == () and device.calls_of("deallocate") == ()
    return lane, device


def _kv_size(lane: Lane) -> int:
    return 2 * lane.model.config.num_layers


def _rows() -> list[Any]:
    return make_rows([prompt(SHORT, seed=1), prompt(LONG, seed=2)], [BLOCKS[1], BLOCKS[0]])


def _prefill_mask() -> torch.Tensor:
    return written_mask(
        [(BLOCKS[1], SHORT), (BLOCKS[0], LONG)], num_blocks=NUM_BLOCKS, block_size=BS
    )


def _decode_args(**overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "tokens": [3, 5],
        "start_pos": [0, 2],
        "page_table": page_table([[4], [7]], width=4),
    }
    args.update(overrides)
    return args


def _cleanup_and_check(lane: Lane, device: FaultyDevice) -> None:
    """Clean up (retrying until the planned faults are spent); nothing may leak."""
    tensors = lane.kv_tensors()
    for _ in range(3):
        try:
            lane.cleanup()
            break
        except CleanupError:
            continue
    else:
        pytest.fail("cleanup never succeeded")
    lane.cleanup()  # idempotent
    stats = lane.inner.stats()
    assert stats.live_tensors == lane.baseline_live, "device tensors leaked"
    assert stats.pending_reads == 0
    assert lane.decode.outstanding_leases == 0 and lane.reader.pending_count == 0
    for t in tensors:
        done = [c for c in device.calls_of("deallocate", subject=t) if not c.injected]
        assert len(done) == 1, "every KV tensor is deallocated exactly once"


def _only_kv_live(lane: Lane) -> None:
    assert lane.live_tensors() == lane.baseline_live + _kv_size(lane)


# -- prefill ---------------------------------------------------------------------------


def test_the_scenario_uses_the_expected_number_of_uploads(model: CausalLM) -> None:
    """Guards the call numbers below: one single step plus three chunk steps."""
    lane, device = _lane(model, {})
    out = lane.executor.prefill_forward(rows=_rows())
    assert out.logits is not None and torch.isfinite(out.logits).all()
    assert len(device.calls_of("upload")) == 4 * PREFILL_UPLOADS_PER_STEP
    assert len(device.calls_of("deallocate")) == 4 * PREFILL_UPLOADS_PER_STEP
    _only_kv_live(lane)
    _cleanup_and_check(lane, device)


@pytest.mark.parametrize("failing", [1, 3, 5, 8, 20])
def test_prefill_upload_failure_propagates_and_leaks_nothing(model: CausalLM, failing: int) -> None:
    lane, device = _lane(model, {"upload": failing})
    before = lane.snapshot()
    with pytest.raises(InjectedFault) as exc:
        lane.executor.prefill_forward(rows=_rows())
    assert (exc.value.op, exc.value.call_number) == ("upload", failing)
    _only_kv_live(lane)  # the step's staged inputs were released on the way out
    assert lane.prefill.orphans == ()
    assert_unchanged_outside(before, lane.snapshot(), _prefill_mask())
    if failing <= PREFILL_UPLOADS_PER_STEP:  # the first step never ran: no KV write at all
        for old, new in zip(before, lane.snapshot(), strict=True):
            assert torch.equal(old, new)
    _cleanup_and_check(lane, device)


def test_prefill_upload_failure_with_a_failed_release_keeps_the_upload_error(
    model: CausalLM,
) -> None:
    lane, device = _lane(model, {"upload": 3, "deallocate": 1})
    with pytest.raises(InjectedFault) as exc:
        lane.executor.prefill_forward(rows=_rows())
    assert (exc.value.op, exc.value.call_number) == ("upload", 3)
    assert len(lane.prefill.orphans) == 1
    assert lane.live_tensors() == lane.baseline_live + _kv_size(lane) + 1
    lane.prefill.cleanup()
    assert lane.prefill.orphans == ()
    _only_kv_live(lane)
    _cleanup_and_check(lane, device)


def test_prefill_failed_deallocation_is_an_orphan_released_by_cleanup(model: CausalLM) -> None:
    clean, clean_device = _lane(model, {})
    want = clean.executor.prefill_forward(rows=_rows()).logits
    _cleanup_and_check(clean, clean_device)

    lane, device = _lane(model, {"deallocate": 2})
    out = lane.executor.prefill_forward(rows=_rows())
    assert out.logits is not None and want is not None
    assert torch.equal(out.logits, want), "a failed release does not change the results"
    assert len(lane.prefill.orphans) == 1
    assert lane.live_tensors() == lane.baseline_live + _kv_size(lane) + 1
    _cleanup_and_check(lane, device)


def test_prefill_cleanup_reports_a_release_that_fails_again(model: CausalLM) -> None:
    steps = 4 * PREFILL_UPLOADS_PER_STEP
    lane, device = _lane(model, {"deallocate": [2, steps + 1]})
    lane.executor.prefill_forward(rows=_rows())
    assert len(lane.prefill.orphans) == 1
    with pytest.raises(CleanupError) as exc:
        lane.prefill.cleanup()  # the retry (deallocate call steps+1) fails too
    assert isinstance(exc.value.failures[0][1], InjectedFault)
    assert len(lane.prefill.orphans) == 1
    lane.prefill.cleanup()
    assert lane.prefill.orphans == ()
    _only_kv_live(lane)
    _cleanup_and_check(lane, device)


def test_prefill_read_failure_propagates_and_leaks_nothing(model: CausalLM) -> None:
    lane, device = _lane(model, {"read": 1})
    with pytest.raises(InjectedFault) as exc:
        lane.executor.prefill_forward(rows=_rows())
    assert exc.value.op == "read"
    _only_kv_live(lane)
    assert lane.reader.pending_count == 0
    _cleanup_and_check(lane, device)


# -- decode ----------------------------------------------------------------------------


@pytest.mark.parametrize("failing", [1, 2, 3, 5])
def test_decode_upload_failure_propagates_and_leaks_nothing(model: CausalLM, failing: int) -> None:
    lane, device = _lane(model, {"upload": failing})
    before = lane.snapshot()
    if failing > DECODE_UPLOADS_PER_STEP:
        lane.executor.decode_forward(**_decode_args())
        before = lane.snapshot()
    with pytest.raises(InjectedFault) as exc:
        lane.executor.decode_forward(**_decode_args(start_pos=[1, 3]))
    assert (exc.value.op, exc.value.call_number) == ("upload", failing)
    _only_kv_live(lane)
    assert lane.decode.orphans == ()
    for old, new in zip(before, lane.snapshot(), strict=True):
        assert torch.equal(old, new), "the failed step wrote no KV"
    _cleanup_and_check(lane, device)


def test_decode_upload_failure_with_a_failed_release_keeps_the_upload_error(
    model: CausalLM,
) -> None:
    lane, device = _lane(model, {"upload": 3, "deallocate": 2})
    with pytest.raises(InjectedFault) as exc:
        lane.executor.decode_forward(**_decode_args())
    assert (exc.value.op, exc.value.call_number) == ("upload", 3)
    assert len(lane.decode.orphans) == 1
    assert lane.live_tensors() == lane.baseline_live + _kv_size(lane) + 1
    _cleanup_and_check(lane, device)


def test_decode_failed_deallocation_is_an_orphan_released_by_cleanup(model: CausalLM) -> None:
    lane, device = _lane(model, {"deallocate": [1, 4]})
    first = lane.executor.decode_forward(**_decode_args())
    assert isinstance(first, DecodeOutput) and first.logits is not None
    assert len(lane.decode.orphans) == 1
    assert lane.live_tensors() == lane.baseline_live + _kv_size(lane) + 1
    with pytest.raises(CleanupError):
        lane.decode.cleanup_transients()  # the retry is deallocate call #4: fails again
    assert len(lane.decode.orphans) == 1
    lane.decode.cleanup_transients()
    assert lane.decode.orphans == ()
    _only_kv_live(lane)
    _cleanup_and_check(lane, device)


def test_decode_blocking_read_failure_propagates(model: CausalLM) -> None:
    lane, device = _lane(model, {"read": 1})
    with pytest.raises(InjectedFault, match="read call #1"):
        lane.executor.decode_forward(**_decode_args())
    assert lane.decode.outstanding_leases == 0
    _only_kv_live(lane)
    again = lane.executor.decode_forward(**_decode_args())  # the lane stays usable
    assert isinstance(again, DecodeOutput)
    _cleanup_and_check(lane, device)


def _decode_logits(model: CausalLM) -> torch.Tensor:
    lane, device = _lane(model, {})
    out = lane.executor.decode_forward(**_decode_args())
    assert isinstance(out, DecodeOutput) and out.logits is not None
    _cleanup_and_check(lane, device)
    return out.logits


@pytest.mark.parametrize("fail", [{"read": 1}, {"record_event": 1}], ids=["read", "record_event"])
def test_async_read_faults_are_errors_not_silent_fallbacks(
    model: CausalLM, fail: Mapping[str, int]
) -> None:
    lane, device = _lane(model, fail)
    lease = lane.executor.decode_forward(read_from_device=False, **_decode_args())
    assert isinstance(lease, DecodeOutputLease)
    with pytest.raises(DeviceError, match="asynchronous output read failed"):
        lane.decode.read_decode_output(lease, async_read=True)
    assert lane.reader.pending_count == 0 and lane.inner.stats().pending_reads == 0
    assert len(device.calls_of("read")) <= 2, "no blocking re-read behind the caller's back"
    _cleanup_and_check(lane, device)  # the lease is still the runtime's: cleanup retires it
    assert lease.released


def test_failed_event_wait_propagates_and_drain_retires_the_read(model: CausalLM) -> None:
    lane, device = _lane(model, {"event_synchronize": 1})
    lease = lane.executor.decode_forward(read_from_device=False, **_decode_args())
    assert isinstance(lease, DecodeOutputLease)
    host, events = lane.decode.read_decode_output(lease, async_read=True)
    assert len(events) == 1
    with pytest.raises(InjectedFault, match="event_synchronize"):
        lane.decode.process_decode_output_host(host)
    assert lane.decode.drain_external_outputs() == 1
    assert lane.decode.outstanding_leases == 0 and lease.released
    assert lane.reader.pending_count == 0
    assert lane.inner.stats().pending_reads == 0, "drain retires the unfinished device read"
    _cleanup_and_check(lane, device)


def test_failed_drain_synchronize_keeps_going_and_cleanup_still_releases_kv(
    model: CausalLM,
) -> None:
    lane, device = _lane(model, {"synchronize": 1})
    lease = lane.executor.decode_forward(read_from_device=False, **_decode_args())
    assert isinstance(lease, DecodeOutputLease)
    lane.decode.read_decode_output(lease, async_read=True)
    with pytest.raises(CleanupError) as exc:
        lane.cleanup()
    failed = [name for name, e in exc.value.failures if isinstance(e, DeviceError)]
    assert failed == ["lane0/external_decode_leases"]
    assert not lane.kv.is_bound, "later steps ran: the KV cache was released anyway"
    assert lane.live_tensors() == lane.baseline_live
    # The read stayed pending, so the next step (pending_output_reads) retired it; the
    # lease is kept for the next cleanup.
    assert lane.reader.pending_count == 0 and lane.inner.stats().pending_reads == 0
    assert lane.decode.outstanding_leases == 1 and not lease.released
    _cleanup_and_check(lane, device)
    assert lease.released
