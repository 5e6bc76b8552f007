"""The dependency-injection containers that wire llmrt from a recipe.

Scopes, outermost first: **device** (device/mesh, torch threads, lane sub-devices),
**model** (family, weights, tokenizer), one **lane** sub-container per data-parallel lane
(model, KV manager, page-table layout, OutputReader, step compiler, prefill/decode runtimes,
program compiler, eager executor, optional trace compiler and traced executor, warmup
coordinator, model executor — built in ``LANE_CONSTRUCTION_ORDER``, the spec's construction
order, declared once) and **serving** (the lane group and the startup sequence).

Ownership is declared here, not in the factories: every provider whose object has a
lifetime is an :class:`~containers.ownership.Owned` provider, so whatever it yields — built by
its factory or injected by an override — is recorded in its scope's
:class:`~llmrt.lifecycle.scope.LifetimeScope` as it is created, and :func:`close_runtime` (the root
scope's ``close``) tears everything down in exact reverse creation order across scopes. The
lane components the model executor cleans up in the spec's eight steps are governed by it:
their own scope entries become no-ops once the executor exists.

Overriding, the dependency-injector way, before the runtime is built:

- a root-level provider: ``container.device.device.override(providers.Object(FaultyDevice(...)))``
  (owned: synchronized and closed at teardown), or ``...override(Borrowed(device))`` for a
  device the caller owns (left alone, visibly);
- the ttnn module a ttnn recipe opens its mesh with:
  ``container.device.ttnn_module.override(providers.Object(FakeTtnn()))``;
- the family: ``container.model.family.override(providers.Object(family))`` (weights are
  loaded and validated for it; nothing else looks the family up);
- one lane's provider: ``container.lane_containers()[i].kv_cache_manager.override(...)``
  (``lane_containers()`` declares every lane sub-container without building anything);
- every lane at once: ``container.lane_container.override(providers.Object(factory))`` where
  ``factory(**dependencies)`` returns a ``LaneContainer`` (it may override its providers).

``Borrowed`` is refused on the lane parts the model executor tears down. Once the container is
built (its root scope opens) every provider is frozen (``containers/freeze.py``): overriding,
resetting or leaving an override block raises ``ContainerStateError``; so does overriding
``lane_container`` after ``lane_containers()`` declared the lanes. A declarative container
instance is a ``DynamicContainer``, so teardown is a function, not a method.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from dependency_injector import containers, providers

from llmrt.device.base import Device
from llmrt.errors import ContainerStateError
from llmrt.families.base import Family
from llmrt.lifecycle.scope import LifetimeScope
from llmrt.recipe.loader import Recipe
from llmrt.runtime.lane_group import LaneGroupExecutor
from llmrt.runtime.startup import StartupSequence
from llmrt.runtime.trace_compiler import TraceCompiler
from llmrt.runtime.warmup import CaptureBarrier
from llmrt.weights.checkpoint import Checkpoint

from . import factories as f
from . import freeze as fz
from .ownership import Borrowed, Owned, govern


def _child(parent: LifetimeScope, name: str, lane: int | None = None) -> LifetimeScope:
    return parent.child(name, lane=lane)


class DeviceContainer(containers.DeclarativeContainer):
    """Device scope: opens the device or mesh and splits it into lane sub-devices."""

    recipe = fz.Dependency(instance_of=Recipe)
    parent_scope = fz.Dependency(instance_of=LifetimeScope)
    scope: providers.Singleton[LifetimeScope] = fz.Singleton(_child, parent_scope, "device")
    # The ttnn module (None on torch): tests override it with llmrt.testing.fake_ttnn.FakeTtnn.
    ttnn_module = fz.Singleton(f.load_ttnn, recipe=recipe)
    device: Owned = Owned(f.open_device, recipe=recipe, ttnn_module=ttnn_module).owned_by(
        scope, "device", close=f.close_device
    )
    #: ``device.num_threads`` for torch, set after the device opens (ROOT_CONSTRUCTION_ORDER)
    #: and restored when the runtime closes, after the lanes and before the device.
    torch_threads: Owned = Owned(f.set_torch_threads, recipe=recipe).owned_by(
        scope, "torch_threads", close=f.restore_torch_threads
    )
    lane_devices: Owned = Owned(f.split_lanes, device=device, lanes=recipe.provided.lanes).owned_by(
        scope, "lane_devices"
    )


class ModelContainer(containers.DeclarativeContainer):
    """Model scope: the family, the weights loaded for it, and the tokenizer; lanes borrow them."""

    recipe = fz.Dependency(instance_of=Recipe)
    parent_scope = fz.Dependency(instance_of=LifetimeScope)
    scope: providers.Singleton[LifetimeScope] = fz.Singleton(_child, parent_scope, "model")
    checkpoint_model_type = fz.Callable(f.checkpoint_model_type, recipe=recipe)
    #: The only source of the family: weight loading and every lane's model use this one.
    family: providers.Singleton[Family] = fz.Singleton(
        f.resolve_family, recipe=recipe, model_type=checkpoint_model_type.provider
    )
    weights: Owned = Owned(f.load_weights, recipe=recipe, family=family).owned_by(scope, "weights")
    tokenizer: Owned = Owned(f.load_tokenizer, recipe=recipe, checkpoint=weights).owned_by(
        scope, "tokenizer"
    )


def _lane_scope(parent: LifetimeScope, lane: int) -> LifetimeScope:
    return parent.child(f"lane{lane}", lane=lane)


def _closer(method: str) -> Callable[[object], Callable[[], object]]:
    """``close(obj)`` that calls ``obj.<method>()`` at teardown (looked up then, not now)."""

    def close_for(obj: object) -> Callable[[], object]:
        return lambda: getattr(obj, method)()

    return close_for


def _close_traces(traces: TraceCompiler | None) -> Callable[[], object] | None:
    return traces.cleanup if traces is not None else None


class LaneContainer(containers.DeclarativeContainer):
    """One data-parallel lane, built in the spec's construction order."""

    recipe = fz.Dependency(instance_of=Recipe)
    parent_scope = fz.Dependency(instance_of=LifetimeScope)
    lane = fz.Dependency(instance_of=int)
    device: providers.Dependency[Device] = fz.Dependency()
    lane_devices: providers.Dependency[tuple[Device, ...]] = fz.Dependency()
    weights = fz.Dependency(instance_of=Checkpoint)
    family: providers.Dependency[Family] = fz.Dependency()
    barrier = fz.Dependency(instance_of=CaptureBarrier)

    scope: providers.Singleton[LifetimeScope] = fz.Singleton(_lane_scope, parent_scope, lane)
    model: Owned = Owned(
        f.build_model, recipe=recipe, checkpoint=weights, family=family, device=device
    ).owned_by(scope, "model")
    step_compiler: Owned = Owned(f.build_step_compiler, recipe=recipe, lane=lane).owned_by(
        scope, "step_compiler", close=_closer("close")
    )
    kv_cache_manager: Owned = Owned(
        f.build_kv_manager, recipe=recipe, model=model, device=device, lane=lane
    ).owned_by(scope, "kv_cache_manager", close=_closer("release"))
    page_table_layout: Owned = Owned(
        f.build_layout, recipe=recipe, model=model, kv=kv_cache_manager
    ).owned_by(scope, "page_table_layout")
    output_reader: Owned = Owned(f.build_output_reader, device=device, lane=lane).owned_by(
        scope, "output_reader", close=_closer("drain")
    )
    prefill_runtime: Owned = Owned(
        f.build_prefill,
        recipe=recipe,
        model=model,
        device=device,
        reader=output_reader,
        layout=page_table_layout,
        lane=lane,
        steps=step_compiler,
    ).owned_by(scope, "prefill_runtime", close=_closer("cleanup"))
    decode_runtime: Owned = Owned(
        f.build_decode,
        recipe=recipe,
        model=model,
        device=device,
        reader=output_reader,
        layout=page_table_layout,
        lane=lane,
        steps=step_compiler,
    ).owned_by(scope, "decode_runtime", close=_closer("cleanup_transients"))
    program_compiler: Owned = Owned(
        f.build_program_compiler,
        recipe=recipe,
        device=device,
        kv=kv_cache_manager,
        lane=lane,
        steps=step_compiler,
    ).owned_by(scope, "program_compiler", close=_closer("cleanup"))
    eager_executor: Owned = Owned(
        f.build_eager, prefill=prefill_runtime, decode=decode_runtime, compiler=program_compiler
    ).owned_by(scope, "eager_executor")
    trace_compiler: Owned = Owned(
        f.build_trace_compiler, recipe=recipe, compiler=program_compiler, device=device, lane=lane
    ).owned_by(scope, "trace_compiler", close=_close_traces)
    traced_executor: Owned = Owned(
        f.build_traced, recipe=recipe, eager=eager_executor, traces=trace_compiler
    ).owned_by(scope, "traced_executor")
    warmup_coordinator: Owned = Owned(
        f.build_warmup,
        recipe=recipe,
        eager=eager_executor,
        traced=traced_executor,
        barrier=barrier,
        lane=lane,
    ).owned_by(scope, "warmup_coordinator")
    model_executor: Owned = Owned(
        f.build_model_executor,
        kv=kv_cache_manager,
        reader=output_reader,
        eager=eager_executor,
        traced=traced_executor,
        warmup=warmup_coordinator,
        lane=lane,
    ).owned_by(scope, "model_executor", close=_closer("cleanup"))
    # The executor is the lane's cleanup root: once it exists, these run as its steps only.
    govern(
        model_executor,
        kv_cache_manager,
        output_reader,
        prefill_runtime,
        decode_runtime,
        program_compiler,
        trace_compiler,
    )
    identity_check = fz.Callable(
        f.check_lane_identity, devices=lane_devices, executor=model_executor, device=device
    )


