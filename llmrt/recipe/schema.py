"""The recipe schema: frozen attrs sections and the cross-field rules of a recipe.

A ``Recipe`` validates itself once, at construction: every section checks its own
fields, then ``Recipe`` checks the rules that span sections. Every error is a
``RecipeError`` whose ``field`` is the dotted path inside the recipe
(``prefill.max_chunk_size``). The ``trace``, ``warmup`` and ``kv_cache`` sections
are the runtime's own ``TraceConfig``, ``WarmupConfig`` and ``PagedKVCacheConfig``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, TypeAlias, get_args

import attrs

from llmrt.device.ttnn import DEFAULT_TRACE_REGION_SIZE, DispatchCoreType, FabricConfigName
from llmrt.errors import CheckpointError, ConfigError, FamilyError, RecipeError
from llmrt.families import registry as family_registry
from llmrt.families.base import Family
from llmrt.families.declared import DeclaredParts, declared_family, parse_parts
from llmrt.families.fused_decode import DecodeKernel
from llmrt.families.layers import (
    GEMM_DTYPE_MIN_ROWS,
    GemmDtypeChoice,
    LinearKernelChoice,
    WeightLayoutChoice,
)
from llmrt.families.prefill_attention import AttentionKernel
from llmrt.kernels.formats import QUANTIZED_FORMATS, WeightFormat
from llmrt.runtime.compiled_step import (
    CompiledOperation,
    CompileMode,
    CompileOptions,
    InductorMode,
)
from llmrt.runtime.config import (
    PREFILL_BATCH_SIZES,
    PagedKVCacheConfig,
    TraceConfig,
    WarmupConfig,
)
from llmrt.runtime.prefill.buckets import FINE_DEFAULT_STEP, SeqLenBuckets
from llmrt.runtime.prefill.plan import WaveRules

CheckpointFormat = Literal["random", "safetensors", "gguf"]
CheckpointDType = Literal["float32", "bfloat16"]
#: ``checkpoint.requantize``: what a GGUF tensor of a type without a kernel becomes.
RequantizeKind = Literal["q8_0"]
TokenizerSource = Literal["checkpoint", "byte", "path"]
Backend = Literal["torch", "ttnn"]
DeviceKind = Literal["cpu", "cuda"]
SeqLenBucketKind = Literal["tile", "fine"]

#: A value in ``Recipe.model``: what a Hugging Face ``config.json`` holds.
ModelValue: TypeAlias = int | float | str | bool | list[Any] | dict[str, Any] | None
ModelConfig: TypeAlias = dict[str, ModelValue]

#: Entry-point group families register under (``llmrt.families.registry`` reads it).
FAMILY_ENTRY_POINT_GROUP = "llmrt.families"
#: ``family: auto`` picks the family from the checkpoint's ``model_type``.
AUTO_FAMILY = "auto"

#: Size of the byte tokenizer's vocabulary: 256 bytes, then bos (256) and eos (257).
BYTE_TOKENIZER_VOCAB_SIZE = 258
#: ``serving.max_num_batched_tokens`` on the CPU. Every decode row waits for the step's
#: prefill, and a CPU prefills a few hundred to a few thousand tokens a second: on a 2-core
#: Zen 4 a 2048-token step stalled every stream of a Llama-3.2-1B-shaped Q4_K_M for ~7.5 s
#: (``llmrt bench --workload mixed``: ITL p99 8.7 s; at 512 tokens 2.5 s, TTFT p50 27 against
#: 33 s, 27.7 against 25.8-26.9 tokens/s) and SmolLM2's for ~1.3 s (its mixed ITL p99 1.2-1.3
#: against 0.35-0.43 s, tokens/s within the runs' spread); at 512 rows the prompt GEMMs
#: already run at full rate.
CPU_STEP_TOKENS = 512
#: ``serving.max_num_batched_tokens`` on CUDA and ttnn, where a 2048-token prefill takes
#: milliseconds and larger steps keep the device busy.
ACCELERATOR_STEP_TOKENS = 2048


def _check(ok: bool, field: str, value: Any, reason: str) -> None:
    if not ok:
        raise RecipeError(field, value, reason)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(field: str, value: Any) -> None:
    _check(_is_int(value) and value > 0, field, value, "must be a positive integer")


def _non_negative_int(field: str, value: Any) -> None:
    _check(_is_int(value) and value >= 0, field, value, "must be a non-negative integer")


def _bool(field: str, value: Any) -> None:
    _check(isinstance(value, bool), field, value, "must be true or false")


def _one_of(field: str, value: Any, literal: Any) -> None:
    choices = get_args(literal)
    _check(isinstance(value, str) and value in choices, field, value, f"must be one of {choices}")


def _optional_str(field: str, value: Any) -> None:
    _check(value is None or isinstance(value, str), field, value, "must be a string or null")


def _brief(values: tuple[int, ...]) -> str:
    shown = ", ".join(map(str, values[:6]))
    return f"{shown}, ..., {values[-1]}" if len(values) > 6 else shown


def registered_families() -> tuple[str, ...]:
    """Family names a recipe may use: ``auto`` and every installed or registered family."""
    return (AUTO_FAMILY, *family_registry.family_names())


def _model_value(model: dict[str, Any], item: str) -> Any:
    """The value at a dotted/indexed ``item`` path inside ``model`` (None if absent)."""
    head = item.split(".", 1)[0].split("[", 1)[0]
    return model.get(head)


def check_model_value(field: str, value: Any) -> None:
    """Raise unless ``value`` is config.json-like: scalars, lists and string-keyed maps."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_model_value(f"{field}[{i}]", item)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            _check(isinstance(key, str), field, key, "keys must be strings")
            check_model_value(f"{field}.{key}", item)
        return
    raise RecipeError(field, value, "must be a number, string, boolean, null, list or mapping")


