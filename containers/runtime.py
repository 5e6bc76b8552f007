"""The dependency-injection containers that wire llmrt from a recipe.

Scopes, outermost first: **device** (device/mesh and lane sub-devices), **model**
(weights, tokenizer, family), one **lane** sub-container per data-parallel lane
(step compiler, KV manager, page-table layout, OutputReader, prefill/decode runtimes, program
compiler, eager executor, optional trace compiler and traced executor, warmup
coordinator, model executor — in the spec's construction order) and
**serving** (the lane group). Every provider records what it builds in its
:class:`~llmrt.scope.LifetimeScope`, so :func:`close_runtime` (the root scope's
``close``) tears down in exact reverse creation order across scopes. A declarative
container instance is a ``DynamicContainer``, so teardown is a function, not a method.

Integration tests override providers the dependency-injector way, e.g.
``container.device.device.override(providers.Object(FaultyDevice(...)))``.
"""

from __future__ import annotations

from collections.abc import Callable

from dependency_injector import containers, providers

from llmrt.compiled_step import StepCompiler
from llmrt.decode import DecodeRuntime
from llmrt.device.base import Device
from llmrt.execution import EagerExecutor, TracedExecutor
from llmrt.families.base import CausalLM, Family
from llmrt.lane_group import LaneGroupExecutor
from llmrt.model_executor import ModelExecutor
from llmrt.output_reader import OutputReader
from llmrt.paged_kv_cache import PagedKVCacheManager
from llmrt.prefill.runtime import PrefillRuntime
from llmrt.program_compiler import ProgramCompiler
from llmrt.recipe import Recipe
from llmrt.scope import LifetimeScope
from llmrt.startup import StartupSequence
from llmrt.trace_compiler import TraceCompiler
from llmrt.warmup import CaptureBarrier, WarmupCoordinator
from llmrt.weights.checkpoint import Checkpoint
from llmrt.weights.tokenizer import Tokenizer

from . import factories as f


def _child(parent: LifetimeScope, name: str, lane: int | None = None) -> LifetimeScope:
    return parent.child(name, lane=lane)


class DeviceContainer(containers.DeclarativeContainer):
    """Device scope: opens the device or mesh and splits it into lane sub-devices."""

    recipe = providers.Dependency(instance_of=Recipe)
    parent_scope = providers.Dependency(instance_of=LifetimeScope)
    scope: providers.Singleton[LifetimeScope] = providers.Singleton(_child, parent_scope, "device")
    device: providers.Singleton[Device] = providers.Singleton(
        f.open_device, recipe=recipe, scope=scope
    )
    lane_devices: providers.Singleton[tuple[Device, ...]] = providers.Singleton(
        f.split_lanes, device=device, lanes=recipe.provided.lanes, scope=scope
    )


class ModelContainer(containers.DeclarativeContainer):
    """Model scope: weights, tokenizer and family, borrowed by every lane."""

    recipe = providers.Dependency(instance_of=Recipe)
    parent_scope = providers.Dependency(instance_of=LifetimeScope)
    scope: providers.Singleton[LifetimeScope] = providers.Singleton(_child, parent_scope, "model")
    weights: providers.Singleton[Checkpoint] = providers.Singleton(
        f.load_weights, recipe=recipe, scope=scope
    )
    family: providers.Singleton[Family] = providers.Singleton(
        f.resolve_family, recipe=recipe, checkpoint=weights
    )
    tokenizer: providers.Singleton[Tokenizer] = providers.Singleton(
        f.load_tokenizer, recipe=recipe, checkpoint=weights, scope=scope
    )


class LaneContainer(containers.DeclarativeContainer):
    """One data-parallel lane, built in the spec's construction order."""

    recipe = providers.Dependency(instance_of=Recipe)
    parent_scope = providers.Dependency(instance_of=LifetimeScope)
    lane = providers.Dependency(instance_of=int)
    device: providers.Dependency[Device] = providers.Dependency()
    lane_devices: providers.Dependency[tuple[Device, ...]] = providers.Dependency()
    weights = providers.Dependency(instance_of=Checkpoint)
    family: providers.Dependency[Family] = providers.Dependency()
    barrier = providers.Dependency(instance_of=CaptureBarrier)

    scope: providers.Singleton[LifetimeScope] = providers.Singleton(
        lambda parent, lane: parent.child(f"lane{lane}", lane=lane), parent_scope, lane
    )
    model: providers.Singleton[CausalLM] = providers.Singleton(
        f.build_model, recipe=recipe, checkpoint=weights, family=family, device=device, scope=scope
    )
    step_compiler: providers.Singleton[StepCompiler] = providers.Singleton(
        f.build_step_compiler, recipe=recipe, lane=lane, scope=scope
    )
    kv_cache_manager: providers.Singleton[PagedKVCacheManager] = providers.Singleton(
        f.build_kv_manager, recipe=recipe, model=model, device=device, lane=lane, scope=scope
    )
    page_table_layout = providers.Singleton(
        f.build_layout, recipe=recipe, model=model, kv=kv_cache_manager, scope=scope
    )
    output_reader: providers.Singleton[OutputReader] = providers.Singleton(
        f.build_output_reader, device=device, lane=lane, scope=scope
    )
    prefill_runtime: providers.Singleton[PrefillRuntime] = providers.Singleton(
        f.build_prefill,
        recipe=recipe,
        model=model,
        device=device,
        reader=output_reader,
        layout=page_table_layout,
        lane=lane,
        scope=scope,
        steps=step_compiler,
    )
    decode_runtime: providers.Singleton[DecodeRuntime] = providers.Singleton(
        f.build_decode,
        recipe=recipe,
        model=model,
        device=device,
        reader=output_reader,
        layout=page_table_layout,
        lane=lane,
        scope=scope,
        steps=step_compiler,
    )
    program_compiler: providers.Singleton[ProgramCompiler] = providers.Singleton(
        f.build_program_compiler,
        recipe=recipe,
        device=device,
        kv=kv_cache_manager,
        lane=lane,
        scope=scope,
        steps=step_compiler,
    )
    eager_executor: providers.Singleton[EagerExecutor] = providers.Singleton(
        f.build_eager,
        prefill=prefill_runtime,
        decode=decode_runtime,
        compiler=program_compiler,
        scope=scope,
    )
    trace_compiler: providers.Singleton[TraceCompiler | None] = providers.Singleton(
        f.build_trace_compiler,
        recipe=recipe,
        compiler=program_compiler,
        device=device,
        lane=lane,
        scope=scope,
    )
    traced_executor: providers.Singleton[TracedExecutor | None] = providers.Singleton(
        f.build_traced, recipe=recipe, eager=eager_executor, traces=trace_compiler, scope=scope
    )
    warmup_coordinator: providers.Singleton[WarmupCoordinator] = providers.Singleton(
        f.build_warmup,
        recipe=recipe,
        eager=eager_executor,
        traced=traced_executor,
        barrier=barrier,
        lane=lane,
        scope=scope,
    )
    model_executor: providers.Singleton[ModelExecutor] = providers.Singleton(
        f.build_model_executor,
        kv=kv_cache_manager,
        reader=output_reader,
        eager=eager_executor,
        traced=traced_executor,
        warmup=warmup_coordinator,
        lane=lane,
        scope=scope,
    )
    identity_check = providers.Callable(
        f.check_lane_identity, devices=lane_devices, executor=model_executor, device=device
    )