#: The lane providers that must stay :class:`Owned` in any lane container (subclass or factory).
LANE_LIFETIMES: tuple[str, ...] = tuple(
    name for name, p in LaneContainer.cls_providers.items() if isinstance(p, Owned)
)


def declare_lanes(
    *,
    recipe: Recipe,
    lane_container: Callable[..., LaneContainer],
    scope: providers.Provider[LifetimeScope],
    lane_devices: providers.Provider[tuple[Device, ...]],
    weights: providers.Provider[Checkpoint],
    family: providers.Provider[Family],
    barrier: providers.Provider[CaptureBarrier],
) -> tuple[LaneContainer, ...]:
    """One lane sub-container per lane, wired to the root's providers; nothing is built yet.

    ``lane_container`` is called with the lane's dependencies: ``LaneContainer``, or a factory
    that overrides some of the lane's providers. A lane provider that is not ``Owned`` (a
    subclass that redefined one as a plain Singleton) would escape teardown: refused.
    """
    lanes = []
    for index in range(recipe.lanes):
        lane = lane_container(
            recipe=recipe,
            parent_scope=scope,
            lane=index,
            device=fz.Callable(operator.itemgetter(index), lane_devices),
            lane_devices=lane_devices,
            weights=weights,
            family=family,
            barrier=barrier,
        )
        for name in LANE_LIFETIMES:
            if not isinstance(getattr(lane, name, None), Owned):
                raise ContainerStateError(
                    f"lane {index}: provider {name} is not an Owned provider, so its object "
                    f"would escape teardown; override it instead "
                    f"(container.lane_containers()[{index}].{name}.override(...))"
                )
        lanes.append(lane)
    return tuple(lanes)