@attrs.frozen(kw_only=True)
class CheckpointSpec:
    """Where the weights come from.

    ``random``: seeded weights shaped by ``Recipe.model``. ``safetensors``: a local
    Hugging Face checkpoint directory (``path``). ``gguf``: a file (``path``) or a
    file inside an installed package (``package`` + ``file``). ``dtype`` is the
    compute dtype the weights are materialised in. ``weights`` is how linear weights are
    stored: ``float32`` / ``bfloat16`` (the compute dtype; null means ``dtype``), ``int8`` /
    ``int4`` (ggml Q8_0 / Q4_1 blocks quantized at load), or ``gguf-native`` (a GGUF's own
    blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16), never dequantized to
    a float copy). Quantized weights run llmrt's CPU kernels with float32 activations.
    ``requantize`` (``gguf-native`` only): ``q8_0`` requantizes a GGUF tensor of a type the
    kernels do not run (Q2_K, Q3_K, IQ*, ...) once at load, with a warning, cached; null
    makes such a tensor an error naming it and its type.
    """

    format: CheckpointFormat
    path: str | None = None
    package: str | None = None
    file: str | None = None
    seed: int = 0
    dtype: CheckpointDType = "float32"
    weights: WeightFormat | None = None
    requantize: RequantizeKind | None = None

    @property
    def weight_format(self) -> WeightFormat:
        """The weight format in force (``weights``, null resolved to ``dtype``)."""
        return self.weights if self.weights is not None else self.dtype

    def __attrs_post_init__(self) -> None:
        _one_of("checkpoint.format", self.format, CheckpointFormat)
        self._check_weights()
        for name in ("path", "package", "file"):
            _optional_str(f"checkpoint.{name}", getattr(self, name))
        _non_negative_int("checkpoint.seed", self.seed)
        _one_of("checkpoint.dtype", self.dtype, CheckpointDType)
        if self.requantize is not None:
            _one_of("checkpoint.requantize", self.requantize, RequantizeKind)
            _check(
                self.weights == "gguf-native",
                "checkpoint.requantize",
                self.requantize,
                "requantizes tensors a GGUF keeps in blocks without a kernel; it needs "
                f"checkpoint.weights=gguf-native (got {self.weights})",
            )
        if self.format == "random":
            for name in ("path", "package", "file"):
                _check(
                    getattr(self, name) is None,
                    f"checkpoint.{name}",
                    getattr(self, name),
                    "is not used by checkpoint.format=random (dims go under model:)",
                )
        elif self.format == "safetensors":
            _check(
                bool(self.path),
                "checkpoint.path",
                self.path,
                "is required for checkpoint.format=safetensors (a Hugging Face checkpoint "
                "directory): pass --set checkpoint.path=DIR",
            )
            for name in ("package", "file"):
                _check(
                    getattr(self, name) is None,
                    f"checkpoint.{name}",
                    getattr(self, name),
                    "is only used by checkpoint.format=gguf",
                )
        elif self.path:
            _check(
                self.package is None and self.file is None,
                "checkpoint.path",
                self.path,
                "give either checkpoint.path or checkpoint.package + checkpoint.file, not both",
            )
        else:
            _check(
                bool(self.package),
                "checkpoint.package",
                self.package,
                "checkpoint.format=gguf needs checkpoint.path, or checkpoint.package "
                "+ checkpoint.file (a file inside an installed package)",
            )
            _check(
                bool(self.file),
                "checkpoint.file",
                self.file,
                f"names the GGUF file inside package {self.package!r} and is required "
                "without checkpoint.path",
            )

    def _check_weights(self) -> None:
        if self.weights is None:
            return
        _one_of("checkpoint.weights", self.weights, WeightFormat)
        if self.weights in QUANTIZED_FORMATS:
            _check(
                self.dtype == "float32",
                "checkpoint.weights",
                self.weights,
                f"quantized weights compute in float32; set checkpoint.dtype=float32 "
                f"(got {self.dtype})",
            )
        else:
            _check(
                self.weights == self.dtype,
                "checkpoint.weights",
                self.weights,
                f"float weights are stored in the compute dtype checkpoint.dtype={self.dtype}; "
                "set both alike (or leave weights null)",
            )
        _check(
            self.weights != "gguf-native" or self.format == "gguf",
            "checkpoint.weights",
            self.weights,
            f"gguf-native keeps a GGUF file's blocks; checkpoint.format is {self.format} "
            "(use int8 or int4 to quantize a float checkpoint)",
        )


@attrs.frozen(kw_only=True)
class TokenizerSpec:
    """The tokenizer: the checkpoint's own, the byte tokenizer, or a ``tokenizer.json`` path."""

    source: TokenizerSource = "checkpoint"
    path: str | None = None

    def __attrs_post_init__(self) -> None:
        _one_of("tokenizer.source", self.source, TokenizerSource)
        _optional_str("tokenizer.path", self.path)
        if self.source == "path":
            _check(
                bool(self.path),
                "tokenizer.path",
                self.path,
                "is required for tokenizer.source=path",
            )
        else:
            _check(
                self.path is None,
                "tokenizer.path",
                self.path,
                "is only used with tokenizer.source=path",
            )


@attrs.frozen(kw_only=True)
class InductorSpec:
    """``torch.compile`` options used when ``device.compile`` is ``inductor``.

    ``operations`` are the steps compiled; the others run eagerly. Decode is where
    compiling pays (small, memory-bound steps); a prefill step is dominated by its GEMMs
    and costs a compile per warmed geometry. ``precompiled`` keeps each traced CPU step on
    disk so later starts load it instead of re-tracing (not with ``freezing``).
    """

    freezing: bool = False
    max_autotune: bool = False
    mode: InductorMode | None = None
    operations: tuple[CompiledOperation, ...] = ("decode", "prefill")
    precompiled: bool = True

    def __attrs_post_init__(self) -> None:
        _bool("device.inductor.freezing", self.freezing)
        _bool("device.inductor.precompiled", self.precompiled)
        _bool("device.inductor.max_autotune", self.max_autotune)
        if self.mode is not None:
            _one_of("device.inductor.mode", self.mode, InductorMode)
        _check(
            isinstance(self.operations, tuple) and len(self.operations) > 0,
            "device.inductor.operations",
            self.operations,
            "must list at least one of decode, prefill (or set device.compile: eager)",
        )
        for i, op in enumerate(self.operations):
            _one_of(f"device.inductor.operations[{i}]", op, CompiledOperation)
        _check(
            len(set(self.operations)) == len(self.operations),
            "device.inductor.operations",
            list(self.operations),
            "lists an operation twice",
        )


TtnnWeightDtype = Literal["bfloat8_b", "bfloat16"]


