"""Teardown: exact reverse creation order across scopes, the eight-step lane order, faults.

Also the claim behind ``LifetimeScope``: dependency-injector's ``shutdown_resources()``
orders only direct Resource->Resource edges (a Singleton or a sub-container in between
loses the order), while a ``LifetimeScope`` gets the transitive order right.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dependency_injector import containers, providers
from structlog.testing import capture_logs

from llmrt.device.torch import TorchDevice
from llmrt.errors import CleanupError, KVCacheStateError
from llmrt.lane_group import LaneGroupLease
from llmrt.lifecycle import configure_logging
from llmrt.model_executor import CLEANUP_STEPS
from llmrt.paged_kv_cache import KVCacheState
from llmrt.sampling_params import SamplingParams
from llmrt.scope import LifetimeScope
from llmrt.testing import FaultyDevice, InjectedFault

GREEDY = SamplingParams(temperature=0.0)
Runtime = Any  # conftest's Runtime

PROMPTS = [[(3 * i) % 250 + 1 for i in range(20)], [(7 * i) % 250 + 1 for i in range(40)]]
SLOTS = [0, 5]  # one request per lane of tiny-llama with lanes=2


def _lifecycle(runtime: Runtime) -> LaneGroupLease:
    """Warm up, load the tokenizer late, generate, and leave an async decode read in flight."""
    runtime.ready()
    runtime.container.model.tokenizer()  # created after the lanes (lazily, like the LLM API)
    runtime.generate(PROMPTS, slots=SLOTS, steps=2)
    group = runtime.group
    blocks = runtime.blocks_for(PROMPTS, SLOTS, 3)
    tokens = torch.ones(6, dtype=torch.int64)
    positions = torch.zeros(6, dtype=torch.int32)
    table = torch.full((6, group.lanes[0].layout.width), -1, dtype=torch.int32)
    for prompt, slot, ids in zip(PROMPTS, SLOTS, blocks, strict=True):
        positions[slot] = len(prompt) + 2
        table[slot, : len(ids)] = torch.tensor(ids)
    lease = group.decode_forward(
        tokens=tokens,
        start_pos=positions,
        page_table=table,
        sampling_params=[GREEDY] * 6,
        read_from_device=False,
    )
    assert isinstance(lease, LaneGroupLease)
    group.read_decode_output(lease, async_read=True)  # never completed by the "scheduler"
    return lease


def _audit(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_full_lifecycle_tears_down_in_exact_reverse_creation_order(
    build: Callable[..., Runtime], tmp_path: Path
) -> None:
    audit = tmp_path / "audit.jsonl"
    configure_logging(level="warning", audit_path=audit, console=False)
    runtime = build("tiny-llama", ["lanes=2"])
    _lifecycle(runtime)
    root = runtime.container.root_scope()
    created = root.creation_order()

    runtime.close()

    events = _audit(audit)
    closed = [
        e["step"] for e in events if e["event"] == "cleanup.step" and e["component"] == "scope"
    ]
    assert closed == created[::-1]
    assert created[0] == "runtime/device/device" and closed[-1] == "runtime/device/device"
    # The tokenizer was loaded after the lanes: it goes first, not with the model scope.
    assert closed.index("runtime/model/tokenizer") < closed.index("runtime/lane1/model_executor")
    assert closed.index("runtime/lane1/model") < closed.index("runtime/lane0/model_executor")
    assert closed.index("runtime/lane0/model") < closed.index("runtime/model/weights")

    entered = [e["scope"] for e in events if e["event"] == "scope.entered"]
    exited = [e["scope"] for e in events if e["event"] == "scope.exited"]
    assert entered == [
        "runtime",
        "runtime/device",
        "runtime/model",
        "runtime/lane0",
        "runtime/lane1",
        "runtime/serving",
    ]
    assert exited == entered[::-1]

    # Each lane's model executor becomes terminal, then runs the spec's eight steps in
    # order, all inside its own scope step; lane 1 (created last) goes first.
    lane_events = [
        (e["lane"], e["event"], e.get("step"))
        for e in events
        if e["component"] == "model_executor" or e["event"] == "cleanup.step"
    ]
    for lane in (1, 0):
        start = lane_events.index((lane, "executor.terminal", None))
        steps = lane_events[start + 1 : start + 1 + len(CLEANUP_STEPS)]
        assert steps == [(lane, "cleanup.step", s) for s in CLEANUP_STEPS]
        after = lane_events[start + 1 + len(CLEANUP_STEPS)]
        assert after == (lane, "cleanup.step", f"runtime/lane{lane}/model_executor")
    assert [e["lane"] for e in events if e["event"] == "executor.terminal"] == [1, 0]
    released = [e for e in events if e["event"] == "kv.released"]
    assert [e["lane"] for e in released] == [1, 0] and all(e["orphans"] == 0 for e in released)
    assert not [e for e in events if e["event"] == "cleanup.failed"]


def _faulty_lifecycle(
    build: Callable[..., Runtime], fail: dict[str, int]
) -> tuple[Runtime, FaultyDevice]:
    faulty = FaultyDevice(TorchDevice("cpu"), fail=fail)
    runtime = build("tiny-llama", ["lanes=2"])
    runtime.container.device.device.override(providers.Object(faulty))
    _lifecycle(runtime)
    return runtime, faulty


def _teardown_plan(build: Callable[..., Runtime]) -> dict[str, int]:
    """Call numbers that hit lane 1's teardown: first sync, first trace, first KV tensor."""
    runtime, faulty = _faulty_lifecycle(build, {})
    syncs = len(faulty.calls_of("synchronize"))
    before = len(faulty.calls_of("deallocate"))
    kv = runtime.group.lanes[1].kv_cache.context
    kv_ids = {id(t) for t in (*kv.keys, *kv.values)}
    runtime.close()
    deallocations = faulty.calls_of("deallocate")
    first_kv = next(
        n for n, call in enumerate(deallocations, 1) if n > before and call.subject_id in kv_ids
    )
    assert faulty.calls_of("release_trace")[0].device_id.endswith("lane1")
    return {"synchronize": syncs + 1, "release_trace": 1, "deallocate": first_kv}


