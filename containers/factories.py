"""Provider functions the containers wire: each builds one component, and nothing else.

Factories know nothing about scopes: ownership is declared in the containers
(``containers/ownership.py``), so an object injected by an override is owned (or declared
borrowed) exactly like the one a factory builds. Keyword-only signatures keep each factory
easy to extend (``build_model`` may gain the lane's port device or mesh handle).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from llmrt.device.base import Device
from llmrt.device.host_memory import (
    freed_memory_retained,
    retain_freed_memory,
    trim_freed_memory,
)
from llmrt.device.huge_pages import huge_pages_refused, place_module_weights
from llmrt.device.torch import TorchDevice
from llmrt.errors import CheckpointError, ConfigError, DeviceError, IdentityError
from llmrt.families.base import CausalLM, Family
from llmrt.families.fused_decode import select_decode_kernel
from llmrt.families.layers import (
    apply_weight_format,
    int8_fallback_dtype,
    int8_gemm_coverage,
    resolve_gemm_dtype,
    select_gemm_dtype,
    select_linear_kernel,
    select_weight_layout,
)
from llmrt.families.prefill_attention import select_attention_kernel
from llmrt.families.registry import check_family_backend
from llmrt.kernels.file_pages import release_file_pages
from llmrt.kernels.formats import QUANTIZED_FORMATS, QuantizedWeight, dequantized
from llmrt.kernels.native import require_kernels
from llmrt.lifecycle.events import component_logger, emit, object_id
from llmrt.lifecycle.progress import progress_step
from llmrt.paths import default_cache_dir
from llmrt.recipe.loader import Recipe
from llmrt.runtime.compiled_step import StepCompiler
from llmrt.runtime.config import PageTableLayout, TraceConfig
from llmrt.runtime.decode import LADDER_FIRST_TOKENS, DecodeRuntime, DecodeRuntimeConfig
from llmrt.runtime.execution import EagerExecutor, TracedExecutor
from llmrt.runtime.model_executor import ModelExecutor
from llmrt.runtime.output_reader import OutputReader
from llmrt.runtime.paged_kv_cache import PagedKVCacheManager
from llmrt.runtime.prefill.config import PrefillRuntimeConfig
from llmrt.runtime.prefill.runtime import PrefillRuntime
from llmrt.runtime.program_compiler import PROGRAM_OPERATIONS, ProgramCompiler
from llmrt.runtime.trace_compiler import TraceCompiler
from llmrt.runtime.warmup import CaptureBarrier, WarmupCoordinator, WarmupCoordinatorConfig
from llmrt.weights.cache import file_digest
from llmrt.weights.checkpoint import (
    Checkpoint,
    existing_checkpoint_path,
    gguf_config,
    load_checkpoint,
)
from llmrt.weights.package_data import package_file
from llmrt.weights.tokenizer import Tokenizer, byte_tokenizer

#: Fraction of physical memory one lane's KV cache may take when num_blocks is unresolved.
KV_MEMORY_FRACTION = 0.25

# -- device scope ----------------------------------------------------------------------------


TTNN_MODULES_GROUP = "llmrt.ttnn_modules"
"""Entry points naming ttnn implementations besides the wheel: ``name = "pkg.mod:factory"``,
``factory(mesh_shape=(rows, cols))`` returning the module (llmrt's own: ``emulator``)."""


def load_ttnn(*, recipe: Recipe) -> Any:
    """The ``ttnn`` module a ttnn recipe opens its mesh with (None for torch):
    ``device.ttnn.module`` names the wheel (``ttnn``) or a registered implementation.

    Tests may also override this provider with ``llmrt.testing.fake_ttnn.FakeTtnn``.
    """
    if recipe.device.backend != "ttnn":
        return None
    name = recipe.device.ttnn.module
    if name == "ttnn":
        from llmrt.device.ttnn import import_ttnn

        return import_ttnn()
    from importlib.metadata import entry_points

    found = {ep.name: ep for ep in entry_points(group=TTNN_MODULES_GROUP)}
    if name not in found:
        raise ConfigError(
            "device.ttnn.module",
            name,
            f"must be ttnn or one of {sorted(found)} (entry points {TTNN_MODULES_GROUP})",
        )
    mesh = recipe.device.mesh_shape or (1, recipe.lanes)
    return found[name].load()(mesh_shape=tuple(mesh))


def open_device(*, recipe: Recipe, ttnn_module: Any = None) -> Device:
    """Open the recipe's device (or mesh); the device scope closes it (``close_device``)."""
    spec = recipe.device
    if spec.backend == "ttnn":
        from llmrt.device.ttnn import open_ttnn_device

        tt = spec.ttnn
        assert tt.fabric_config is not None  # the recipe resolves it (tensor-parallel lanes)
        device: Device = open_ttnn_device(
            mesh_shape=spec.mesh_shape or (1, recipe.lanes),
            ttnn_module=ttnn_module,
            l1_small_size=tt.l1_small_size,
            trace_region_size=tt.trace_region_size,
            num_command_queues=tt.num_command_queues,
            dispatch_core_type=tt.dispatch_core_type,
            fabric_config=tt.fabric_config,
        )
        emit(component_logger("device", object_id=device.id), "device.opened", device=device.id)
        return device
    no_huge = huge_pages_refused(setting="kv_cache.huge_pages", enabled=recipe.kv_cache.huge_pages)
    device = TorchDevice(spec.torch_device, huge_pages=no_huge is None)
    host: dict[str, Any] = {}
    if device.kind == "cpu":
        host["kv_huge_pages"] = "advised" if no_huge is None else f"off ({no_huge})"
    if spec.retain_freed_memory and device.kind == "cpu":
        why_not = retain_freed_memory()
        host["freed_memory"] = "retained" if why_not is None else f"released ({why_not})"
    emit(component_logger("device", object_id=device.id), "device.opened", device=device.id, **host)
    return device


def close_device(device: Device) -> Callable[[], None]:
    """The owned device's teardown: drain the queue, then close it (a ttnn mesh it opened)."""

    def close() -> None:
        device.synchronize()
        closer = getattr(device, "close", None)
        if callable(closer):
            closer()
        host: dict[str, Any] = {}
        if device.kind == "cpu" and freed_memory_retained():
            # Process-wide and without an inverse (host_memory.py): say so, with the cost.
            host["freed_memory"] = "still retained (process-wide; RSS follows the heap's peak)"
        log = component_logger("device", object_id=device.id)
        emit(log, "device.closed", device=device.id, **host)

    return close


@attrs.frozen(kw_only=True)
class TorchThreads:
    """torch's intra-op thread count as the recipe set it, and the count it replaced."""

    wanted: int | None
    previous: int


def set_torch_threads(*, recipe: Recipe) -> TorchThreads:
    """Apply ``device.num_threads`` (torch backend); the device scope restores it at close."""
    previous = torch.get_num_threads()
    wanted = recipe.device.num_threads if recipe.device.backend == "torch" else None
    if wanted is not None:
        cpus = usable_cpus()
        if wanted > cpus:
            warnings.warn(
                f"device.num_threads={wanted} is more than the {cpus} CPUs this process may "
                f"use: running {cpus} (more threads than CPUs only slows every step)",
                RuntimeWarning,
                stacklevel=2,
            )
            wanted = cpus
        torch.set_num_threads(wanted)
    return TorchThreads(wanted=wanted, previous=previous)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS says, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def restore_torch_threads(threads: TorchThreads) -> Callable[[], str] | None:
    """Teardown of ``set_torch_threads``: the process gets its thread count back."""
    if threads.wanted is None:
        return None

    def restore() -> str:
        torch.set_num_threads(threads.previous)
        return f"restored {threads.previous} torch threads"

    return restore


def split_lanes(*, device: Device, lanes: int) -> tuple[Device, ...]:
    """Lane sub-devices: each lane owns its traces, events and allocations."""
    split = tuple(device.lanes(lanes))
    for lane, sub in enumerate(split):
        log = component_logger("device", lane=lane, object_id=sub.id)
        emit(log, "device.opened", device=sub.id, parent=device.id)
    return split


# -- model scope -----------------------------------------------------------------------------


def resolve_family(*, recipe: Recipe, model_type: Callable[[], str]) -> Family:
    """The recipe's family (``auto`` asks ``model_type()``, the checkpoint's, read cheaply),
    which must support ``device.backend``."""
    family = recipe.family_for(model_type() if recipe.family == "auto" else "")
    check_family_backend(family, recipe.device.backend)
    return family


def checkpoint_model_type(*, recipe: Recipe) -> str:
    """The checkpoint's ``model_type`` without loading its tensors (for ``family: auto``)."""
    spec = recipe.checkpoint
    if spec.format == "random":
        return str(recipe.model.get("model_type"))
    if spec.format == "safetensors":
        config = existing_checkpoint_path(spec.path or "", directory=True) / "config.json"
        if not config.is_file():
            raise CheckpointError(
                str(config), "missing: checkpoint.path must be a Hugging Face checkpoint directory"
            )
        try:
            return str(json.loads(config.read_text(encoding="utf-8"))["model_type"])
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(str(config), f"no readable model_type ({exc})") from exc
    # A GGUF's model_type comes from its header's architecture (no tensor is read).
    return str(gguf_config(path=spec.path, package=spec.package, file=spec.file)["model_type"])


def load_weights(*, recipe: Recipe, family: Family) -> Checkpoint:
    """Load (and for GGUF, dequantize once and cache) the recipe's checkpoint for ``family``.

    ``checkpoint.weights: gguf-native`` keeps the GGUF's quantized blocks instead.
    """
    spec = recipe.checkpoint
    if spec.weight_format in QUANTIZED_FORMATS and recipe.device.backend == "torch":
        require_kernels(field="checkpoint.weights", value=spec.weight_format)
    checkpoint = load_checkpoint(
        format=spec.format,
        path=spec.path,
        package=spec.package,
        file=spec.file,
        model=dict(recipe.model) if spec.format == "random" else None,
        seed=spec.seed,
        expected_tensors=family.expected_tensors,
        optional_tensors=family.optional_tensors,
        model_types=family.model_types,
        tensor_init=getattr(family, "tensor_init", None),
        rename=getattr(family, "rename_tensors", None) or getattr(family, "rename", None),
        keep_quantized=spec.weight_format == "gguf-native",
        requantize=spec.requantize,
    )
    return checkpoint


def load_tokenizer(*, recipe: Recipe, checkpoint: Checkpoint) -> Tokenizer:
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
    return tokenizer


def build_model(
    *, recipe: Recipe, checkpoint: Checkpoint, family: Family, device: Device
) -> CausalLM:
    """One lane's tensor model; lanes on one host share the checkpoint's tensors.

    A torch family builds on the lane's torch device; a ttnn family gets the lane's port
    device itself (a ``TtnnDevice``: its ``mesh_device`` and ``ttnn_module``).

    Blocks a GGUF-native checkpoint holds are dequantized when this recipe wants another
    weight format (e.g. weights borrowed from a gguf-native container).
    """
    dtype = torch.bfloat16 if recipe.checkpoint.dtype == "bfloat16" else torch.float32
    native = recipe.checkpoint.weight_format == "gguf-native"
    weights = recipe.checkpoint.weight_format
    if recipe.device.backend == "ttnn":
        return build_ttnn_model(recipe=recipe, checkpoint=checkpoint, family=family, device=device)
    with progress_step(f"building the {family.name} model ({weights} weights)"):
        model = family.build(
            hf_config=checkpoint.hf_config,
            tensors=checkpoint.tensors if native else dequantized(checkpoint.tensors),
            dtype=dtype,
            device=device if recipe.device.backend == "ttnn" else device.torch_device,
        )
        apply_weight_format(model, weights=weights, field="checkpoint.weights")
    if recipe.device.backend == "torch":
        torch_device = torch.device(device.torch_device)
        select_linear_kernel(
            model,
            choice=recipe.device.linear,
            device=torch_device,
            dtype=dtype,
        )
        quantized = recipe.checkpoint.weight_format in QUANTIZED_FORMATS
        gemm_dtype, gemm_why = resolve_gemm_dtype(
            recipe.device.gemm_dtype, device=torch_device, quantized=quantized
        )
        int8_fallback = int8_fallback_dtype() if gemm_dtype == "int8" else "float32"
        if gemm_dtype != "float32":
            select_gemm_dtype(
                model,
                choice=gemm_dtype,
                min_rows=recipe.device.gemm_dtype_min_rows,
                int8_fallback=int8_fallback,
            )
        repacking = progress_step("repacking weights for the CPU kernels") if quantized else None
        with repacking or contextlib.nullcontext():
            select_weight_layout(
                model,
                choice=recipe.device.weight_layout,
                device=torch_device,
                on_replaced=checkpoint.follow_relayout,
            )
        if gemm_dtype == "int8":
            gemm_why = int8_gemm_note(model, why=gemm_why, fallback=int8_fallback)
        if torch_device.type == "cpu":
            place_weights(
                model=model,
                enabled=recipe.device.huge_pages,
                device=device,
                gemm_dtype=f"{gemm_dtype} ({gemm_why})",
                checkpoint=checkpoint,
            )
        select_decode_kernel(
            model,
            choice=recipe.device.decode_kernel,
            device=torch_device,
        )
        select_attention_kernel(
            model,
            choice=recipe.device.attention_kernel,
            device=torch_device,
        )
    return model


def build_ttnn_model(
    *, recipe: Recipe, checkpoint: Checkpoint, family: Family, device: Device
) -> CausalLM:
    """One ttnn lane's model: a family with ``build_ttnn`` (the decoder families) converts
    its weights to ``device.ttnn.weight_dtype``; others (a TTTv2 plugin) build on the lane's
    port device. GGUF blocks are dequantized once first, the cost logged
    (``weights.dequantized``): ttnn has no kernels for ggml's block formats."""
    tensors: Mapping[str, Any] = checkpoint.tensors
    quantized = [t for t in tensors.values() if isinstance(t, QuantizedWeight)]
    if quantized:
        started = time.perf_counter()
        with progress_step(f"dequantizing {len(quantized)} GGUF tensors for ttnn"):
            tensors = dequantized(tensors)
        emit(
            component_logger("model", object_id=device.id),
            "weights.dequantized",
            device=device.id,
            tensors=len(quantized),
            float32_bytes=sum(
                t.numel() * t.element_size()
                for t in tensors.values()
                if isinstance(t, torch.Tensor)
            ),
            seconds=round(time.perf_counter() - started, 3),
            why="ttnn runs bfloat16/bfloat8_b weights, not ggml blocks",
        )
    build_ttnn = getattr(family, "build_ttnn", None)
    cache_dir = ttnn_weights_cache(recipe=recipe)
    with progress_step(
        f"building the {family.name} model on ttnn ({recipe.device.ttnn.weight_dtype} weights)"
    ):
        if build_ttnn is not None:
            model: CausalLM = build_ttnn(
                hf_config=checkpoint.hf_config,
                tensors=tensors,
                device=device,
                weight_dtype=recipe.device.ttnn.weight_dtype,
                cache_dir=cache_dir,
            )
        else:
            dtype = torch.bfloat16 if recipe.checkpoint.dtype == "bfloat16" else torch.float32
            model = family.build(
                hf_config=checkpoint.hf_config, tensors=tensors, dtype=dtype, device=device
            )
    return model


TTNN_CACHE_VERSION = 3
"""Bumped whenever the ttnn decoder's weight conversion changes (old entries are not read)."""


def ttnn_weights_cache(*, recipe: Recipe) -> Path | None:
    """Where a file checkpoint's weights converted for ttnn are kept: keyed by the content
    digest of its files, the weight dtype and the conversion's version (None: a random
    checkpoint, rebuilt from its seed at no cost worth caching)."""
    spec = recipe.checkpoint
    if spec.format == "random":
        return None
    root = default_cache_dir()
    if spec.format == "gguf":
        files = [
            Path(spec.path)
            if spec.path
            else package_file(package=spec.package or "", file=spec.file or "")
        ]
    else:
        files = sorted(
            existing_checkpoint_path(spec.path or "", directory=True).glob("*.safetensors")
        )
    digest = hashlib.sha256(
        "\0".join(file_digest(f, cache_dir=root) for f in files).encode()
    ).hexdigest()
    return root / "ttnn" / f"{digest[:32]}-{recipe.device.ttnn.weight_dtype}-v{TTNN_CACHE_VERSION}"


def int8_gemm_note(model: CausalLM, *, why: str, fallback: str = "float32") -> str:
    """``why`` with how many linears take ``device.gemm_dtype: int8`` at this level and what
    the rest multiply in (``fallback``); a warning where none does (slower than asked)."""
    covered, total = int8_gemm_coverage(model)
    if covered == 0:
        warnings.warn(
            "device.gemm_dtype=int8: no block-quantized linear of this model has an int8 GEMM "
            "at this instruction-set level (x86 from AVX2: interleaved Q4_0/Q4_1/Q8_0 and "
            f"Q4_K/Q5_K/Q6_K); its GEMMs multiply in {fallback}",
            RuntimeWarning,
            stacklevel=2,
        )
    rest = f", the other {total - covered} multiply in {fallback}" if covered < total else ""
    return f"{why}; {covered} of {total} block-quantized linears have the int8 GEMM{rest}"


def place_weights(
    *,
    model: CausalLM,
    enabled: bool,
    device: Device,
    gemm_dtype: str | None = None,
    checkpoint: Checkpoint | None = None,
) -> None:
    """Put a CPU model's weights on huge pages (``device.huge_pages``) before any kernel
    borrows them, give back the resident pages of ``checkpoint``'s file mappings (the model
    holds its own copies now; anything it still reads there faults back in), and log where
    they are (``weights.placed``, with the GEMM dtype the recipe's ``device.gemm_dtype``
    resolved to, and why, when given)."""
    why_not = huge_pages_refused(setting="device.huge_pages", enabled=enabled)
    if why_not is None and not isinstance(model, torch.nn.Module):
        why_not = f"{type(model).__name__} is not a torch module"
    fields: dict[str, Any]
    release = (
        checkpoint.release_mapped_pages if checkpoint is not None and checkpoint.mappings else None
    )
    # Before the placement too, so its copy is not made beside the file's pages; what it
    # reads there again (views the model still holds, e.g. norms) goes back after it.
    released = [release()] if release is not None else []
    # The build's freed transients, so neither the placement nor the first steps (faulting
    # the file's pages back in) stack on top of them.
    fields_trim = trim_freed_memory()
    if why_not is None:
        followers = () if checkpoint is None else checkpoint.storage_views()
        fields = place_module_weights(
            model,  # type: ignore[arg-type]
            followers=followers,
            give_back=release_file_pages,
        ).log_fields()
    else:
        fields = {"weights_on_huge_pages": f"off ({why_not})"}
    fields["freed_heap_trimmed"] = fields_trim
    if gemm_dtype is not None:
        fields["gemm_dtype"] = gemm_dtype
    if release is not None:
        released.append(release())
        skipped = [r.skipped for r in released if r.skipped is not None]
        fields["checkpoint_pages_released"] = (
            f"0 ({skipped[0]})" if skipped else sum(r.released_bytes for r in released)
        )
    log = component_logger("model", object_id=object_id(model))
    emit(log, "weights.placed", device=device.id, **fields)


# -- lane scope ------------------------------------------------------------------------------


def build_step_compiler(*, recipe: Recipe, lane: int) -> StepCompiler:
    """The lane's step source: the model's forwards, or compiled ones (``device.compile``)."""
    return StepCompiler(options=recipe.device.compile_options(), lane=lane)


def resolve_num_blocks(*, recipe: Recipe, model: CausalLM) -> int:
    """Physical blocks for one lane when the recipe leaves ``kv_cache.num_blocks`` unset.

    Enough for every decode slot at ``Recipe.max_model_len`` (within the model's
    positions), never above ``kv_cache.max_num_blocks``, and within a fraction of
    physical memory.
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
    longest = min(model.config.max_position_embeddings, recipe.max_model_len)
    wanted = -(-recipe.decode.lane_capacity * longest // kv.block_size)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 8 << 30
    budget = max(1, int(memory * KV_MEMORY_FRACTION) // per_block)
    return max(1, min(kv.max_num_blocks, wanted, budget))


def build_kv_manager(
    *, recipe: Recipe, model: CausalLM, device: Device, lane: int
) -> PagedKVCacheManager:
    config = recipe.kv_cache.with_num_blocks(resolve_num_blocks(recipe=recipe, model=model))
    return PagedKVCacheManager(model=model, device=device, config=config, lane=lane)


def build_layout(*, recipe: Recipe, model: CausalLM, kv: PagedKVCacheManager) -> PageTableLayout:
    blocks = kv.config.num_blocks or kv.config.max_num_blocks
    layout = PageTableLayout.resolve(
        block_size=kv.config.block_size,
        model_max_sequence_length=min(
            model.config.max_position_embeddings, recipe.max_model_len
        ),
        physical_num_blocks=blocks,
        max_prefill_chunk_size=recipe.prefill.max_chunk_size,
    )
    return layout


def build_output_reader(*, device: Device, lane: int) -> OutputReader:
    return OutputReader(device=device, lane=lane)


def build_prefill(
    *,
    recipe: Recipe,
    model: CausalLM,
    device: Device,
    reader: OutputReader,
    layout: PageTableLayout,
    lane: int,
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
        # Ragged waves run eagerly, at whatever length their longest row pads to.
        max_wave_seq_len=(
            None if recipe.wave_rules == "ragged" else min(recipe.warmup.prefill_seq_lens)
        ),
        wave_rules=recipe.wave_rules,
        lane=lane,
    )
    return PrefillRuntime(config, step_compiler=steps)


def build_decode(
    *,
    recipe: Recipe,
    model: CausalLM,
    device: Device,
    reader: OutputReader,
    layout: PageTableLayout,
    lane: int,
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
        # On CUDA a step attends over its table's whole width (trimming it to the blocks in
        # use would read the positions back on the host: a sync per step; a captured graph
        # cannot at all); the CPU's step trims it.
        width_ladder=LADDER_FIRST_TOKENS if device.torch_device.type == "cuda" else None,
    )
    return DecodeRuntime(config, step_compiler=steps)


def build_program_compiler(
    *,
    recipe: Recipe,
    device: Device,
    kv: PagedKVCacheManager,
    lane: int,
    steps: StepCompiler | None = None,
) -> ProgramCompiler:
    # Only a TT program or an inductor graph is built by a first run; plain torch eager
    # steps are registered at warmup and record their output contract on first use.
    materialize = PROGRAM_OPERATIONS
    if recipe.device.backend == "torch":
        compiled = recipe.device.compile != "eager"
        materialize = frozenset(recipe.device.inductor.operations if compiled else ())
    return ProgramCompiler(
        device=device, kv_cache=kv, lane=lane, step_compiler=steps, materialize=materialize
    )


def build_eager(
    *,
    prefill: PrefillRuntime,
    decode: DecodeRuntime,
    compiler: ProgramCompiler,
) -> EagerExecutor:
    return EagerExecutor(prefill=prefill, decode=decode, program_compiler=compiler)


def build_trace_compiler(
    *, recipe: Recipe, compiler: ProgramCompiler, device: Device, lane: int
) -> TraceCompiler | None:
    if not recipe.trace.enabled:
        return None
    return TraceCompiler(program_compiler=compiler, device=device, lane=lane)


def build_traced(
    *, recipe: Recipe, eager: EagerExecutor, traces: TraceCompiler | None
) -> TracedExecutor | None:
    if traces is None:
        return None
    return TracedExecutor(
        eager_executor=eager,
        trace_compiler=traces,
        trace_config=TraceConfig(mode=recipe.trace.mode),
    )


def build_warmup(
    *,
    recipe: Recipe,
    eager: EagerExecutor,
    traced: TracedExecutor | None,
    barrier: CaptureBarrier,
    lane: int,
) -> WarmupCoordinator:
    execution = traced if traced is not None else eager
    config = WarmupCoordinatorConfig.resolve(
        warmup=recipe.warmup, trace=recipe.trace, execution=execution, lane=lane
    )
    return WarmupCoordinator(config, execution=execution, barrier=barrier)


def build_model_executor(
    *,
    kv: PagedKVCacheManager,
    reader: OutputReader,
    eager: EagerExecutor,
    traced: TracedExecutor | None,
    warmup: WarmupCoordinator,
    lane: int,
) -> ModelExecutor:
    return ModelExecutor(
        kv_cache=kv, output_reader=reader, eager=eager, traced=traced, warmup=warmup, lane=lane
    )


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
