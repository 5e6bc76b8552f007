"""Provider functions the containers wire: each builds one component and records it in its scope.

Every function takes the scope that owns what it builds and registers the
object's teardown there at creation time, so the scopes know the exact creation
order (and hence the exact reverse teardown order), however dependency-injector
resolved the graph.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from llmrt.compiled_step import CompileOptions, StepCompiler
from llmrt.config import PageTableLayout, TraceConfig
from llmrt.decode import DecodeRuntime, DecodeRuntimeConfig
from llmrt.device.base import Device
from llmrt.device.torch import TorchDevice
from llmrt.errors import ConfigError, DeviceError, IdentityError
from llmrt.execution import EagerExecutor, TracedExecutor
from llmrt.families.base import CausalLM, Family
from llmrt.families.layers import select_linear_kernel
from llmrt.families.registry import family_for_model_type, get_family
from llmrt.model_executor import ModelExecutor
from llmrt.output_reader import OutputReader
from llmrt.paged_kv_cache import PagedKVCacheManager
from llmrt.prefill.config import PrefillRuntimeConfig
from llmrt.prefill.runtime import PrefillRuntime
from llmrt.program_compiler import PROGRAM_OPERATIONS, ProgramCompiler
from llmrt.recipe import Recipe
from llmrt.scope import LifetimeScope
from llmrt.trace_compiler import TraceCompiler
from llmrt.warmup import CaptureBarrier, WarmupCoordinator, WarmupCoordinatorConfig
from llmrt.weights.checkpoint import Checkpoint, load_checkpoint
from llmrt.weights.tokenizer import Tokenizer, byte_tokenizer

#: Fraction of physical memory one lane's KV cache may take when num_blocks is unresolved.
KV_MEMORY_FRACTION = 0.25

# -- device scope ----------------------------------------------------------------------------


def open_device(*, recipe: Recipe, scope: LifetimeScope) -> Device:
    """Open the recipe's device (or mesh); the scope synchronizes it at teardown."""
    spec = recipe.device
    if spec.backend == "ttnn":
        from llmrt.device.ttnn import open_ttnn_device

        device: Device = open_ttnn_device(mesh_shape=spec.mesh_shape or (1, recipe.lanes))
    else:
        if spec.num_threads is not None:
            torch.set_num_threads(spec.num_threads)
        device = TorchDevice(spec.torch_device)
    return scope.own("device", device, lambda: _close_device(device))


def _close_device(device: Device) -> None:
    """Drain the queue, then close what the runtime opened (a ttnn mesh it owns)."""
    device.synchronize()
    close = getattr(device, "close", None)
    if callable(close):
        close()


def split_lanes(*, device: Device, lanes: int, scope: LifetimeScope) -> tuple[Device, ...]:
    """Lane sub-devices: each lane owns its traces, events and allocations."""
    return scope.own("lane_devices", device.lanes(lanes))


# -- model scope -----------------------------------------------------------------------------


def resolve_family(*, recipe: Recipe, checkpoint: Checkpoint) -> Family:
    if recipe.family == "auto":
        return family_for_model_type(str(checkpoint.hf_config.get("model_type")))
    return get_family(recipe.family)


def load_weights(*, recipe: Recipe, scope: LifetimeScope) -> Checkpoint:
    """Load (and for GGUF, dequantize once and cache) the recipe's checkpoint."""
    spec = recipe.checkpoint
    family = None
    if recipe.family != "auto":
        family = get_family(recipe.family)
    elif spec.format == "random":
        family = family_for_model_type(str(recipe.model.get("model_type")))
    checkpoint = load_checkpoint(
        format=spec.format,
        path=spec.path,
        package=spec.package,
        file=spec.file,
        model=dict(recipe.model) if spec.format == "random" else None,
        seed=spec.seed,
        expected_tensors=family.expected_tensors if family is not None else None,
        optional_tensors=family.optional_tensors if family is not None else None,
        model_types=family.model_types if family is not None else None,
    )
    return scope.own("weights", checkpoint)


def load_tokenizer(*, recipe: Recipe, checkpoint: Checkpoint, scope: LifetimeScope) -> Tokenizer:
    source = recipe.tokenizer.source
    if source == "byte":
        tokenizer = byte_tokenizer()
    elif source == "path":
        path = recipe.tokenizer.path or ""
        with open(path, encoding="utf-8") as fh:
            tokenizer = Tokenizer.from_json(fh.read(), item=path)
    else:
        if checkpoint.tokenizer is None:
            raise ConfigError(
                "tokenizer.source", source, f"checkpoint {checkpoint.source} carries no tokenizer"
            )
        tokenizer = checkpoint.tokenizer
    return scope.own("tokenizer", tokenizer)