def _faults(error: BaseException) -> Iterator[BaseException]:
    yield error
    if isinstance(error, CleanupError):
        for _, inner in error.failures:
            yield from _faults(inner)


def test_failing_teardown_steps_do_not_stop_the_rest_and_all_are_reported(
    build: Callable[..., Runtime],
) -> None:
    runtime, faulty = _faulty_lifecycle(build, _teardown_plan(build))
    lanes = runtime.group.lanes
    devices = runtime.container.device.lane_devices()
    primary = RuntimeError("the scheduler crashed")

    with capture_logs() as events, pytest.raises(CleanupError) as info:
        runtime.close(primary=primary)

    error = info.value
    assert error.primary is primary
    assert "while handling RuntimeError: the scheduler crashed" in str(error)
    assert [step for step, _ in error.failures] == [
        "lane1/external_decode_leases",
        "lane1/traces",
        "lane1/paged_kv_cache",  # deferred: the trace whose release failed still uses the KV
        "runtime/lane1/kv_cache_manager",  # the scope's retry, after the trace was released
    ]
    deferred = error.failures[2][1]
    assert isinstance(deferred, KVCacheStateError)
    assert "deferred while a trace is still live" in str(deferred)
    injected = [e for e in _faults(error) if isinstance(e, InjectedFault)]
    assert sorted(e.op for e in injected) == ["release_trace", "synchronize"]
    kv_failure = error.failures[3][1]  # the KV tensor that failed to deallocate, kept as orphan
    assert isinstance(kv_failure, KVCacheStateError)
    assert "1 KV tensor(s) failed to deallocate" in str(kv_failure)
    assert "injected fault: deallocate" in str(kv_failure)

    # Every step of lane 1 ran despite the failures, and lane 0 tore down cleanly.
    lane1 = [(e["event"], e["step"]) for e in events if e.get("lane") == 1 and "step" in e]
    lane1_steps = [s for _, s in lane1 if s in CLEANUP_STEPS]
    assert lane1_steps == list(CLEANUP_STEPS)
    failed = {s for event, s in lane1 if event == "cleanup.failed" and s in CLEANUP_STEPS}
    assert failed == {"external_decode_leases", "traces", "paged_kv_cache"}
    assert not [e for e in events if e["event"] == "cleanup.failed" and e.get("lane") == 0]
    # The scope's own later steps released the trace and then tried the KV; the one KV
    # tensor whose deallocation failed is kept as an orphan, and a retry releases it.
    assert all(lane.kv_cache.state is KVCacheState.RELEASED for lane in lanes)
    assert len(lanes[1].kv_cache.orphans) == 1
    lanes[1].kv_cache.release()
    assert not lanes[1].kv_cache.orphans
    for device in devices:
        stats = device.stats()
        assert (stats.live_tensors, stats.live_traces, stats.pending_reads) == (0, 0, 0)

    calls = len(faulty.calls)
    runtime.close()  # idempotent: nothing runs, nothing raises
    runtime.close(primary=primary)
    assert len(faulty.calls) == calls


