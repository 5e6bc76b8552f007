"""Overrides the dependency-injector way: the injected object is owned (or declared borrowed),
appears in the teardown order, and overriding after build is an error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from dependency_injector import providers
from llmrt.containers import Borrowed, LaneContainer, factories
from structlog.testing import capture_logs

from llmrt.device.torch import TorchDevice
from llmrt.errors import ContainerStateError
from llmrt.families.registry import get_family
from llmrt.runtime.paged_kv_cache import KVCacheState, PagedKVCacheManager
from llmrt.testing import FaultyDevice

Runtime = Any  # conftest's Runtime

SMALL = ["kv_cache.num_blocks=16", "warmup.prefill_seq_lens=[32]", "warmup.prefill_batch_sizes=[1]"]


def _teardown(runtime: Runtime) -> list[dict[str, Any]]:
    with capture_logs() as events:
        runtime.close()
    return events


def _scope_steps(events: list[dict[str, Any]]) -> dict[str, str]:
    return {
        e["step"]: e["action"]
        for e in events
        if e["event"] == "cleanup.step" and e["component"] == "scope"
    }


def test_an_overriding_device_is_owned_synchronized_and_closed(
    build: Callable[..., Runtime], faulty_device: Callable[..., FaultyDevice]
) -> None:
    faulty = faulty_device()
    runtime = build("tiny-llama", SMALL)
    runtime.container.device.device.override(providers.Object(faulty))
    runtime.ready()
    assert "runtime/device/device" in runtime.container.root_scope().creation_order()
    syncs = len(faulty.calls_of("synchronize"))

    events = _teardown(runtime)

    assert _scope_steps(events)["runtime/device/device"] == "closed"
    assert [e["device"] for e in events if e["event"] == "device.closed"] == [faulty.id]
    # The device's own close synchronized and closed it, after every lane had torn down.
    assert len(faulty.calls_of("synchronize")) > syncs
    assert [c.op for c in faulty.calls[-2:]] == ["synchronize", "close"]


def test_a_borrowed_device_is_recorded_and_visibly_left_alone(
    build: Callable[..., Runtime], faulty_device: Callable[..., FaultyDevice]
) -> None:
    mine = faulty_device()
    runtime = build("tiny-llama", SMALL)
    runtime.container.device.device.override(Borrowed(mine))
    with capture_logs() as built:
        runtime.ready()
    owned = [e for e in built if e["event"] == "scope.owned" and e["object"] == "device"]
    assert [(e["scope"], e["borrowed"]) for e in owned] == [("runtime/device", True)]

    def own_syncs() -> int:
        return len([c for c in mine.calls_of("synchronize") if c.device_id == mine.id])

    before = own_syncs()
    events = _teardown(runtime)

    assert _scope_steps(events)["runtime/device/device"] == "borrowed: left alone"
    assert not [e for e in events if e["event"] == "device.closed"]
    assert own_syncs() == before  # the caller's device itself was neither synced nor closed


class RecordingKV(PagedKVCacheManager):
    """A KV manager that counts its releases (an override a test injects into one lane)."""

    releases = 0

    def release(self) -> None:
        type(self).releases += 1
        super().release()


def test_a_lane_provider_overridden_from_the_root_is_owned_and_governed(
    build: Callable[..., Runtime],
) -> None:
    runtime = build("tiny-llama", ["lanes=2", *SMALL])
    lanes = runtime.container.lane_containers()  # declared, nothing built yet
    assert runtime.container.root_scope().creation_order() == []
    second: LaneContainer = lanes[1]
    second.kv_cache_manager.override(
        providers.Singleton(
            lambda **kw: RecordingKV(
                model=kw["model"],
                device=kw["device"],
                config=kw["recipe"].kv_cache.with_num_blocks(16),
                lane=kw["lane"],
            ),
            model=second.model,
            device=second.device,
            recipe=second.recipe,
            lane=second.lane,
        )
    )
    runtime.ready()
    group = runtime.group
    assert isinstance(group.lanes[1].kv_cache, RecordingKV)
    assert not isinstance(group.lanes[0].kv_cache, RecordingKV)
    created = runtime.container.root_scope().creation_order()
    assert created.index("runtime/lane1/kv_cache_manager") < created.index(
        "runtime/lane1/model_executor"
    )
    RecordingKV.releases = 0

    events = _teardown(runtime)

    # Released once, by the lane's executor (its scope entry is a governed no-op).
    assert RecordingKV.releases == 1
    assert group.lanes[1].kv_cache.state is KVCacheState.RELEASED
    assert _scope_steps(events)["runtime/lane1/kv_cache_manager"] == "cleaned by model_executor"


def test_the_family_provider_is_the_only_source_of_the_family(
    build: Callable[..., Runtime],
) -> None:
    llama = get_family("llama")
    asked: list[str] = []

    class Spy:
        """The llama family, recording what weight loading and model building ask of it."""

        def __getattr__(self, name: str) -> Any:
            asked.append(name)
            return getattr(llama, name)

    runtime = build("tiny-llama", SMALL)
    runtime.container.model.family.override(providers.Object(Spy()))
    runtime.ready()
    assert {"expected_tensors", "optional_tensors", "model_types", "build"} <= set(asked)
    runtime.close()


def test_overriding_after_build_is_an_error_not_a_silent_no_op(
    build: Callable[..., Runtime],
) -> None:
    runtime = build("tiny-llama", SMALL)
    runtime.container.lane_group()
    with pytest.raises(ContainerStateError, match="device was already built"):
        runtime.container.device.device.override(providers.Object(TorchDevice("cpu")))
    lane = runtime.container.lane_containers()[0]
    with pytest.raises(ContainerStateError, match="kv_cache_manager was already built"):
        lane.kv_cache_manager.override(providers.Object(None))
    runtime.close()


def test_a_provider_building_anew_per_call_cannot_stand_in_for_an_owned_one(
    build: Callable[..., Runtime],
) -> None:
    """A Factory (or Callable) override of a one-per-container object would open another
    device, KV pool, ... at every call, each owned, the lanes built from one of them."""
    runtime = build("tiny-llama", SMALL)
    recipe = runtime.container.recipe()
    opened: list[Any] = []

    def open_device() -> Any:
        opened.append(factories.open_device(recipe=recipe))
        return opened[-1]

    for kind in (providers.Factory, providers.Callable):
        with pytest.raises(ContainerStateError, match="device is one object per container"):
            runtime.container.device.device.override(kind(open_device))
    assert opened == []
    runtime.container.device.device.override(providers.Singleton(open_device))
    runtime.container.lane_group()
    assert runtime.container.device.device() is runtime.container.device.device()
    assert len(opened) == 1
    runtime.close()


def test_the_recipe_is_spent_once_the_lanes_are_declared(build: Callable[..., Runtime]) -> None:
    runtime = build("tiny-llama", SMALL)
    runtime.container.lane_containers()
    with pytest.raises(ContainerStateError, match="recipe is spent"):
        runtime.container.recipe.override(providers.Object(runtime.container.recipe()))
    runtime.close()


def test_a_lane_container_that_replaces_an_owned_provider_is_refused(
    build: Callable[..., Runtime],
) -> None:
    class Unowned(LaneContainer):
        output_reader = providers.Singleton(
            factories.build_output_reader, device=LaneContainer.device, lane=LaneContainer.lane
        )

    runtime = build("tiny-llama", SMALL)
    runtime.container.lane_container.override(providers.Object(Unowned))
    with pytest.raises(ContainerStateError, match="output_reader is not an Owned provider"):
        runtime.container.lane_group()
    runtime.close()
