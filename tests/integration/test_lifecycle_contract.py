"""The lifecycle contract as an outside author tests it: container-built runtimes, faults and
Ctrl-C while tearing down, retries, dependency-injector's own override idioms, two runtimes in
one log, and ``llmrt audit`` right in both directions on the logs these tests produce.

Every log here is the plugin's ``lifecycle_log`` (audited clean at teardown); ``audit_now``
audits a snapshot of it mid-test, through the ``llmrt audit`` command's entry point.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from dependency_injector import providers
from lane_fixtures import single_torch_thread  # noqa: F401  (autouse fixture)
from llmrt.containers import Borrowed, LaneContainer, close_runtime

from llmrt.cli.main import main
from llmrt.device.torch import TorchDevice
from llmrt.errors import CleanupError, ContainerStateError, KVCacheStateError
from llmrt.lifecycle.audit import CLEANUP_STEPS
from llmrt.runtime.output_reader import OutputReader
from llmrt.runtime.paged_kv_cache import KVCacheState
from llmrt.runtime.startup import StartupPhase
from llmrt.testing import FaultyDevice, InjectedFault

Runtime = Any  # conftest's Runtime

#: Small and quick: one warmed prefill shape, a 16-block cache, 2 slots per lane.
SMALL = [
    "kv_cache.num_blocks=16",
    "decode.lane_capacity=2",
    "warmup.prefill_seq_lens=[32]",
    "warmup.prefill_batch_sizes=[1]",
]
PROMPT = [5, 9, 2, 7, 11, 3]


def audit_now(log: Path, tmp_path: Path) -> tuple[int, str]:
    """``llmrt audit`` over what the log holds now: (exit status, its output)."""
    snapshot = tmp_path / f"snapshot-{len(list(tmp_path.glob('snapshot-*')))}.jsonl"
    shutil.copyfile(log, snapshot)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["audit", str(snapshot)])
    return code, out.getvalue()


def events(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def generate(runtime: Runtime, lanes: int) -> None:
    """One greedy request per lane (prefill then two decode steps)."""
    cap = runtime.group.lane_capacity
    runtime.generate([PROMPT] * lanes, slots=[lane * cap for lane in range(lanes)], steps=2)


def scope_closes(log: Path) -> list[dict[str, Any]]:
    return [
        e
        for e in events(log)
        if e["component"] == "scope" and e["event"] in ("cleanup.step", "cleanup.failed")
    ]


# -- 1. nothing closed under a live child -------------------------------------------------


def test_a_failed_lane_step_keeps_the_device_open_until_its_retry_succeeds(
    lifecycle_log: Path, tmp_path: Path, build: Callable[..., Runtime]
) -> None:
    device = FaultyDevice(TorchDevice("cpu"), fail={"release_trace": 1})
    runtime = build("tiny-llama", [*SMALL, "lanes=2"])
    runtime.container.device.device.override(providers.Object(device))
    runtime.ready()
    generate(runtime, 2)
    lanes = runtime.group.lanes

    with pytest.raises(CleanupError, match="release_trace"):
        runtime.close()

    # Lane 1 (created last) failed at its traces; nothing created before it was closed.
    logged = events(lifecycle_log)
    assert not [e for e in logged if e["event"] == "device.closed"]
    assert lanes[0].kv_cache.state is KVCacheState.BOUND
    assert not lanes[0].terminal
    assert runtime.container.root_scope().orphans() == ["runtime/lane1/model_executor"]
    assert not runtime.container.root_scope().closed
    code, out = audit_now(lifecycle_log, tmp_path)
    assert code == 1 and "[cleanup-failed]" in out

    runtime.close()

    logged = events(lifecycle_log)
    order = [e["event"] for e in logged]
    assert order.count("device.closed") == 1
    last_release = max(i for i, e in enumerate(order) if e in ("kv.released", "trace.released"))
    assert order.index("device.closed") > last_release
    closes = scope_closes(lifecycle_log)
    assert [e["step"] for e in closes if e["event"] == "cleanup.step"][-1] == (
        "runtime/device/device"
    )
    assert audit_now(lifecycle_log, tmp_path)[0] == 0


# -- 2. Ctrl-C never loses a step ---------------------------------------------------------


def test_ctrl_c_inside_the_device_close_is_a_failed_step_that_a_retry_runs(
    lifecycle_log: Path,
    tmp_path: Path,
    build: Callable[..., Runtime],
    faulty_device: Callable[..., FaultyDevice],
) -> None:
    device = faulty_device(interrupt={"close": 1})
    runtime = build("tiny-llama", SMALL)
    runtime.container.device.device.override(providers.Object(device))
    runtime.ready()
    generate(runtime, 1)

    with pytest.raises(KeyboardInterrupt):
        runtime.close()

    root = runtime.container.root_scope()
    assert root.orphans() == ["runtime/device/device"]
    assert not root.closed
    failed = [e for e in scope_closes(lifecycle_log) if e["event"] == "cleanup.failed"]
    assert [e["step"] for e in failed] == ["runtime/device/device"]
    assert "KeyboardInterrupt" in failed[0]["error"]
    code, out = audit_now(lifecycle_log, tmp_path)
    assert code == 1 and "runtime/device/device" in out

    runtime.close()

    assert root.closed and root.orphans() == []
    assert len(device.calls_of("close")) == 2
    assert [e["event"] for e in events(lifecycle_log)].count("device.closed") == 1
    assert audit_now(lifecycle_log, tmp_path)[0] == 0


def test_ctrl_c_inside_a_lane_step_is_recorded_and_retried(
    lifecycle_log: Path, tmp_path: Path, build: Callable[..., Runtime]
) -> None:
    runtime = build("tiny-llama", SMALL)
    runtime.ready()
    generate(runtime, 1)
    executor = runtime.group.lanes[0]
    release = executor.kv_cache.release
    calls = []

    def interrupted() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        release()

    executor.kv_cache.release = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        runtime.close()
    lane_failed = [
        e
        for e in events(lifecycle_log)
        if e["event"] == "cleanup.failed" and e["component"] == "model_executor"
    ]
    assert [e["step"] for e in lane_failed] == ["paged_kv_cache"]
    assert runtime.container.root_scope().orphans() == ["runtime/lane0/model_executor"]
    assert audit_now(lifecycle_log, tmp_path)[0] == 1

    runtime.close()
    assert executor.kv_cache.state is KVCacheState.RELEASED and len(calls) == 2
    assert audit_now(lifecycle_log, tmp_path)[0] == 0


def test_an_owned_object_that_never_closes_fails_the_audit(tmp_path: Path) -> None:
    log = tmp_path / "lost.jsonl"
    root = "0xroot"
    records = [
        {"event": "scope.entered", "component": "scope", "scope": "runtime", "root": root},
        *[
            {
                "event": "scope.owned",
                "component": "scope",
                "scope": "runtime",
                "object": name,
                "index": index,
                "root": root,
            }
            for index, name in enumerate(["device", "weights"])
        ],
        {
            "event": "cleanup.step",
            "component": "scope",
            "object_id": "runtime",
            "step": "runtime/weights",
            "index": 1,
            "root": root,
        },
        {"event": "scope.exited", "component": "scope", "scope": "runtime", "root": root},
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, out = audit_now(log, tmp_path)
    assert code == 1
    assert "[owned-not-closed]" in out and "runtime/device" in out


# -- 3. a recovered orphan is logged as recovered, whatever frees it ------------------------


def test_a_capture_rollback_whose_release_fails_audits_clean_once_everything_is_freed(
    lifecycle_log: Path, tmp_path: Path, build: Callable[..., Runtime]
) -> None:
    # The second capture fails; the rollback cannot release the first trace.
    device = FaultyDevice(TorchDevice("cpu"), fail={"capture_trace": 2, "release_trace": 1})
    runtime = build("tiny-llama", SMALL)
    runtime.container.device.device.override(providers.Object(device))
    with pytest.raises(InjectedFault, match="capture_trace"):
        runtime.ready()
    assert audit_now(lifecycle_log, tmp_path)[0] == 1  # an orphaned trace, for now

    runtime.ready()  # the retry releases the stuck trace, then captures everything again
    generate(runtime, 1)
    runtime.close()

    logged = events(lifecycle_log)
    orphaned = [e for e in logged if e["event"] == "resource.orphaned"]
    recovered = [e for e in logged if e["event"] == "resource.recovered"]
    assert orphaned and [e["path"] for e in recovered] == [e["path"] for e in orphaned]
    assert audit_now(lifecycle_log, tmp_path)[0] == 0


# -- 4. any number of runtimes in one log -------------------------------------------------


def test_two_runtimes_in_one_log_audit_clean_and_a_real_violation_still_fails(
    lifecycle_log: Path, tmp_path: Path, build: Callable[..., Runtime]
) -> None:
    one = build("tiny-llama", SMALL)
    two = build("tiny-llama", [*SMALL, "lanes=2"])
    one.ready()
    two.ready()
    generate(one, 1)
    generate(two, 2)
    one.close()
    generate(two, 2)
    two.close()
    code, out = audit_now(lifecycle_log, tmp_path)
    assert code == 0, out

    # The same log with one runtime's program compiled after its gate closed fails.
    logged = events(lifecycle_log)
    gate = next(e for e in logged if e["event"] == "compile_gate.closed")
    late = {**gate, "event": "program.compiled", "signature": "decode[late]", "key": "x"}
    at = logged.index(gate) + 1
    broken = tmp_path / "broken.jsonl"
    broken.write_text("".join(json.dumps(e) + "\n" for e in [*logged[:at], late, *logged[at:]]))
    code, out = audit_now(broken, tmp_path)
    assert code == 1
    assert out.count("[no-compile-after-activation]") == 1


# -- 5. start-up retried after a failure --------------------------------------------------


def test_startup_is_retryable_after_a_kv_allocation_failure(
    lifecycle_log: Path, tmp_path: Path, build: Callable[..., Runtime]
) -> None:
    # A clean probe run finds the call number of lane 1's first KV tensor.
    probe = FaultyDevice(TorchDevice("cpu"), fail={})
    clean = build("tiny-llama", [*SMALL, "lanes=2"])
    clean.container.device.device.override(providers.Object(probe))
    clean.container.startup().allocate_kv_cache()
    allocations = probe.calls_of("allocate")
    first_lane1 = next(n for n, c in enumerate(allocations, 1) if c.device_id.endswith("lane1"))
    clean.close()

    device = FaultyDevice(TorchDevice("cpu"), fail={"allocate": first_lane1})
    runtime = build("tiny-llama", [*SMALL, "lanes=2"])
    runtime.container.device.device.override(providers.Object(device))
    startup = runtime.container.startup()
    with pytest.raises(InjectedFault, match="allocate"):
        startup.run()
    lanes = runtime.container.lane_group().lanes
    assert lanes[0].kv_cache.is_bound and not lanes[1].kv_cache.is_bound
    assert startup.phase is StartupPhase.CONFIGURED
    startup.configure_kv_capacity(None)  # finished: a no-op
    startup.configure_kv_capacity(16)  # the same capacity: a no-op
    with pytest.raises(KVCacheStateError, match=r"already (configured|bound)"):
        startup.configure_kv_capacity(8)

    group = startup.run()
    assert startup.phase is StartupPhase.ACTIVE
    assert all(lane.kv_cache.is_bound for lane in group.lanes)
    generate(runtime, 2)
    runtime.close()
    assert audit_now(lifecycle_log, tmp_path)[0] == 0


def test_a_kv_manager_configured_twice_with_the_same_capacity_is_a_no_op(
    build: Callable[..., Runtime],
) -> None:
    runtime = build("tiny-llama", SMALL)
    kv = runtime.container.lane_group().lanes[0].kv_cache
    first = kv.configure(None)
    assert kv.configure(None) is first
    assert kv.configure(first) is first
    with pytest.raises(KVCacheStateError, match="already configured"):
        kv.configure(first.with_num_blocks(8))
    runtime.close()


# -- 6. one freeze for the whole container --------------------------------------------------


def test_the_override_context_manager_cannot_swap_a_built_device(
    lifecycle_log: Path, build: Callable[..., Runtime]
) -> None:
    runtime = build("tiny-llama", SMALL)
    container = runtime.container
    mine = FaultyDevice(TorchDevice("cpu"), fail={})
    with pytest.raises(ContainerStateError, match="built"):  # noqa: SIM117
        with container.device.device.override(providers.Object(mine)):
            runtime.ready()
    assert container.device.device() is mine  # still the one device, never a second
    runtime.close()
    logged = events(lifecycle_log)
    owned = [e for e in logged if e["event"] == "scope.owned" and e["object"] == "device"]
    assert len(owned) == 1
    assert [e["event"] for e in logged].count("device.closed") == 1


@pytest.mark.parametrize(
    "path",
    [
        "model.family",
        "barrier",
        "startup",
        "device.ttnn_module",
        "lane_container",
        "device.device",
        "model.weights",
        "root_scope",
        "lane_group",
        "recipe",
        "device",
    ],
)
def test_every_provider_is_frozen_once_the_container_is_built(
    build: Callable[..., Runtime], path: str
) -> None:
    runtime = build("tiny-llama", SMALL)
    container = runtime.container
    target: Any = container
    for part in path.split("."):
        target = getattr(target, part)
    container.lane_group()
    with pytest.raises(ContainerStateError, match=re.escape(path.split(".")[-1])):
        target.override(providers.Object(None))
    with pytest.raises(ContainerStateError):
        target.reset_override()
    with pytest.raises(ContainerStateError):
        target.reset_last_overriding()
    if isinstance(target, providers.Singleton):
        with pytest.raises(ContainerStateError):
            target.reset()
    runtime.close()


def test_lane_providers_are_frozen_with_the_container(build: Callable[..., Runtime]) -> None:
    runtime = build("tiny-llama", SMALL)
    lane = runtime.container.lane_containers()[0]
    runtime.ready()
    for name in ("model", "output_reader", "warmup_coordinator", "family", "barrier"):
        with pytest.raises(ContainerStateError, match=name):
            getattr(lane, name).override(providers.Object(None))
    with pytest.raises(ContainerStateError):
        runtime.container.reset_singletons()
    runtime.close()


def test_a_lane_container_override_after_lanes_were_declared_raises(
    build: Callable[..., Runtime],
) -> None:
    runtime = build("tiny-llama", SMALL)
    runtime.container.lane_containers()
    with pytest.raises(ContainerStateError, match="lane_containers"):
        runtime.container.lane_container.override(providers.Object(LaneContainer))
    runtime.ready()  # nothing vanished: the declared lanes are the ones built
    runtime.close()


def test_a_lane_provider_overridden_after_lanes_were_declared_applies(
    build: Callable[..., Runtime],
) -> None:
    runtime = build("tiny-llama", SMALL)
    lane = runtime.container.lane_containers()[0]
    lane.output_reader.override(
        providers.Singleton(RecordingReader, device=lane.device, lane=lane.lane)
    )
    runtime.ready()
    assert isinstance(runtime.group.lanes[0].output_reader, RecordingReader)
    runtime.close()


class RecordingReader(OutputReader):
    """An OutputReader subclass an outside author injects into one lane."""


# -- 7. Borrowed on a part the executor tears down -----------------------------------------


def test_borrowed_is_refused_on_a_part_the_lane_executor_tears_down(
    build: Callable[..., Runtime],
) -> None:
    runtime = build("tiny-llama", SMALL)
    lane = runtime.container.lane_containers()[0]
    mine = object()
    with pytest.raises(ContainerStateError, match=r"kv_cache_manager.*model_executor"):
        lane.kv_cache_manager.override(Borrowed(mine))
    with pytest.raises(ContainerStateError, match="model_executor cannot be Borrowed"):
        lane.model_executor.override(Borrowed(mine))
    lane.model.override(Borrowed(mine))  # a part nobody tears down may be the caller's
    runtime.close()


# -- 8. the smaller items -----------------------------------------------------------------


class LoudDevice(FaultyDevice):
    """A FaultyDevice subclass an outside author wrote."""


def test_faulty_device_subclasses_survive_on_lane_devices(build: Callable[..., Runtime]) -> None:
    device = LoudDevice(TorchDevice("cpu"), fail={})
    runtime = build("tiny-llama", [*SMALL, "lanes=2"])
    runtime.container.device.device.override(providers.Object(device))
    lanes = runtime.container.device.lane_devices()
    assert all(type(lane) is LoudDevice for lane in lanes)
    runtime.close()
    assert device.calls_of("close")


def test_entries_with_nothing_to_close_say_so(
    lifecycle_log: Path, build: Callable[..., Runtime]
) -> None:
    runtime = build("tiny-llama", SMALL)
    runtime.ready()
    runtime.close()
    actions = {e["step"]: e["action"] for e in scope_closes(lifecycle_log)}
    assert actions["runtime/model/weights"] == "nothing to close"
    assert actions["runtime/lane0/page_table_layout"] == "nothing to close"
    assert actions["runtime/device/device"] == "closed"
    assert actions["runtime/device/torch_threads"] == "nothing to close"  # num_threads unset
    closed = next(e for e in events(lifecycle_log) if e["event"] == "device.closed")
    opened = next(e for e in events(lifecycle_log) if e["event"] == "device.opened")
    if opened.get("freed_memory") == "retained":  # applied for the process: said at close too
        assert closed["freed_memory"].startswith("still retained")


def test_a_lane_is_created_in_the_spec_construction_order(build: Callable[..., Runtime]) -> None:
    runtime = build("tiny-llama", SMALL)
    runtime.container.lane_group()
    lane0 = [
        p.removeprefix("runtime/lane0/")
        for p in runtime.container.root_scope().creation_order()
        if p.startswith("runtime/lane0/")
    ]
    # The seed README's "Composition and construction" diagram, in order; the step
    # compiler (llmrt's, not in the diagram) comes right before its first user.
    spec = [
        "model",
        "kv_cache_manager",
        "page_table_layout",
        "output_reader",
        "prefill_runtime",
        "decode_runtime",
        "program_compiler",
        "eager_executor",
        "trace_compiler",
        "traced_executor",
        "warmup_coordinator",
        "model_executor",
    ]
    assert [name for name in lane0 if name != "step_compiler"] == spec
    assert lane0.index("step_compiler") == lane0.index("prefill_runtime") - 1
    runtime.close()


def test_closing_restores_the_torch_thread_count(build: Callable[..., Runtime]) -> None:
    before = torch.get_num_threads()
    runtime = build("tiny-llama", [*SMALL, f"device.num_threads={before + 1}"])
    runtime.container.lane_group()
    assert torch.get_num_threads() == before + 1
    runtime.close()
    assert torch.get_num_threads() == before


def test_the_plugin_reaches_lane_providers_and_reports_every_teardown_error() -> None:
    from llmrt.testing.plugin import _runtime_factory

    factory = _runtime_factory()
    make = next(factory)
    reader = RecordingReader(device=TorchDevice("cpu"), lane=0)
    first = make("tiny-llama", SMALL, providers={"lane_containers.0.output_reader": reader})
    assert first.lane_containers()[0].output_reader() is reader
    second = make("tiny-llama", SMALL)
    for container in (first, second):
        _fail_close(container.device.device())
    with pytest.raises(CleanupError) as info:
        next(factory, None)
    assert [step for step, _ in info.value.failures] == [
        "container 1: runtime/device/device",
        "container 0: runtime/device/device",
    ]
    for container in (first, second):
        close_runtime(container)  # the retry finishes both


def _fail_close(device: Any) -> None:
    """Make a TorchDevice's teardown (its synchronize) fail once."""
    synchronize = device.synchronize
    calls: list[int] = []

    def failing() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected: synchronize at close")
        synchronize()

    device.synchronize = failing