def test_close_is_idempotent_and_safe_before_anything_was_built(
    build: Callable[..., Runtime],
) -> None:
    untouched = build("tiny-gpt2")
    untouched.close()
    untouched.close()
    assert untouched.container.root_scope().closed

    runtime = build("tiny-gpt2")
    runtime.ready()
    with capture_logs() as events:
        runtime.close()
        runtime.close()
    assert [e["event"] for e in events].count(
        "scope.exited"
    ) == 5  # root, device, model, lane, serving
    assert runtime.group.lanes[0].terminal


# -- dependency-injector's own shutdown order ----------------------------------------------


def _resource(log: list[str], name: str) -> Callable[..., Iterator[str]]:
    def resource(*_dependencies: object) -> Iterator[str]:
        log.append(f"init {name}")
        yield name
        log.append(f"shutdown {name}")

    return resource


class _Holder:
    def __init__(self, dependency: object) -> None:
        self.dependency = dependency


def test_dependency_injector_orders_only_direct_resource_edges() -> None:
    """A depends on B through a Singleton (and through a sub-container): B shuts down first.

    ``shutdown_resources`` repeatedly shuts down every initialized resource that no other
    initialized resource lists in its *direct* ``related`` providers. ``Top -> A`` is direct,
    so A waits a round; ``A -> Singleton -> B`` is not, so B goes in the first round, while A
    (which uses B) is still alive. Without ``Top`` the two land in the same round and their
    order is the traversal set's iteration order, i.e. unspecified.
    """
    log: list[str] = []

    class Direct(containers.DeclarativeContainer):
        b = providers.Resource(_resource(log, "B"))
        a = providers.Resource(_resource(log, "A"), b)
        top = providers.Resource(_resource(log, "Top"), a)

    class ThroughSingleton(containers.DeclarativeContainer):
        b = providers.Resource(_resource(log, "B"))
        holder = providers.Singleton(_Holder, b)
        a = providers.Resource(_resource(log, "A"), holder)
        top = providers.Resource(_resource(log, "Top"), a)

    class Child(containers.DeclarativeContainer):
        b = providers.Dependency()
        a = providers.Resource(_resource(log, "A"), b)
        top = providers.Resource(_resource(log, "Top"), a)

    class ThroughSubContainer(containers.DeclarativeContainer):
        b = providers.Resource(_resource(log, "B"))
        child = providers.Container(Child, b=b)

    def shutdown_order(container: Any, top: Any) -> list[str]:
        log.clear()
        top()
        assert log == ["init B", "init A", "init Top"]
        log.clear()
        container.shutdown_resources()
        return log[:]

    direct = Direct()
    assert shutdown_order(direct, direct.top) == ["shutdown Top", "shutdown A", "shutdown B"]

    through = ThroughSingleton()
    assert ThroughSingleton.holder in list(ThroughSingleton.a.related)
    assert ThroughSingleton.b not in list(ThroughSingleton.a.related)  # only direct edges
    order = shutdown_order(through, through.top)
    assert order.index("shutdown B") < order.index("shutdown A")  # B died while A used it

    nested = ThroughSubContainer()
    order = shutdown_order(nested, nested.child.top)
    assert order.index("shutdown B") < order.index("shutdown A")

    # The same graph recorded in a LifetimeScope as it is built closes A before B.
    scope_log: list[str] = []
    scope = LifetimeScope("di")

    def owned(name: str, *deps: object) -> str:
        return scope.own(name, name, lambda: scope_log.append(f"shutdown {name}"))

    class Scoped(containers.DeclarativeContainer):
        b = providers.Singleton(owned, "B")
        holder = providers.Singleton(_Holder, b)
        a = providers.Singleton(owned, "A", holder)
        top = providers.Singleton(owned, "Top", a)

    Scoped().top()
    scope.close()
    assert scope_log == ["shutdown Top", "shutdown A", "shutdown B"]
