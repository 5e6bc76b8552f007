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
from llmrt.containers import Owned
from structlog.testing import capture_logs

from llmrt.errors import CleanupError, KVCacheStateError
from llmrt.lifecycle.audit import check
from llmrt.lifecycle.events import configure_logging
from llmrt.lifecycle.scope import LifetimeScope
from llmrt.runtime.lane_group import LaneGroupLease
from llmrt.runtime.paged_kv_cache import KVCacheState
from llmrt.sampling.params import SamplingParams
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


#: The spec's "Cleanup and terminal state" order (seed README, Lifecycle section 7), written
#: out here independently of the product's constant: 1. outstanding external decode leases;
#: 2. pending output reads; 3. prefill transients; 4. decode transients; 5. trace artifacts
#: and persistent inputs; 6. the program registry; 7. device sampling buffers; 8. the
#: model-bound paged KV cache.
SPEC_LANE_CLEANUP = [
    "external_decode_leases",
    "pending_output_reads",
    "prefill_transients",
    "decode_transients",
    "traces",
    "program_registry",
    "device_sampling_buffers",
    "paged_kv_cache",
]

#: Lane components the model executor tears down as its steps (their scope entries are no-ops).
GOVERNED = (
    "kv_cache_manager",
    "output_reader",
    "prefill_runtime",
    "decode_runtime",
    "program_compiler",
    "trace_compiler",
)


def test_a_full_lifecycle_tears_down_in_exact_reverse_creation_order(
    lifecycle_log: Path, build: Callable[..., Runtime]
) -> None:
    audit = lifecycle_log  # the plugin's log: audited again at teardown
    runtime = build("tiny-llama", ["lanes=2"])
    _lifecycle(runtime)
    root = runtime.container.root_scope()
    created = root.creation_order()

    runtime.close()

    events = _audit(audit)
    scope_steps = [e for e in events if e["event"] == "cleanup.step" and e["component"] == "scope"]
    closed = [e["step"] for e in scope_steps]
    assert closed == created[::-1]
    assert created[0] == "runtime/device/device" and closed[-1] == "runtime/device/device"
    # The tokenizer was loaded after the lanes: it goes first, not with the model scope.
    assert closed.index("runtime/model/tokenizer") < closed.index("runtime/lane1/model_executor")
    assert closed.index("runtime/lane1/model") < closed.index("runtime/lane0/model_executor")
    assert closed.index("runtime/lane0/model") < closed.index("runtime/model/weights")
    # Each owned object was logged with its creation index; closes run in reverse of it.
    owned = {
        f"{e['scope']}/{e['object']}": e["index"] for e in events if e["event"] == "scope.owned"
    }
    assert [owned[step] for step in closed] == sorted(owned.values(), reverse=True)
    actions = {e["step"]: e["action"] for e in scope_steps}
    for lane in (0, 1):
        for name in GOVERNED:
            assert actions[f"runtime/lane{lane}/{name}"] == "cleaned by model_executor"
    assert actions["runtime/device/device"] == "closed"
    assert [e["event"] for e in events if e["event"].startswith("device.")] == [
        "device.opened",
        "device.opened",
        "device.opened",
        "device.closed",
    ]

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

    # Each lane's model executor becomes terminal, then runs the spec's eight steps once, in
    # the spec's order, inside its own scope step; lane 1 (created last) goes first.
    for lane in (1, 0):
        mine = [e for e in events if e.get("lane") == lane]
        start = next(i for i, e in enumerate(mine) if e["event"] == "executor.terminal")
        end = next(
            i
            for i, e in enumerate(mine)
            if e["event"] == "cleanup.step" and e["step"] == f"runtime/lane{lane}/model_executor"
        )
        steps = [
            e["step"]
            for e in mine[start:end]
            if e["component"] == "model_executor" and e["event"] == "cleanup.step"
        ]
        assert steps == SPEC_LANE_CLEANUP
        assert mine[start + 1]["event"] == "cleanup.started"
        assert mine[end - 1]["event"] == "cleanup.completed"
        assert [e["event"] for e in mine[start:end]].count("kv.released") == 1
    assert [e["lane"] for e in events if e["event"] == "executor.terminal"] == [1, 0]
    released = [e for e in events if e["event"] == "kv.released"]
    assert [e["lane"] for e in released] == [1, 0] and all(e["orphans"] == 0 for e in released)
    assert not [e for e in events if e["event"] == "cleanup.failed"]
    assert check(enumerate(events, start=1)) == []


def _faulty_lifecycle(
    build: Callable[..., Runtime], faulty_device: Callable[..., FaultyDevice], fail: dict[str, int]
) -> tuple[Runtime, FaultyDevice]:
    faulty = faulty_device(fail=fail)
    runtime = build("tiny-llama", ["lanes=2"])
    runtime.container.device.device.override(providers.Object(faulty))
    _lifecycle(runtime)
    return runtime, faulty