@attrs.frozen(kw_only=True)
class TtnnSpec:
    """How the ttnn mesh is opened (``device.ttnn``; only with ``device.backend: ttnn``).

    ``l1_small_size``/``trace_region_size`` are bytes reserved per chip (ttnn's
    ``open_mesh_device`` arguments; traces need a trace region), ``num_command_queues`` is 1
    or 2, ``dispatch_core_type`` picks the dispatch cores (None: ttnn's default, worker),
    ``fabric_config`` is passed to ``ttnn.set_fabric_config`` before the mesh opens (a fabric
    needs two chips or more; None: ``fabric_1d`` when a lane's layers are tensor-parallel,
    whose all-gathers and reduce-scatters need it, else ``disabled``, ttnn's default).
    ``tensor_parallel`` is the chips each lane's model splits its layers over (column/row
    sharded weights, KV heads split, as tt_transformers lays out N300, T3K and a Galaxy row):
    ``lanes * tensor_parallel`` must be the mesh's chips and a lane spans one mesh row (1xN)
    or whole rows (a 2-D lane: weights split over all its chips, collectives along each mesh
    axis); None: the mesh's chips over ``lanes``. So ``[1, 2]`` is one 2-chip lane (N300),
    ``[1, 8]`` one 8-chip lane (T3K), ``[4, 8]`` with ``lanes: 4`` four 1x8 lanes (Galaxy)
    or with ``lanes: 1`` one 4x8 lane of 32 chips.
    ``module`` is the ttnn implementation: ``ttnn`` (the installed wheel, a chip) or a name
    registered in the ``llmrt.ttnn_modules`` entry-point group (``emulator``:
    ``llmrt.testing``'s computing ttnn emulator, as strict as the chip, for running a TT
    recipe without one).
    ``weight_dtype`` is what a decoder family's matmul weights (projections, MLP, LM head)
    are converted to once at load: ``bfloat8_b`` (tt_transformers' choice) or ``bfloat16``;
    norms and the embedding stay bfloat16.
    """

    l1_small_size: int = 0
    trace_region_size: int = DEFAULT_TRACE_REGION_SIZE
    num_command_queues: int = 1
    dispatch_core_type: DispatchCoreType | None = None
    fabric_config: FabricConfigName | None = None
    tensor_parallel: int | None = None
    module: str = "ttnn"
    weight_dtype: TtnnWeightDtype = "bfloat8_b"

    def __attrs_post_init__(self) -> None:
        _check(
            isinstance(self.module, str) and bool(self.module.strip()),
            "device.ttnn.module",
            self.module,
            "must be ttnn or a name registered in llmrt.ttnn_modules (e.g. emulator)",
        )
        _non_negative_int("device.ttnn.l1_small_size", self.l1_small_size)
        _non_negative_int("device.ttnn.trace_region_size", self.trace_region_size)
        _check(
            _is_int(self.num_command_queues) and self.num_command_queues in (1, 2),
            "device.ttnn.num_command_queues",
            self.num_command_queues,
            "must be 1 or 2",
        )
        if self.dispatch_core_type is not None:
            _one_of("device.ttnn.dispatch_core_type", self.dispatch_core_type, DispatchCoreType)
        if self.fabric_config is not None:
            _one_of("device.ttnn.fabric_config", self.fabric_config, FabricConfigName)
        if self.tensor_parallel is not None:
            _positive_int("device.ttnn.tensor_parallel", self.tensor_parallel)
        _one_of("device.ttnn.weight_dtype", self.weight_dtype, TtnnWeightDtype)