def build_lanes(
    *,
    recipe: Recipe,
    scope: LifetimeScope,
    lane_devices: tuple[Device, ...],
    weights: Checkpoint,
    family: Family,
    barrier: CaptureBarrier,
    lane_container: Callable[..., LaneContainer],
) -> tuple[LaneContainer, ...]:
    """One lane sub-container per data-parallel lane, each built and identity-checked now.

    ``lane_container`` is called with the lane's dependencies: the ``LaneContainer`` class,
    a subclass, or a factory that overrides some of the lane's providers (tests).
    """
    lanes = []
    for index, device in enumerate(lane_devices):
        lane = lane_container(
            recipe=recipe,
            parent_scope=scope,
            lane=index,
            device=device,
            lane_devices=lane_devices,
            weights=weights,
            family=family,
            barrier=barrier,
        )
        lane.model_executor()
        lane.identity_check()
        lanes.append(lane)
    return tuple(lanes)


def build_lane_group(
    *, lanes: tuple[LaneContainer, ...], barrier: CaptureBarrier, scope: LifetimeScope
) -> LaneGroupExecutor:
    group = LaneGroupExecutor(lanes=[lane.model_executor() for lane in lanes], barrier=barrier)
    return scope.own("lane_group", group)


class RuntimeContainer(containers.DeclarativeContainer):
    """The root: a recipe in, a lane group out; :func:`close_runtime` tears it all down."""

    recipe = providers.Dependency(instance_of=Recipe)
    root_scope: providers.Singleton[LifetimeScope] = providers.Singleton(LifetimeScope, "runtime")

    device = providers.Container(DeviceContainer, recipe=recipe, parent_scope=root_scope)
    model = providers.Container(ModelContainer, recipe=recipe, parent_scope=root_scope)

    barrier: providers.Singleton[CaptureBarrier] = providers.Singleton(
        CaptureBarrier, lanes=recipe.provided.lanes
    )
    lane_container = providers.Object(LaneContainer)
    lanes: providers.Singleton[tuple[LaneContainer, ...]] = providers.Singleton(
        build_lanes,
        recipe=recipe,
        scope=root_scope,
        lane_devices=device.lane_devices,
        weights=model.weights,
        family=model.family,
        barrier=barrier,
        lane_container=lane_container,
    )
    serving_scope: providers.Singleton[LifetimeScope] = providers.Singleton(
        _child, root_scope, "serving"
    )
    lane_group: providers.Singleton[LaneGroupExecutor] = providers.Singleton(
        build_lane_group, lanes=lanes, barrier=barrier, scope=serving_scope
    )
    #: The one startup sequence (configure, allocate, warm decode, warm prefill, activate).
    startup: providers.Singleton[StartupSequence] = providers.Singleton(
        StartupSequence, group=lane_group
    )


def start_runtime(
    container: RuntimeContainer, *, num_blocks: int | None = None
) -> LaneGroupExecutor:
    """Build (if needed) and start ``container``'s runtime; returns the serving-ready lane group.

    The one startup sequence every front end uses: ``container.startup().run(num_blocks=...)``
    (see :class:`llmrt.startup.StartupSequence` for the phases and their order). The caller
    still owns the container: on failure, close it with ``close_runtime(container, primary=exc)``.
    """
    return container.startup().run(num_blocks=num_blocks)


def close_runtime(container: RuntimeContainer, *, primary: BaseException | None = None) -> None:
    """Tear down everything ``container`` built, in exact reverse creation order; idempotent.

    Raises ``CleanupError`` listing every failed step, with ``primary`` (the error that
    started the teardown, if any) preserved.
    """
    container.root_scope().close(primary=primary)