#: A lane's objects in the spec's construction order (seed README, "Composition and
#: construction"), built in this order whatever each provider's keywords resolve first. The
#: step compiler (llmrt's source of compiled steps, not in the spec's diagram) comes right
#: before its first user, the prefill runtime.
LANE_CONSTRUCTION_ORDER: tuple[str, ...] = (
    "model",
    "kv_cache_manager",
    "page_table_layout",
    "output_reader",
    "step_compiler",
    "prefill_runtime",
    "decode_runtime",
    "program_compiler",
    "eager_executor",
    "trace_compiler",
    "traced_executor",
    "warmup_coordinator",
    "model_executor",
)
if set(LANE_CONSTRUCTION_ORDER) != set(LANE_LIFETIMES):
    raise ContainerStateError(
        f"LANE_CONSTRUCTION_ORDER {LANE_CONSTRUCTION_ORDER} must name every lane lifetime "
        f"{LANE_LIFETIMES}"
    )

#: What the root builds before any lane, in order: the device scope, then the model's weights.
ROOT_CONSTRUCTION_ORDER: tuple[str, ...] = (
    "device.device",
    "device.torch_threads",
    "device.lane_devices",
    "model.weights",
)

#: Why a built container refuses changes (``containers/freeze.py``).
_BUILT = (
    "is frozen: the container was built (its first object exists); override providers "
    "before the first object is built (lane_group(), startup(), any owned provider)"
)


def build_lanes(*, lanes: tuple[LaneContainer, ...]) -> tuple[LaneContainer, ...]:
    """Build every declared lane (in lane order, each in ``LANE_CONSTRUCTION_ORDER``) and
    check its identity constraints."""
    for lane in lanes:
        for name in LANE_CONSTRUCTION_ORDER:
            getattr(lane, name)()
        lane.identity_check()
    return lanes


def _resolve(container: Any, path: str) -> object:
    target: object = container
    for part in path.split("."):
        target = getattr(target, part)
    return target() if callable(target) else target


def _build_lanes(container: Any) -> tuple[LaneContainer, ...]:
    """The root's objects in ``ROOT_CONSTRUCTION_ORDER``, then every lane."""
    for path in ROOT_CONSTRUCTION_ORDER:
        _resolve(container, path)
    return build_lanes(lanes=container.lane_containers())


def _open_root(container: Any) -> LifetimeScope:
    """The root scope; the first object it records freezes the container (``_freeze``)."""
    return LifetimeScope("runtime", on_first_own=lambda: _freeze(container))


def _freeze(container: Any) -> None:
    """Freeze the whole container, and its lanes if they were declared already."""
    declared = container.lane_container.frozen
    fz.freeze(container, reason=_BUILT)
    if declared:
        _freeze_lanes(container.lane_containers())