@attrs.frozen(kw_only=True)
class DeviceSpec:
    """Backend and placement.

    ``kind``/``index`` pick a torch device (``kind`` None means cpu); ``mesh_shape`` is
    the ttnn mesh (rows, cols) the lanes split. ``num_threads`` sets torch's intra-op
    threads (None keeps torch's default). ``linear`` picks the matmul kernel of the
    model's linear layers (``auto``: oneDNN for float32 on CPU, aten otherwise).
    ``decode_kernel`` picks how CPU decode steps run (``auto``: one fused C++ op per decoder
    layer where the layer's parts allow it; ``fused``: required; ``ops``: torch ops).
    ``gemm_dtype`` is the dtype GEMMs over block-quantized weights (prefill, large decode
    batches) multiply in: ``float32``, or ``bfloat16`` (twice the rate on AMD Zen 4 or AMX
    CPUs, slower than float32 on Intel without AMX; logits within ~0.5 instead of 5e-3 of the
    float32 reference on SmolLM2), or ``int8`` (activations quantized in one 8-bit level as
    llama.cpp does, multiplied with the weights' integer quants: the fastest prefill on x86
    CPUs without AMX, Zen 4 included; kinds without that kernel take bfloat16 where it is
    faster than float32, else float32) for GEMMs of ``gemm_dtype_min_rows`` rows or more
    (fewer stay float32: short prompts keep the reference's greedy tokens where its top two
    logits are close; a decode batch whose linears would multiply in ``gemm_dtype`` leaves
    the fused op, which keeps the float32 / two-level numerics, for the torch ops: int8 from
    ``max(gemm_dtype_min_rows, 16)`` rows); ``auto``: ``bfloat16`` on AMX, else ``int8`` on x86
    from AVX2, else ``bfloat16`` where it is faster, else ``float32``
    (``llmrt.families.layers.resolve_gemm_dtype``; logged as ``weights.placed``).
    ``weight_layout`` orders the blocks of block-quantized weights (``auto``: Q4 blocks, and
    Q8_0 on Intel CPUs, interleaved for the integer-dot kernels on CPUs with AVX-512 VNNI, whose
    two-level 8-bit activations keep logits within ~1e-2 of the float32 reference on SmolLM2;
    ``ggml``: the file's order, float32 activations).
    ``attention_kernel`` picks what runs a prefill's causal attention and RoPE (``auto``:
    llmrt's C++ kernels on CPUs with AVX-512 for float32 head_dim 16, 32, 64 or 128, else
    torch's SDPA and ops; ``native``: required; ``sdpa``: torch's).
    ``retain_freed_memory`` keeps freed host memory mapped for reuse (glibc thresholds, see
    ``llmrt.device.host_memory``; applied once per process when a CPU device opens): without
    it every large prefill temporary page-faults in afresh. ``huge_pages`` copies a CPU
    model's weights, once at build, into a mapping advised onto transparent huge pages (see
    ``llmrt.device.huge_pages``; logged as ``weights.placed``): a decode step streams every
    weight, and on 4 KiB pages it crosses a page boundary, a TLB miss and a prefetcher
    restart, every 4 KiB (``kv_cache.huge_pages`` does the same for the KV pools). ``ttnn``
    holds the options the ttnn mesh is opened with.
    """

    backend: Backend = "torch"
    kind: DeviceKind | None = None
    index: int = 0
    mesh_shape: tuple[int, int] | None = None
    compile: CompileMode = "eager"
    inductor: InductorSpec = attrs.Factory(InductorSpec)
    num_threads: int | None = None
    linear: LinearKernelChoice = "auto"
    decode_kernel: DecodeKernel = "auto"
    attention_kernel: AttentionKernel = "auto"
    gemm_dtype: GemmDtypeChoice = "float32"
    gemm_dtype_min_rows: int = GEMM_DTYPE_MIN_ROWS
    weight_layout: WeightLayoutChoice = "auto"
    retain_freed_memory: bool = True
    huge_pages: bool = True
    ttnn: TtnnSpec = attrs.Factory(TtnnSpec)

    def compile_options(self, *, cache_dir: Path | None = None) -> CompileOptions:
        """The runtime's compile options this section selects."""
        return CompileOptions(
            mode=self.compile,
            freezing=self.inductor.freezing,
            max_autotune=self.inductor.max_autotune,
            inductor_mode=self.inductor.mode,
            cache_dir=cache_dir,
            operations=tuple(self.inductor.operations),
            precompiled=self.inductor.precompiled,
        )

    def __attrs_post_init__(self) -> None:
        _one_of("device.backend", self.backend, Backend)
        _one_of("device.linear", self.linear, LinearKernelChoice)
        _one_of("device.decode_kernel", self.decode_kernel, DecodeKernel)
        _one_of("device.attention_kernel", self.attention_kernel, AttentionKernel)
        _one_of("device.gemm_dtype", self.gemm_dtype, GemmDtypeChoice)
        _positive_int("device.gemm_dtype_min_rows", self.gemm_dtype_min_rows)
        _one_of("device.weight_layout", self.weight_layout, WeightLayoutChoice)
        if self.kind is not None:
            _one_of("device.kind", self.kind, DeviceKind)
        _non_negative_int("device.index", self.index)
        _one_of("device.compile", self.compile, CompileMode)
        _check(
            isinstance(self.inductor, InductorSpec),
            "device.inductor",
            self.inductor,
            "must be an inductor section",
        )
        if self.num_threads is not None:
            _positive_int("device.num_threads", self.num_threads)
            _check(
                self.num_threads <= MAX_NUM_THREADS,
                "device.num_threads",
                self.num_threads,
                f"must be at most {MAX_NUM_THREADS} (more than the machine's CPUs only slows a "
                "step; torch cannot start that many threads)",
            )
        _bool("device.retain_freed_memory", self.retain_freed_memory)
        _bool("device.huge_pages", self.huge_pages)
        _check(isinstance(self.ttnn, TtnnSpec), "device.ttnn", self.ttnn, "must be a ttnn section")
        if self.backend == "torch":
            _check(
                self.mesh_shape is None,
                "device.mesh_shape",
                self.mesh_shape,
                "is only used with device.backend=ttnn",
            )
            _check(
                self.ttnn == TtnnSpec(),
                "device.ttnn",
                self.ttnn,
                "is only used with device.backend=ttnn",
            )
            _check(
                self.kind == "cuda" or self.index == 0,
                "device.index",
                self.index,
                "must be 0 for a cpu device",
            )
            _check(
                self.kind != "cuda" or self.linear != "onednn",
                "device.linear",
                self.linear,
                "onednn is a cpu kernel (use auto or aten with device.kind=cuda)",
            )
            _check(
                self.kind != "cuda" or self.weight_layout != "interleaved",
                "device.weight_layout",
                self.weight_layout,
                "interleaved is a cpu layout (use auto or ggml with device.kind=cuda)",
            )
            _check(
                self.kind != "cuda" or self.decode_kernel != "fused",
                "device.decode_kernel",
                self.decode_kernel,
                "fused is a cpu kernel (use auto or ops with device.kind=cuda)",
            )
            _check(
                self.kind != "cuda" or self.attention_kernel != "native",
                "device.attention_kernel",
                self.attention_kernel,
                "native is a cpu kernel (use auto or sdpa with device.kind=cuda)",
            )
        else:
            _check(
                self.kind is None,
                "device.kind",
                self.kind,
                "is only used with device.backend=torch",
            )
            _check(
                self.compile == "eager",
                "device.compile",
                self.compile,
                "must be eager with device.backend=ttnn",
            )
            _check(
                self.linear == "auto",
                "device.linear",
                self.linear,
                "is only used with device.backend=torch",
            )
            _check(
                self.decode_kernel == "auto",
                "device.decode_kernel",
                self.decode_kernel,
                "is only used with device.backend=torch",
            )
            _check(
                self.weight_layout == "auto",
                "device.weight_layout",
                self.weight_layout,
                "is only used with device.backend=torch",
            )
            _check(
                self.attention_kernel == "auto",
                "device.attention_kernel",
                self.attention_kernel,
                "is only used with device.backend=torch",
            )
            if self.mesh_shape is not None:
                _check(
                    isinstance(self.mesh_shape, tuple) and len(self.mesh_shape) == 2,
                    "device.mesh_shape",
                    self.mesh_shape,
                    "must be [rows, cols]",
                )
                for i, n in enumerate(self.mesh_shape):
                    _positive_int(f"device.mesh_shape[{i}]", n)

    @property
    def torch_device(self) -> str:
        """The torch device string (``cpu`` or ``cuda:N``) for the torch backend."""
        return f"cuda:{self.index}" if self.kind == "cuda" else "cpu"


