"""A fault at every teardown step: every cleanup step x {an error, Ctrl-C} x {1, 2 lanes} x
{eager, traced}, each followed by the retry that finishes the teardown.

After the faulted ``close_runtime``: the step is an orphan of the root scope, nothing created
before it was closed (the device stays open, earlier lanes keep their KV), and ``llmrt audit``
exits 1 on the log. After the retry: everything is closed, each lane step completed exactly
once, the device closed once and last, and the same log audits clean (exit 0).

The whole matrix (80 cases of a tiny Llama with one warmed shape) runs in the default suite:
about 20 s on two cores.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dependency_injector import providers
from lane_fixtures import single_torch_thread  # noqa: F401  (autouse fixture)

from llmrt.cli.main import main
from llmrt.device.torch import TorchDevice
from llmrt.errors import CleanupError
from llmrt.testing import FaultyDevice

Runtime = Any  # conftest's Runtime

#: Where each lane cleanup step can be made to fail: (object on the lane's executor, method).
LANE_STEPS: dict[str, tuple[str, str]] = {
    "external_decode_leases": ("decode", "drain_external_outputs"),
    "pending_output_reads": ("output_reader", "drain"),
    "prefill_transients": ("prefill", "cleanup"),
    "decode_transients": ("decode", "cleanup_transients"),
    "traces": ("", "release_traces"),
    "program_registry": ("eager.program_compiler", "cleanup"),
    "device_sampling_buffers": ("", "release_sampling_buffers"),
    "paged_kv_cache": ("kv_cache", "release"),
}
#: Scope steps with something to close besides the lane executor's.
SCOPE_STEPS = ("step_compiler", "device")
STEPS = (*LANE_STEPS, *SCOPE_STEPS)
ERRORS = {"error": RuntimeError, "ctrl-c": KeyboardInterrupt}

SMALL = [
    "kv_cache.num_blocks=8",
    "decode.lane_capacity=1",
    "warmup.prefill_seq_lens=[32]",
    "warmup.prefill_batch_sizes=[1]",
]


def _cases() -> Iterator[Any]:
    for step, error, lanes, mode in itertools.product(STEPS, ERRORS, (1, 2), ("eager", "traced")):
        yield pytest.param(step, error, lanes, mode, id=f"{step}-{error}-{lanes}-{mode}")


def _audit(log: Path, tmp_path: Path, name: str) -> int:
    snapshot = tmp_path / name
    shutil.copyfile(log, snapshot)
    with contextlib.redirect_stdout(io.StringIO()):
        return main(["audit", str(snapshot)])


def _events(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _fail_once(obj: Any, method: str, error: type[BaseException]) -> list[int]:
    """Make ``obj.method`` raise ``error`` on its first call, then work; returns the calls."""
    original = getattr(obj, method)
    calls: list[int] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise error(f"injected into {method}")
        return original(*args, **kwargs)

    setattr(obj, method, failing)
    return calls


@pytest.mark.parametrize(("step", "error", "lanes", "mode"), list(_cases()))
def test_a_fault_at_a_teardown_step_blocks_what_came_before_until_its_retry(
    step: str,
    error: str,
    lanes: int,
    mode: str,
    lifecycle_log: Path,
    tmp_path: Path,
    build: Callable[..., Runtime],
) -> None:
    raised = ERRORS[error]
    device = FaultyDevice(
        TorchDevice("cpu"),
        fail={"close": 1} if step == "device" and raised is RuntimeError else {},
        interrupt={"close": 1} if step == "device" and raised is KeyboardInterrupt else {},
    )
    trace = "decode_only" if mode == "traced" else "none"
    runtime = build("tiny-llama", [*SMALL, f"lanes={lanes}", f"trace.mode={trace}"])
    runtime.container.device.device.override(providers.Object(device))
    runtime.ready()
    runtime.generate([[5, 9, 2, 7]] * lanes, slots=list(range(lanes)), steps=1)
    last = runtime.container.lane_containers()[-1]
    executor = runtime.group.lanes[-1]
    calls: list[int] = []
    if step in LANE_STEPS:
        path, method = LANE_STEPS[step]
        owner = executor
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part)
        calls = _fail_once(owner, method, raised)
        failed = f"runtime/lane{lanes - 1}/model_executor"
    elif step == "step_compiler":
        calls = _fail_once(last.step_compiler(), "close", raised)
        failed = f"runtime/lane{lanes - 1}/step_compiler"
    else:
        failed = "runtime/device/device"
    root = runtime.container.root_scope()
    index = {e: i for i, e in enumerate(root.creation_order())}[failed]

    with pytest.raises(raised) as info:
        runtime.close()

    if raised is RuntimeError:
        assert isinstance(info.value, CleanupError)
    assert root.orphans() == [failed] and not root.closed
    logged = _events(lifecycle_log)
    closes = [
        e
        for e in logged
        if e["component"] == "scope" and e["event"] in ("cleanup.step", "cleanup.failed")
    ]
    assert closes[-1]["event"] == "cleanup.failed" and closes[-1]["step"] == failed
    assert all(e["index"] > index for e in closes[:-1]), "closed before the failed step"
    if step != "device":
        assert "device.closed" not in [e["event"] for e in logged]
    if lanes == 2 and step != "device":
        assert runtime.group.lanes[0].kv_cache.is_bound and not runtime.group.lanes[0].terminal
    assert _audit(lifecycle_log, tmp_path, "after-fault.jsonl") == 1

    runtime.close()

    assert root.closed and root.orphans() == []
    assert calls == [] or len(calls) == 2
    logged = _events(lifecycle_log)
    names = [e["event"] for e in logged]
    assert names.count("device.closed") == 1
    assert names.count("kv.released") == lanes
    device_events = [i for i, e in enumerate(logged) if e["component"] != "scope"]
    assert logged[device_events[-1]]["event"] == "device.closed"
    assert _audit(lifecycle_log, tmp_path, "after-retry.jsonl") == 0


def test_failures_and_interrupts_in_sequence_never_close_a_dependency_first(
    lifecycle_log: Path, tmp_path: Path, build: Callable[..., Runtime]
) -> None:
    """Lane 1's traces fail twice (an error, then Ctrl-C), then lane 0's step compiler is
    interrupted, then the device close fails: four retries, each resuming where the last
    stopped; the audit fails after every fault and holds at the end."""
    device = FaultyDevice(TorchDevice("cpu"), fail={"close": 1})
    runtime = build("tiny-llama", [*SMALL, "lanes=2", "trace.mode=decode_only"])
    runtime.container.device.device.override(providers.Object(device))
    runtime.ready()
    runtime.generate([[5, 9, 2, 7]] * 2, slots=[0, 1], steps=1)
    lanes = runtime.group.lanes
    traces = lanes[1].traced.trace_compiler
    release = traces.cleanup
    faults = iter([RuntimeError("traces, first"), KeyboardInterrupt()])

    def flaky_traces() -> None:
        error = next(faults, None)
        if error is not None:
            raise error
        release()

    traces.cleanup = flaky_traces
    _fail_once(runtime.container.lane_containers()[0].step_compiler(), "close", KeyboardInterrupt)
    root = runtime.container.root_scope()
    expected = [
        (CleanupError, "runtime/lane1/model_executor"),
        (KeyboardInterrupt, "runtime/lane1/model_executor"),
        (KeyboardInterrupt, "runtime/lane0/step_compiler"),
        (CleanupError, "runtime/device/device"),
    ]
    for number, (raised, orphan) in enumerate(expected):
        with pytest.raises(raised):
            runtime.close()
        assert root.orphans() == [orphan]
        names = [e["event"] for e in _events(lifecycle_log)]
        assert "device.closed" not in names
        assert lanes[0].kv_cache.is_bound == orphan.startswith("runtime/lane1")
        assert _audit(lifecycle_log, tmp_path, f"fault-{number}.jsonl") == 1

    runtime.close()
    assert root.closed and root.orphans() == []
    names = [e["event"] for e in _events(lifecycle_log)]
    assert names.count("device.closed") == 1 and names.count("kv.released") == 2
    assert _audit(lifecycle_log, tmp_path, "end.jsonl") == 0


@pytest.mark.parametrize(
    ("op", "kv"),
    [("release_trace", False), ("deallocate", False), ("deallocate", True), ("synchronize", False)],
    ids=["release_trace", "deallocate", "deallocate-kv", "synchronize"],
)
def test_ctrl_c_inside_a_device_call_of_the_teardown_loses_nothing(
    op: str, kv: bool, lifecycle_log: Path, tmp_path: Path, build: Callable[..., Runtime]
) -> None:
    """Ctrl-C inside the teardown's first ``op`` call (``kv``: the first free of a KV tensor;
    else a transient's free, a trace's release, a drain): the retry frees what was left, each
    tensor and trace exactly once."""

    def run(interrupt: dict[str, int]) -> tuple[Runtime, FaultyDevice, int]:
        device = FaultyDevice(TorchDevice("cpu"), fail={}, interrupt=interrupt)
        runtime = build("tiny-llama", [*SMALL, "lanes=2", "trace.mode=decode_only"])
        runtime.container.device.device.override(providers.Object(device))
        runtime.ready()
        runtime.generate([[5, 9, 2, 7]] * 2, slots=[0, 1], steps=1)
        lanes = runtime.group
        cap = lanes.lane_capacity
        table = torch.full((2 * cap, lanes.lanes[0].layout.width), -1, dtype=torch.int32)
        table[:, 0] = 0
        lease = lanes.decode_forward(
            tokens=torch.ones(2 * cap, dtype=torch.int64),
            start_pos=torch.full((2 * cap,), 4, dtype=torch.int32),
            page_table=table,
            read_from_device=False,
        )
        lanes.read_decode_output(lease, async_read=True)  # a read left in flight
        return runtime, device, len(device.calls_of(op))

    probe, probe_device, before = run({})
    context = probe.group.lanes[-1].kv_cache.context
    kv_ids = {id(t) for t in (*context.keys, *context.values)}
    probe.close()
    calls = probe_device.calls_of(op)
    target = next(
        (n for n, c in enumerate(calls, 1) if n > before and (not kv or c.subject_id in kv_ids)),
        None,
    )
    if target is None:
        pytest.fail(f"the teardown makes no {op} call to interrupt")
    runtime, device, _ = run({op: target})
    assert not [c for c in device.calls if c.injected]  # nothing interrupted before teardown
    with pytest.raises(KeyboardInterrupt):
        runtime.close()
    assert [c.op for c in device.calls if c.injected] == [op]
    assert runtime.container.root_scope().orphans()
    assert _audit(lifecycle_log, tmp_path, "interrupted.jsonl") == 1

    runtime.close()

    for lane in runtime.container.device.lane_devices():
        stats = lane.stats()
        assert (stats.live_tensors, stats.live_traces, stats.pending_reads) == (0, 0, 0)
        assert stats.deallocations == stats.allocations, "freed twice or never"
    assert _audit(lifecycle_log, tmp_path, "after-retry.jsonl") == 0