def test_the_audits_cleanup_order_is_the_seed_documents(request: pytest.FixtureRequest) -> None:
    # CI checks shared/ out beside the repository (../shared); a worktree may sit deeper.
    root = Path(request.config.rootpath).resolve()
    wanted = Path("shared") / "seed" / "llm_runtime_README.md"
    found = [d / wanted for d in (root, *root.parents) if (d / wanted).is_file()]
    if not found:
        pytest.skip(f"the seed document ({wanted}) is not beside {root} or any folder above it")
    seed = found[0]
    text = seed.read_text(encoding="utf-8")
    section = text.split("### 7. Cleanup and terminal state", 1)[1].split("\n#", 1)[0]
    items = re.findall(r"^\d+\. (.+?)[;.]?(?: and)?$", section, flags=re.MULTILINE)
    assert len(items) == len(CLEANUP_STEPS) == 8
    # Each of the audit's step names is the spec's item, in the spec's place.
    words = {
        "external_decode_leases": "external decode leases",
        "pending_output_reads": "pending output reads",
        "prefill_transients": "prefill transients",
        "decode_transients": "decode transients",
        "traces": "trace artifacts",
        "program_registry": "program registry",
        "device_sampling_buffers": "device sampling buffers",
        "paged_kv_cache": "paged KV cache",
    }
    for step, item in zip(CLEANUP_STEPS, items, strict=True):
        assert words[step] in item, (step, item)