@attrs.frozen(kw_only=True)
class PrefillSpec:
    """Prefill policy: chunk size, batched padded waves, and padded-length buckets.

    ``seq_len_buckets`` is ``tile`` (powers of two from 128: fewer programs) or ``fine``
    (multiples of ``fine_step``: less padding, more programs); both cap at
    ``max_chunk_size``, since longer prefills are chunked. ``wave_rules`` is ``spec`` (a
    bucket with a prefix-cached prompt, or more prompts than the largest wave, runs row
    by row), ``packed`` (cached prompts join waves; a large bucket becomes several
    waves) or ``ragged`` (``packed``, and prompts of any lengths within a chunk share a
    wave, whose real tokens the model runs packed: eager torch prefill only); None picks
    ragged for eager prefill on the CPU, packed for other torch prefill and spec for
    ttnn, whose batched prefill takes one start offset for the whole wave.
    """

    max_chunk_size: int = 512
    batched: bool = True
    max_batch_size: int = 8
    seq_len_buckets: SeqLenBucketKind = "tile"
    fine_step: int = FINE_DEFAULT_STEP
    wave_rules: WaveRules | None = None

    def __attrs_post_init__(self) -> None:
        _positive_int("prefill.max_chunk_size", self.max_chunk_size)
        _bool("prefill.batched", self.batched)
        if self.wave_rules is not None:
            _one_of("prefill.wave_rules", self.wave_rules, WaveRules)
        _check(
            self.max_batch_size in PREFILL_BATCH_SIZES and _is_int(self.max_batch_size),
            "prefill.max_batch_size",
            self.max_batch_size,
            f"must be one of {PREFILL_BATCH_SIZES}",
        )
        _one_of("prefill.seq_len_buckets", self.seq_len_buckets, SeqLenBucketKind)
        _check(
            _is_int(self.fine_step) and self.fine_step > 0 and self.fine_step % 8 == 0,
            "prefill.fine_step",
            self.fine_step,
            "must be a positive multiple of 8",
        )

    def buckets(self, *, max_len: int | None = None) -> SeqLenBuckets:
        """The padded-length policy these settings select (``llmrt.runtime.prefill.buckets``),
        up to ``max_chunk_size`` or the narrower chunk ``max_len`` a page table allows."""
        return SeqLenBuckets.named(
            self.seq_len_buckets,
            max_len=self.max_chunk_size if max_len is None else max_len,
            step=self.fine_step,
        )


@attrs.frozen(kw_only=True)
class DecodeSpec:
    """Decode policy: fixed slots per lane, physical step batches, on-device sampling.

    ``batch_sizes`` are the decode batches warmed (one program and trace each; CUDA decode
    one per page-table width too, ``DecodeRuntimeConfig.widths``), the lane
    capacity always among them; a step pads its rows to the smallest that holds them.
    None: powers of two up to ``lane_capacity`` on the torch backend, ``lane_capacity``
    alone on ttnn.
    """

    lane_capacity: int = 32
    device_sampling: bool = True
    batch_sizes: tuple[int, ...] | None = None

    def __attrs_post_init__(self) -> None:
        _positive_int("decode.lane_capacity", self.lane_capacity)
        _bool("decode.device_sampling", self.device_sampling)
        if self.batch_sizes is not None:
            sizes = self.batch_sizes
            _check(
                isinstance(sizes, tuple)
                and all(_is_int(b) and 0 < b <= self.lane_capacity for b in sizes)
                and list(sizes) == sorted(set(sizes)),
                "decode.batch_sizes",
                list(sizes) if isinstance(sizes, tuple) else sizes,
                f"must be increasing positive integers up to decode.lane_capacity="
                f"{self.lane_capacity} (which is always warmed)",
            )