def _teardown_plan(
    build: Callable[..., Runtime], faulty_device: Callable[..., FaultyDevice]
) -> dict[str, int]:
    """Call numbers that hit lane 1's teardown: first sync, first trace, first KV tensor."""
    runtime, faulty = _faulty_lifecycle(build, faulty_device, {})
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


def test_failing_teardown_steps_keep_the_kv_guard_and_a_retry_frees_the_orphans(
    build: Callable[..., Runtime], faulty_device: Callable[..., FaultyDevice], tmp_path: Path
) -> None:
    plan = _teardown_plan(build, faulty_device)
    audit = tmp_path / "audit.jsonl"
    configure_logging(level="critical", audit_path=audit, console=False)
    runtime, faulty = _faulty_lifecycle(build, faulty_device, plan)
    lanes = runtime.group.lanes
    devices = runtime.container.device.lane_devices()
    primary = RuntimeError("the scheduler crashed")
    kv1 = lanes[1].kv_cache.context
    kv1_ids = {id(t) for t in (*kv1.keys, *kv1.values)}

    with pytest.raises(CleanupError) as info:
        runtime.close(primary=primary)

    error = info.value
    assert error.primary is primary
    assert "while handling RuntimeError: the scheduler crashed" in str(error)
    assert [step for step, _ in error.failures] == [
        "lane1/external_decode_leases",
        "lane1/traces",
        "lane1/paged_kv_cache",  # deferred: the trace whose release failed still uses the KV
    ]
    deferred = error.failures[2][1]
    assert isinstance(deferred, KVCacheStateError)
    assert "deferred while a trace is still live" in str(deferred)
    injected = [e for e in _faults(error) if isinstance(e, InjectedFault)]
    assert sorted(e.op for e in injected) == ["release_trace", "synchronize"]
    # The scope never freed the deferred KV behind the executor's back: lane 1's KV is
    # still allocated (an orphan of the executor), and nothing created before lane 1's failed
    # step was closed: lane 0 keeps its KV until the retry gets past lane 1.
    assert lanes[1].kv_cache.state is KVCacheState.BOUND
    assert lanes[0].kv_cache.state is KVCacheState.BOUND and not lanes[0].terminal
    assert not [c for c in faulty.calls_of("deallocate") if c.subject_id in kv1_ids]
    assert runtime.container.root_scope().orphans() == ["runtime/lane1/model_executor"]
    events = _audit(audit)
    orphaned = [e for e in events if e["event"] == "resource.orphaned"]
    assert (1, "lane1/paged_kv_cache") in [(e["lane"], e.get("path")) for e in orphaned]
    violations = {v.rule for v in check(enumerate(events, start=1))}
    assert {"cleanup-failed", "orphan", "lane-cleanup-missing", "kv-once"} <= violations

    # Retrying (the planned faults are spent) frees the trace, then the deferred KV, and any
    # tensor whose deallocation failed; nothing is freed twice.
    for _ in range(3):
        try:
            runtime.close()
            break
        except CleanupError as retry:
            assert all(step.startswith("lane1/") for step, _ in retry.failures)
    else:
        pytest.fail("teardown never completed")
    assert runtime.container.root_scope().orphans() == []
    for tensor_id in kv1_ids:
        done = [c for c in faulty.calls_of("deallocate") if c.subject_id == tensor_id]
        assert len([c for c in done if not c.injected]) == 1, "freed exactly once"
    for device in devices:
        stats = device.stats()
        assert (stats.live_tensors, stats.live_traces, stats.pending_reads) == (0, 0, 0)
    # Lane 1 attempted its eight steps in the spec's order and completed each exactly once
    # (the failed ones by a retry).
    events = _audit(audit)
    lane1 = [e for e in events if e.get("lane") == 1 and e["component"] == "model_executor"]
    attempts: list[str] = []
    for e in lane1:
        if e["event"] in ("cleanup.step", "cleanup.failed") and e["step"] not in attempts:
            attempts.append(e["step"])
    assert attempts == SPEC_LANE_CLEANUP
    done = [e["step"] for e in lane1 if e["event"] == "cleanup.step"]
    assert sorted(done) == sorted(SPEC_LANE_CLEANUP)
    assert check(enumerate(events, start=1)) == []

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

    # The same graph declared with Owned providers (ownership in the container, as
    # llmrt's containers declare it) closes A before B.
    scope_log: list[str] = []

    def closing(name: str) -> Callable[[object], Callable[[], None]]:
        return lambda _obj: lambda: scope_log.append(f"shutdown {name}")

    class Scoped(containers.DeclarativeContainer):
        scope = providers.Singleton(LifetimeScope, "di")
        b = Owned(str, "B").owned_by(scope, "B", close=closing("B"))
        holder = providers.Singleton(_Holder, b)
        a = Owned(_Holder, holder).owned_by(scope, "A", close=closing("A"))
        top = Owned(_Holder, a).owned_by(scope, "Top", close=closing("Top"))

    scoped = Scoped()
    scoped.top()
    scoped.scope().close()
    assert scope_log == ["shutdown Top", "shutdown A", "shutdown B"]