def _freeze_lanes(lanes: tuple[LaneContainer, ...]) -> None:
    for index, lane in enumerate(lanes):
        fz.freeze(lane, reason=_BUILT, prefix=f"lane_containers()[{index}].")


def _declared_lanes(container: Any) -> tuple[LaneContainer, ...]:
    """``declare_lanes`` over the root's providers; ``lane_container`` is spent from here on."""
    lanes = declare_lanes(
        recipe=container.recipe(),
        lane_container=container.lane_container(),
        scope=container.root_scope,
        lane_devices=container.device.lane_devices,
        weights=container.model.weights,
        family=container.model.family,
        barrier=container.barrier,
    )
    container.lane_container.freeze_with(
        "lane_container is spent: lane_containers() already declared every lane from it; "
        "override lane_container before lane_containers(), or override a declared lane's "
        "providers (container.lane_containers()[i].<provider>.override(...))"
    )
    # The lanes hold the recipe they were declared from: another one now would build the
    # root from it and the lanes from this one.
    container.recipe.freeze_with(
        "recipe is spent: lane_containers() already declared every lane from it; override "
        "the recipe before lane_containers()"
    )
    if container.root_scope.frozen:
        _freeze_lanes(lanes)
    return lanes


def _open_serving(container: Any) -> LifetimeScope:
    """The serving scope opens after every lane (so it closes before them)."""
    container.lanes()
    scope: LifetimeScope = container.root_scope().child("serving")
    return scope


def build_lane_group(
    *, lanes: tuple[LaneContainer, ...], barrier: CaptureBarrier
) -> LaneGroupExecutor:
    return LaneGroupExecutor(lanes=[lane.model_executor() for lane in lanes], barrier=barrier)


class RuntimeContainer(containers.DeclarativeContainer):
    """The root: a recipe in, a lane group out; :func:`close_runtime` tears it all down."""

    __self__ = providers.Self()
    recipe = fz.Dependency(instance_of=Recipe)
    root_scope: providers.Singleton[LifetimeScope] = fz.Singleton(_open_root, container=__self__)

    device = fz.Container(DeviceContainer, recipe=recipe, parent_scope=root_scope)
    model = fz.Container(ModelContainer, recipe=recipe, parent_scope=root_scope)

    barrier: providers.Singleton[CaptureBarrier] = fz.Singleton(
        CaptureBarrier, lanes=recipe.provided.lanes
    )
    lane_container = fz.Object(LaneContainer)
    #: Every lane sub-container, declared (overridable) but not built.
    lane_containers: providers.Singleton[tuple[LaneContainer, ...]] = fz.Singleton(
        _declared_lanes, container=__self__
    )
    #: The root's objects and every lane, built in the declared construction order.
    lanes: providers.Singleton[tuple[LaneContainer, ...]] = fz.Singleton(
        _build_lanes, container=__self__
    )
    #: Opens after the lanes it serves (so it closes before them).
    serving_scope: providers.Singleton[LifetimeScope] = fz.Singleton(
        _open_serving, container=__self__
    )
    lane_group: Owned = Owned(build_lane_group, lanes=lanes, barrier=barrier).owned_by(
        serving_scope, "lane_group"
    )
    #: The one startup sequence (configure, allocate, warm decode, warm prefill, activate).
    startup: providers.Singleton[StartupSequence] = fz.Singleton(StartupSequence, group=lane_group)


def start_runtime(
    container: RuntimeContainer, *, num_blocks: int | None = None
) -> LaneGroupExecutor:
    """Build (if needed) and start ``container``'s runtime; returns the serving-ready lane group.

    The one startup sequence every front end uses: ``container.startup().run(num_blocks=...)``
    (see :class:`llmrt.runtime.startup.StartupSequence` for the phases and their order). The caller
    still owns the container: on failure, close it with ``close_runtime(container, primary=exc)``.
    """
    return container.startup().run(num_blocks=num_blocks)


def close_runtime(container: RuntimeContainer, *, primary: BaseException | None = None) -> None:
    """Tear down everything ``container`` built, in exact reverse creation order.

    Raises ``CleanupError`` listing every failed step, with ``primary`` (the error that
    started the teardown, if any) preserved. Idempotent: a step that succeeded never runs
    again; calling it again retries exactly the steps that failed (their orphans).
    """
    container.root_scope().close(primary=primary)


__all__ = [
    "Borrowed",
    "DeviceContainer",
    "LaneContainer",
    "ModelContainer",
    "Owned",
    "RuntimeContainer",
    "build_lane_group",
    "build_lanes",
    "close_runtime",
    "declare_lanes",
    "start_runtime",
]