@attrs.frozen(kw_only=True)
class ServingSpec:
    """Serving-layer limits: prefix cache, per-step token budget, context and sequence caps.

    ``max_num_batched_tokens`` is the prompt tokens one scheduler step may prefill beside its
    decode rows, so it bounds how long a step keeps every streaming request waiting; None
    follows the device (``Recipe.max_num_batched_tokens``: ``CPU_STEP_TOKENS`` on the CPU,
    ``ACCELERATOR_STEP_TOKENS`` elsewhere, at least ``prefill.max_chunk_size``).
    ``max_model_len`` None follows the KV cache (``Recipe.max_model_len``: at most
    ``DEFAULT_MAX_MODEL_LEN`` tokens, fewer where ``kv_cache`` holds fewer; the runtime also
    keeps it within the model's positions).
    ``max_num_seqs`` None means every decode slot (``lanes * decode.lane_capacity``).
    ``max_waiting`` bounds the requests ``llmrt serve`` queues behind the running ones;
    one more is refused with HTTP 429 instead of queueing without limit.
    """

    prefix_caching: bool = True
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_waiting: int = 256

    def __attrs_post_init__(self) -> None:
        _bool("serving.prefix_caching", self.prefix_caching)
        if self.max_num_batched_tokens is not None:
            _positive_int("serving.max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_model_len is not None:
            _positive_int("serving.max_model_len", self.max_model_len)
        if self.max_num_seqs is not None:
            _positive_int("serving.max_num_seqs", self.max_num_seqs)
        _positive_int("serving.max_waiting", self.max_waiting)


#: ``device.num_threads`` beyond this is refused (torch crashes starting ~100k threads);
#: at run time a count above the CPUs this process may use is lowered to them, with a warning.
MAX_NUM_THREADS = 1024

#: ``serving.max_model_len`` when unset and the KV cache holds at least this many tokens.
DEFAULT_MAX_MODEL_LEN = 4096


def _default_kv_cache() -> PagedKVCacheConfig:
    return PagedKVCacheConfig(block_size=32, max_num_blocks=2048)


@attrs.frozen(kw_only=True)
class Recipe:
    """A validated, declarative description of one model deployment.

    ``model`` holds Hugging Face ``config.json`` keys; it shapes a ``random``
    checkpoint and must stay empty for the other formats (their config comes from
    the checkpoint). Treat it as read-only.
    """

    name: str
    description: str = ""
    family: str = AUTO_FAMILY
    checkpoint: CheckpointSpec
    model: ModelConfig = attrs.Factory(dict)
    tokenizer: TokenizerSpec = attrs.Factory(TokenizerSpec)
    device: DeviceSpec = attrs.Factory(DeviceSpec)
    lanes: int = 1
    kv_cache: PagedKVCacheConfig = attrs.Factory(_default_kv_cache)
    prefill: PrefillSpec = attrs.Factory(PrefillSpec)
    decode: DecodeSpec = attrs.Factory(DecodeSpec)
    trace: TraceConfig = attrs.Factory(TraceConfig)
    warmup: WarmupConfig = attrs.Factory(WarmupConfig)
    serving: ServingSpec = attrs.Factory(ServingSpec)

    def __attrs_post_init__(self) -> None:
        self._check_sections()
        self._check_identity()
        self._check_model()
        self._check_tokenizer()
        self._derive_tensor_parallel()
        self._check_placement()
        self._derive_warmup()
        self._check_family_backend()
        self._check_geometry()

    @property
    def decode_slots(self) -> int:
        """Decode slots over all lanes."""
        return self.lanes * self.decode.lane_capacity

    @property
    def decode_batch_sizes(self) -> tuple[int, ...]:
        """The physical decode batches in force (``decode.batch_sizes``, None resolved)."""
        cap = self.decode.lane_capacity
        if self.decode.batch_sizes is not None:
            return (*(b for b in self.decode.batch_sizes if b < cap), cap)
        if self.device.backend != "torch":
            return (cap,)
        return (*(1 << i for i in range(cap.bit_length()) if 1 << i < cap), cap)

    @property
    def prefill_runs_eagerly(self) -> bool:
        """Whether prefill steps run as eager torch ops (not captured, not compiled): shapes
        may then follow each wave (``prefill.wave_rules: ragged``)."""
        compiled = (
            self.device.compile == "inductor" and "prefill" in self.device.inductor.operations
        )
        return self.device.backend == "torch" and not compiled and not self.trace.prefill_enabled

    @property
    def wave_rules(self) -> WaveRules:
        """The prefill wave rules in force (``prefill.wave_rules``, None resolved): ``ragged``
        for eager prefill on the CPU, ``packed`` for other torch prefill, ``spec`` for ttnn."""
        if self.prefill.wave_rules is None:
            if self.device.backend != "torch":
                return "spec"
            eager_cpu = self.prefill_runs_eagerly and self.device.torch_device == "cpu"
            return "ragged" if eager_cpu else "packed"
        return self.prefill.wave_rules

    @property
    def max_num_batched_tokens(self) -> int:
        """The prompt tokens a scheduler step prefills at most (``serving.
        max_num_batched_tokens``, None resolved by the device: ``CPU_STEP_TOKENS`` on the
        CPU, ``ACCELERATOR_STEP_TOKENS`` on CUDA and ttnn, and never below
        ``prefill.max_chunk_size``, so a larger chunk asked for still runs whole)."""
        if self.serving.max_num_batched_tokens is not None:
            return self.serving.max_num_batched_tokens
        cpu = self.device.backend == "torch" and self.device.torch_device == "cpu"
        return max(CPU_STEP_TOKENS if cpu else ACCELERATOR_STEP_TOKENS, self.prefill.max_chunk_size)

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output) a request may reach: ``serving.
        max_model_len``, or when unset ``DEFAULT_MAX_MODEL_LEN`` within what ``kv_cache``
        holds (a smaller cache makes the default follow rather than fail validation)."""
        if self.serving.max_model_len is not None:
            return self.serving.max_model_len
        return min(DEFAULT_MAX_MODEL_LEN, self.kv_cache.max_capacity_tokens)

    @property
    def max_num_seqs(self) -> int:
        """Concurrent sequences the serving layer admits."""
        return self.serving.max_num_seqs or self.decode_slots

    def _check_sections(self) -> None:
        sections: dict[str, type] = {
            "checkpoint": CheckpointSpec,
            "tokenizer": TokenizerSpec,
            "device": DeviceSpec,
            "kv_cache": PagedKVCacheConfig,
            "prefill": PrefillSpec,
            "decode": DecodeSpec,
            "trace": TraceConfig,
            "warmup": WarmupConfig,
            "serving": ServingSpec,
        }
        for name, cls in sections.items():
            value = getattr(self, name)
            _check(isinstance(value, cls), name, value, f"must be a {cls.__name__}")

    def _check_identity(self) -> None:
        _check(
            isinstance(self.name, str) and bool(self.name.strip()),
            "name",
            self.name,
            "must be a non-empty string",
        )
        _check(
            isinstance(self.description, str), "description", self.description, "must be a string"
        )
        _check(
            isinstance(self.family, str) and bool(self.family),
            "family",
            self.family,
            "must be a family name",
        )
        if self.family == AUTO_FAMILY:
            return
        known = registered_families()
        _check(
            self.family in known,
            "family",
            self.family,
            f"is not a registered model family (known: {', '.join(known)}; plugins "
            f"register under the {FAMILY_ENTRY_POINT_GROUP!r} entry-point group)",
        )

    def _check_model(self) -> None:
        _check(isinstance(self.model, dict), "model", self.model, "must be a mapping")
        for key, value in self.model.items():
            _check(isinstance(key, str), "model", key, "keys must be strings")
            check_model_value(f"model.{key}", value)
        parts = self.declared_parts
        if parts is not None:
            _check(
                self.family == AUTO_FAMILY,
                "family",
                self.family,
                "must be auto when model.parts declares the architecture",
            )
            _check(
                self.checkpoint.format != "gguf",
                "model.parts",
                "...",
                "declares parts for random or safetensors checkpoints (a GGUF file's "
                "architecture comes from its header)",
            )
        if self.checkpoint.format != "random":
            config = {key: value for key, value in self.model.items() if key != "parts"}
            _check(
                not config,
                "model",
                config,
                f"is only used by checkpoint.format=random (besides model.parts); a "
                f"{self.checkpoint.format} checkpoint brings its own config",
            )
            return
        model_type = self.model.get("model_type")
        if not isinstance(model_type, str) or not model_type:
            raise RecipeError(
                "model.model_type",
                model_type,
                "is required for checkpoint.format=random (e.g. llama or gpt2)",
            )
        family = self._model_family(model_type)
        for key in family_registry.required_keys(family):
            _check(
                key in self.model,
                f"model.{key}",
                None,
                f"is required for a random {model_type} checkpoint",
            )
            self._model_int(key)
        config = {"vocab_size": BYTE_TOKENIZER_VOCAB_SIZE, **self.model}
        try:
            family.expected_tensors(config)
        except CheckpointError as exc:
            item = exc.item.removeprefix("config.")
            value = _model_value(self.model, item)
            # The family's reason may already end with the value (", got 2"): say it once.
            reason = exc.reason.removesuffix(f", got {value!r}")
            raise RecipeError(f"model.{item}", value, reason) from exc
        except RecipeError:
            raise
        except ConfigError as exc:
            raise RecipeError(
                "model", model_type, f"maps onto invalid parts: {exc.field}: {exc.reason}"
            ) from exc
        except (KeyError, TypeError, ValueError) as exc:
            raise RecipeError(
                "model", model_type, f"family {family.name} cannot read it: {exc}"
            ) from exc

    @property
    def declared_parts(self) -> DeclaredParts | None:
        """``model.parts`` validated (None when the recipe declares no parts)."""
        if "parts" not in self.model:
            return None
        return parse_parts(self.model["parts"])

    def family_for(self, model_type: str) -> Family:
        """The family that builds this recipe's checkpoint of ``model_type``: the one its
        ``model.parts`` declare, the one ``family`` names, or (``auto``) the one that claims
        ``model_type`` (``FamilyError`` when none does)."""
        parts = self.declared_parts
        if parts is not None:
            return declared_family(parts, model_type=model_type)
        if self.family == AUTO_FAMILY:
            return family_registry.family_for_model_type(model_type)
        return family_registry.get_family(self.family)

    def _model_family(self, model_type: str) -> Any:
        """The family that will build this random model, checked against ``family``."""
        if "parts" in self.model:
            return self.family_for(model_type)
        try:
            if self.family == AUTO_FAMILY:
                return family_registry.family_for_model_type(model_type)
            family = family_registry.get_family(self.family)
        except FamilyError as exc:
            raise RecipeError("model.model_type", model_type, str(exc)) from exc
        hint = family_registry.claimed_by(model_type) or "; use family: auto or one that does"
        _check(
            model_type in family.model_types,
            "model.model_type",
            model_type,
            f"is not handled by family {self.family} (it handles "
            f"{', '.join(family.model_types)}){hint}",
        )
        return family

    def _model_int(self, key: str) -> int:
        value = self.model.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        raise RecipeError(f"model.{key}", value, "must be a positive integer")

    def _check_tokenizer(self) -> None:
        source, fmt = self.tokenizer.source, self.checkpoint.format
        if source == "byte":
            _check(
                fmt == "random",
                "tokenizer.source",
                source,
                f"byte is only for random checkpoints; a {fmt} checkpoint has its own "
                "tokenizer (use checkpoint)",
            )
            vocab = self._model_int("vocab_size")
            _check(
                vocab >= BYTE_TOKENIZER_VOCAB_SIZE,
                "model.vocab_size",
                vocab,
                f"must be at least {BYTE_TOKENIZER_VOCAB_SIZE} for the byte tokenizer "
                "(256 bytes + bos + eos)",
            )
        elif source == "checkpoint":
            _check(
                fmt != "random",
                "tokenizer.source",
                source,
                "a random checkpoint has no tokenizer; use byte or path",
            )

    def _check_placement(self) -> None:
        _positive_int("lanes", self.lanes)
        ttnn_dequantizes = (
            self.device.backend == "ttnn" and self.checkpoint.weight_format == "gguf-native"
        )
        if self.checkpoint.weight_format in QUANTIZED_FORMATS and not ttnn_dequantizes:
            device = self.device
            where = device.backend if device.backend != "torch" else f"torch {device.kind}"
            _check(
                device.backend == "torch" and device.kind in (None, "cpu"),
                "checkpoint.weights",
                self.checkpoint.weights,
                f"quantized weights run llmrt's CPU kernels (device.backend=torch, "
                f"device.kind=cpu); this recipe runs on {where} (on ttnn, gguf-native "
                f"blocks are dequantized once at load)",
            )
        _check(
            self.device.gemm_dtype in ("float32", "auto")
            or self.checkpoint.weight_format in QUANTIZED_FORMATS,
            "device.gemm_dtype",
            self.device.gemm_dtype,
            f"applies to block-quantized weights; checkpoint.weights is "
            f"{self.checkpoint.weight_format} (use int8, int4 or gguf-native)",
        )
        _check(
            self.device.weight_layout != "interleaved"
            or self.checkpoint.weight_format in QUANTIZED_FORMATS,
            "device.weight_layout",
            self.device.weight_layout,
            f"orders block-quantized weights; checkpoint.weights is "
            f"{self.checkpoint.weight_format} (use int8, int4 or gguf-native, or auto)",
        )
        _check(
            self.device.backend == "torch" or self.prefill.wave_rules not in ("packed", "ragged"),
            "prefill.wave_rules",
            self.prefill.wave_rules,
            f"{self.prefill.wave_rules} needs device.backend=torch (a ttnn wave has one start "
            "offset)",
        )
        _check(
            self.prefill.wave_rules != "ragged" or self.prefill_runs_eagerly,
            "prefill.wave_rules",
            self.prefill.wave_rules,
            "ragged needs eager prefill steps (trace.mode=all captures, and device.compile="
            "inductor with prefill in device.inductor.operations compiles, one fixed shape "
            "per wave; use packed)",
        )
        mesh = self.device.mesh_shape
        if self.device.backend == "ttnn":
            tt = self.device.ttnn
            chips = math.prod(mesh) if mesh is not None else self.lanes
            _check(
                tt.fabric_config == "disabled" or chips >= 2,
                "device.ttnn.fabric_config",
                tt.fabric_config,
                f"needs a mesh of two chips or more (this recipe opens {chips})",
            )
            _check(
                not self.trace.enabled or tt.trace_region_size > 0,
                "device.ttnn.trace_region_size",
                tt.trace_region_size,
                f"must be positive when trace.mode={self.trace.mode} captures traces",
            )
        if self.device.backend == "ttnn" and mesh is not None:
            chips = math.prod(mesh)
            _check(
                chips % self.lanes == 0,
                "lanes",
                self.lanes,
                f"must divide the {chips} chips of device.mesh_shape={list(mesh)} "
                "into equal lane sub-meshes",
            )
        if self.device.backend == "ttnn":
            self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        """A lane is ``tensor_parallel`` chips of one mesh row or whole rows, the lanes cover
        the mesh, and tensor-parallel lanes have a fabric for their collectives."""
        tt, mesh = self.device.ttnn, self.device.mesh_shape
        tp = tt.tensor_parallel
        assert tp is not None  # _derive_tensor_parallel resolved it
        chips = math.prod(mesh) if mesh is not None else self.lanes
        where = (
            f"device.mesh_shape={list(mesh)}" if mesh is not None else "the mesh (one chip a lane)"
        )
        hint = f" (lanes={chips // tp} with tensor_parallel={tp})" if chips % tp == 0 else ""
        _check(
            self.lanes * tp == chips,
            "device.ttnn.tensor_parallel",
            tp,
            f"lanes ({self.lanes}) x tensor_parallel must be the {chips} chips of {where}{hint}",
        )
        if mesh is not None:
            rows, cols = mesh
            _check(
                cols % tp == 0 or rows == 1 or (tp % cols == 0 and rows % (tp // cols) == 0),
                "device.ttnn.tensor_parallel",
                tp,
                f"a tensor-parallel lane spans chips of one mesh row (1xN, as tt_transformers "
                f"lays out N300, T3K and each Galaxy row) or whole rows (a 2-D lane, its "
                f"collectives along each mesh axis); {tp} chips are neither in the {cols} "
                f"columns of {list(mesh)} (use lanes={rows} with tensor_parallel={cols}, "
                "or fewer chips a lane)",
            )
        _check(
            tp == 1 or tt.fabric_config != "disabled",
            "device.ttnn.fabric_config",
            tt.fabric_config,
            f"tensor_parallel={tp} needs a fabric for its all-gathers and reduce-scatters "
            "(fabric_1d, the default for tensor-parallel lanes)",
        )

    def _derive_tensor_parallel(self) -> None:
        """Resolve ``device.ttnn.tensor_parallel`` (None: the chips of a lane) and
        ``device.ttnn.fabric_config`` (None: ``fabric_1d`` for tensor-parallel lanes, else
        ``disabled``); ``_check_placement`` validates what they resolve to."""
        if self.device.backend != "ttnn" or not _is_int(self.lanes) or self.lanes < 1:
            return
        tt = self.device.ttnn
        mesh = self.device.mesh_shape
        chips = math.prod(mesh) if mesh is not None else self.lanes
        tp = tt.tensor_parallel
        if tp is None:
            tp = chips // self.lanes if chips % self.lanes == 0 else 1
        fabric = tt.fabric_config
        if fabric is None:
            fabric = "fabric_1d" if tp > 1 else "disabled"
        if (tp, fabric) != (tt.tensor_parallel, tt.fabric_config):
            ttnn = attrs.evolve(tt, tensor_parallel=tp, fabric_config=fabric)
            object.__setattr__(self, "device", attrs.evolve(self.device, ttnn=ttnn))

    def _derive_warmup(self) -> None:
        """Fit the warmup geometry to the prefill settings it depends on.

        A warmup length is the padded length its prompts run at: a length past
        ``prefill.max_chunk_size`` runs in chunks, so it becomes the largest padded length
        a chunk reaches; any other becomes the padded length it rounds up to. Batch sizes
        past ``prefill.max_batch_size`` or ``decode.lane_capacity`` (a wave holds at most a
        lane's rows) can never form and are dropped (the largest that can is warmed instead
        when none is left). Overriding ``prefill.max_chunk_size``, ``serving.max_model_len``
        (a context shorter than the chunk narrows it, as the page table does at run time) or
        ``decode.lane_capacity`` therefore keeps a recipe valid instead of failing on the
        warmup fields.
        """
        chunk = self._effective_chunk()
        if chunk is None:
            return  # _check_geometry names the field
        lengths = self.prefill.buckets(max_len=chunk).lengths()
        usable = [n for n in lengths if n <= chunk]
        if not usable:
            return  # _check_geometry reports the chunk
        derived = sorted(
            {min((n for n in usable if n >= want), default=usable[-1])
             for want in self.warmup.prefill_seq_lens}
        )  # fmt: skip
        largest = min(self.prefill.max_batch_size, self.decode.lane_capacity)
        batches = [b for b in self.warmup.prefill_batch_sizes if b <= largest]
        if not batches:
            batches = [max(b for b in PREFILL_BATCH_SIZES if b <= largest)]
        if (tuple(derived), tuple(batches)) != (
            tuple(self.warmup.prefill_seq_lens),
            tuple(self.warmup.prefill_batch_sizes),
        ):
            warmup = attrs.evolve(
                self.warmup, prefill_seq_lens=tuple(derived), prefill_batch_sizes=tuple(batches)
            )
            object.__setattr__(self, "warmup", warmup)

    def _effective_chunk(self) -> int | None:
        """The longest chunk a prefill runs: ``prefill.max_chunk_size``, within
        ``max_model_len`` rounded up to whole blocks (the page table's width, as
        ``PageTableLayout`` clamps it); None when the chunk is not whole blocks."""
        block = self.kv_cache.block_size
        if self.prefill.max_chunk_size % block:
            return None
        return min(self.prefill.max_chunk_size, -(-self.max_model_len // block) * block)

    def _check_family_backend(self) -> None:
        """The family (named, or ``auto`` from a random checkpoint's ``model_type``) supports
        ``device.backend``; ``auto`` over a file checkpoint is checked when it is resolved."""
        try:
            if self.family != AUTO_FAMILY or self.checkpoint.format == "random":
                family = self.family_for(str(self.model.get("model_type")))
            elif "parts" in self.model:
                family = self.family_for("")
            else:
                return
        except FamilyError:
            # Not loadable here (a plugin importing ttnn, an unknown model type): the
            # container checks the pair when it resolves the family.
            return
        family_registry.check_family_backend(family, self.device.backend)

    def _check_geometry(self) -> None:
        block = self.kv_cache.block_size
        chunk = self.prefill.max_chunk_size
        _check(
            chunk % block == 0,
            "prefill.max_chunk_size",
            chunk,
            f"must be a multiple of kv_cache.block_size={block}",
        )
        capacity = self.kv_cache.max_capacity_tokens
        _check(
            self.max_model_len <= capacity,
            "serving.max_model_len",
            self.serving.max_model_len,
            f"must fit the KV cache: kv_cache.max_num_blocks * kv_cache.block_size = "
            f"{self.kv_cache.max_num_blocks} * {block} = {capacity} tokens",
        )
        if self.serving.max_num_seqs is not None:
            _check(
                self.serving.max_num_seqs <= self.decode_slots,
                "serving.max_num_seqs",
                self.serving.max_num_seqs,
                f"must not exceed the decode slots lanes * decode.lane_capacity = "
                f"{self.lanes} * {self.decode.lane_capacity} = {self.decode_slots}",
            )
        effective = self._effective_chunk() or chunk
        lengths = self.prefill.buckets(max_len=effective).lengths()
        for i, n in enumerate(self.warmup.prefill_seq_lens):
            _check(
                n <= effective,
                f"warmup.prefill_seq_lens[{i}]",
                n,
                f"must not exceed prefill.max_chunk_size={chunk} within max_model_len="
                f"{self.max_model_len} ({effective}: longer prefills run in chunks, so that "
                "length is never used)",
            )
            _check(
                n in lengths,
                f"warmup.prefill_seq_lens[{i}]",
                n,
                f"is not a padded length of prefill.seq_len_buckets="
                f"{self.prefill.seq_len_buckets} (it pads to {_brief(lengths)})",
            )
        for i, b in enumerate(self.warmup.prefill_batch_sizes):
            _check(
                b <= self.prefill.max_batch_size,
                f"warmup.prefill_batch_sizes[{i}]",
                b,
                f"must not exceed prefill.max_batch_size={self.prefill.max_batch_size}",
            )