def build_model(
    *, recipe: Recipe, checkpoint: Checkpoint, family: Family, device: Device, scope: LifetimeScope
) -> CausalLM:
    """One lane's tensor model; lanes on one host share the checkpoint's tensors."""
    dtype = torch.bfloat16 if recipe.checkpoint.dtype == "bfloat16" else torch.float32
    model = family.build(
        hf_config=checkpoint.hf_config,
        tensors=checkpoint.tensors,
        dtype=dtype,
        device=device.torch_device,
    )
    if recipe.device.backend == "torch":
        select_linear_kernel(
            model,
            choice=recipe.device.linear,
            device=torch.device(device.torch_device),
            dtype=dtype,
        )
    return scope.own("model", model)


# -- lane scope ------------------------------------------------------------------------------


def build_step_compiler(*, recipe: Recipe, lane: int, scope: LifetimeScope) -> StepCompiler:
    """The lane's step source: the model's forwards, or compiled ones (``device.compile``)."""
    steps = StepCompiler(options=CompileOptions.from_device(recipe.device), lane=lane)
    return scope.own("step_compiler", steps, steps.close)


def resolve_num_blocks(*, recipe: Recipe, model: CausalLM) -> int:
    """Physical blocks for one lane when the recipe leaves ``kv_cache.num_blocks`` unset.

    Enough for every decode slot at ``serving.max_model_len``, never above
    ``kv_cache.max_num_blocks``, and within a fraction of physical memory.
    """
    kv = recipe.kv_cache
    if kv.num_blocks is not None:
        return kv.num_blocks
    meta = model.attention_metadata()
    per_block = (
        2
        * meta.num_layers
        * meta.num_kv_heads
        * kv.block_size
        * meta.head_dim
        * torch.tensor([], dtype=kv.torch_dtype).element_size()
    )
    wanted = -(-recipe.decode.lane_capacity * recipe.serving.max_model_len // kv.block_size)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 8 << 30
    budget = max(1, int(memory * KV_MEMORY_FRACTION) // per_block)
    return max(1, min(kv.max_num_blocks, wanted, budget))


def build_kv_manager(
    *, recipe: Recipe, model: CausalLM, device: Device, lane: int, scope: LifetimeScope
) -> PagedKVCacheManager:
    config = recipe.kv_cache.with_num_blocks(resolve_num_blocks(recipe=recipe, model=model))
    manager = PagedKVCacheManager(model=model, device=device, config=config, lane=lane)
    return scope.own("kv_cache_manager", manager, manager.release)


def build_layout(
    *, recipe: Recipe, model: CausalLM, kv: PagedKVCacheManager, scope: LifetimeScope
) -> PageTableLayout:
    blocks = kv.config.num_blocks or kv.config.max_num_blocks
    layout = PageTableLayout.resolve(
        block_size=kv.config.block_size,
        model_max_sequence_length=min(
            model.config.max_position_embeddings, recipe.serving.max_model_len
        ),
        physical_num_blocks=blocks,
        max_prefill_chunk_size=recipe.prefill.max_chunk_size,
    )
    return scope.own("page_table_layout", layout)


def build_output_reader(*, device: Device, lane: int, scope: LifetimeScope) -> OutputReader:
    reader = OutputReader(device=device, lane=lane)
    return scope.own("output_reader", reader, reader.drain)


def build_prefill(
    *,
    recipe: Recipe,
    model: CausalLM,
    device: Device,
    reader: OutputReader,
    layout: PageTableLayout,
    lane: int,
    scope: LifetimeScope,
    steps: StepCompiler | None = None,
) -> PrefillRuntime:
    config = PrefillRuntimeConfig.resolve(
        model=model,
        device=device,
        output_reader=reader,
        page_table_layout=layout,
        lane_capacity=recipe.decode.lane_capacity,
        batching_enabled=recipe.prefill.batched,
        max_batch_size=recipe.prefill.max_batch_size,
        buckets=recipe.prefill.seq_len_buckets,
        bucket_step=recipe.prefill.fine_step,
        device_sampling_enabled=recipe.decode.device_sampling,
        wave_batch_sizes=tuple(sorted({1, *recipe.warmup.prefill_batch_sizes})),
        max_wave_seq_len=min(recipe.warmup.prefill_seq_lens),
        wave_rules=recipe.wave_rules,
        lane=lane,
    )
    runtime = PrefillRuntime(config, step_compiler=steps)
    return scope.own("prefill_runtime", runtime, runtime.cleanup)


def build_decode(
    *,
    recipe: Recipe,
    model: CausalLM,
    device: Device,
    reader: OutputReader,
    layout: PageTableLayout,
    lane: int,
    scope: LifetimeScope,
    steps: StepCompiler | None = None,
) -> DecodeRuntime:
    config = DecodeRuntimeConfig.resolve(
        model=model,
        device=device,
        output_reader=reader,
        lane_capacity=recipe.decode.lane_capacity,
        page_table_layout=layout,
        device_sampling_enabled=recipe.decode.device_sampling,
        batch_sizes=recipe.decode_batch_sizes,
        lane=lane,
    )
    runtime = DecodeRuntime(config, step_compiler=steps)
    return scope.own("decode_runtime", runtime, runtime.cleanup_transients)


def build_program_compiler(
    *,
    recipe: Recipe,
    device: Device,
    kv: PagedKVCacheManager,
    lane: int,
    scope: LifetimeScope,
    steps: StepCompiler | None = None,
) -> ProgramCompiler:
    # Only a TT program or an inductor graph is built by a first run; plain torch eager
    # steps are registered at warmup and record their output contract on first use.
    materialize = PROGRAM_OPERATIONS
    if recipe.device.backend == "torch":
        compiled = recipe.device.compile != "eager"
        materialize = frozenset(recipe.device.inductor.operations if compiled else ())
    compiler = ProgramCompiler(
        device=device, kv_cache=kv, lane=lane, step_compiler=steps, materialize=materialize
    )
    return scope.own("program_compiler", compiler, compiler.cleanup)


def build_eager(
    *,
    prefill: PrefillRuntime,
    decode: DecodeRuntime,
    compiler: ProgramCompiler,
    scope: LifetimeScope,
) -> EagerExecutor:
    return scope.own(
        "eager_executor", EagerExecutor(prefill=prefill, decode=decode, program_compiler=compiler)
    )


def build_trace_compiler(
    *, recipe: Recipe, compiler: ProgramCompiler, device: Device, lane: int, scope: LifetimeScope
) -> TraceCompiler | None:
    if not recipe.trace.enabled:
        return None
    traces = TraceCompiler(program_compiler=compiler, device=device, lane=lane)
    return scope.own("trace_compiler", traces, traces.cleanup)


def build_traced(
    *, recipe: Recipe, eager: EagerExecutor, traces: TraceCompiler | None, scope: LifetimeScope
) -> TracedExecutor | None:
    if traces is None:
        return None
    traced = TracedExecutor(
        eager_executor=eager,
        trace_compiler=traces,
        trace_config=TraceConfig(mode=recipe.trace.mode),
    )
    return scope.own("traced_executor", traced)


def build_warmup(
    *,
    recipe: Recipe,
    eager: EagerExecutor,
    traced: TracedExecutor | None,
    barrier: CaptureBarrier,
    lane: int,
    scope: LifetimeScope,
) -> WarmupCoordinator:
    execution = traced if traced is not None else eager
    config = WarmupCoordinatorConfig.resolve(
        warmup=recipe.warmup, trace=recipe.trace, execution=execution, lane=lane
    )
    return scope.own(
        "warmup_coordinator", WarmupCoordinator(config, execution=execution, barrier=barrier)
    )


def build_model_executor(
    *,
    kv: PagedKVCacheManager,
    reader: OutputReader,
    eager: EagerExecutor,
    traced: TracedExecutor | None,
    warmup: WarmupCoordinator,
    lane: int,
    scope: LifetimeScope,
) -> ModelExecutor:
    executor = ModelExecutor(
        kv_cache=kv, output_reader=reader, eager=eager, traced=traced, warmup=warmup, lane=lane
    )
    return scope.own("model_executor", executor, executor.cleanup)


def check_lane_identity(
    *, devices: Sequence[object], executor: ModelExecutor, device: Device
) -> None:
    """Every component of a lane uses that lane's own device (one mesh per lane)."""
    for name, used in (
        ("output reader", executor.output_reader.borrowed_device),
        ("KV cache", executor.kv_cache.borrowed_device),
        ("prefill runtime", executor.prefill.config.device),
        ("decode runtime", executor.decode.config.device),
        ("program compiler", executor.eager.program_compiler.borrowed_device),
    ):
        if used is not device:
            raise IdentityError(f"the lane's {name} uses the lane device", used, device)
    if device not in devices:
        raise DeviceError(f"lane device {device.id} is not one of the opened lane devices")
