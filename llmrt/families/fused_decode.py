"""Decode steps on the CPU as one C++ call (``llmrt_kernels::DecodeStack.step``).

Why: at batch 1 a layer's weights take ~0.1 ms to stream, while its ~60 eager torch ops
cost ~0.5 ms of dispatch, so an eager decode step is mostly overhead; even the embedding,
RoPE lookup, final norm and LM head as torch ops cost ~0.9 ms of a 6 ms SmolLM2 step. The
call runs the same parts (token embedding, pre-norm RMSNorm or LayerNorm in their bias,
weightless and ``(1 + w)`` forms, fused q/k/v with clipping and per-head q/k norms, RoPE and
the paged K/V write, grouped-query attention over the row's pages, output projection,
sequential or parallel residuals, gated or plain MLP, final norm, LM head) over the same
weights, borrowed from the built modules as stored (ggml blocks or float32).

A model takes the fused path only when every part is one the call implements; otherwise its
decode steps stay on the torch ops and ``DecoderBackbone.fused_decode_status()`` says
``not fused: <part> (<where>)`` for the first part that is not. Prefill, CUDA, compiled steps
and CUDA-graph captures never use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, get_args

import torch

from llmrt.errors import ConfigError, DeviceError
from llmrt.families.decoder_layers import MLP, Attention, DecoderLayer, MoE, Norm
from llmrt.families.layers import (
    ACTIVATIONS,
    Embedding,
    FrozenLinear,
    Linear,
    QuantizedEmbedding,
    QuantizedLinear,
    StackedLinear,
    quantized_linears,
)
from llmrt.families.parts import DecoderSpec
from llmrt.kernels.native import (
    kernels_available,
    kernels_isa,
    kernels_openmp,
    python_entry,
    vector_kernels,
)

if TYPE_CHECKING:
    from llmrt.families.kvbinding import BoundKV


class FusableBackbone(Protocol):
    """What the fused step reads of a backbone; ``decoder.DecoderBackbone`` implements it.

    Declared here so the step depends on the decoder's layer modules only, and the backbone
    (which builds the step) on the step: no import cycle.
    """

    @property
    def spec(self) -> DecoderSpec: ...

    @property
    def embed_tokens(self) -> Embedding: ...

    @property
    def embed_positions(self) -> Embedding | None: ...

    @property
    def layers(self) -> Iterable[torch.nn.Module]: ...

    @property
    def norm(self) -> Norm | None: ...

    @property
    def lm_head(self) -> Linear: ...


#: ``device.decode_kernel``: ``auto`` runs CPU decode steps fused where every layer's parts
#: allow it, ``fused`` requires it (a ``ConfigError`` at build says which part does not),
#: ``ops`` always runs the torch ops.
DecodeKernel = Literal["auto", "fused", "ops"]
DECODE_KERNELS: tuple[str, ...] = get_args(DecodeKernel)
#: Rows from which the torch ops (oneDNN GEMMs, dequantize + GEMM for blocks) beat the op's
#: in-register kernels. Measured on SmolLM2, 2 threads: gguf-native 61 vs 90 ms at 16 rows,
#: 130 vs 135 ms at 32; float32 23.8 vs 42 ms at 1 row, 83 vs 89 ms at 16.
MAX_ROWS_BLOCKS = 32
MAX_ROWS_DENSE = 16
#: Weight kind of a dense float32 matrix (ggml blocks use their type ids).
DENSE_F32 = 0


#: The prefix of the op's page-table bounds error (``decode_layer.cpp``: ``check_bounds``).
BOUNDS_ERROR = "llmrt_kernels.bounds:"


#: Norm kinds of the op (``layer_norm.h``): the ``(1 + w)`` forms are given ``1 + w``.
NORM_KINDS = {"rms": 0, "rms_one_plus": 0, "layer": 1, "layer_one_plus": 1}


class NotFusable(Exception):
    """A part the fused op does not implement: ``part`` names it, ``where`` the module that
    has it (``layers.3``, ``lm_head``); ``str()`` is the status ``not fused: <part>
    (<where>)``."""

    def __init__(self, part: str, where: str = "") -> None:
        super().__init__(part, where)
        self.part = part
        self.where = where

    def at(self, where: str) -> NotFusable:
        """The same refusal inside ``where`` (``layers.3`` around ``mlp``: ``layers.3.mlp``)."""
        return NotFusable(self.part, f"{where}.{self.where}" if self.where else where)

    def __str__(self) -> str:
        return f"not fused: {self.part}" + (f" ({self.where})" if self.where else "")


def _linear(module: Any, field: str) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    if isinstance(module, QuantizedLinear):
        return module.blocks, module.ggml_type, _float_or_none(module.bias, field)
    if isinstance(module, FrozenLinear):
        weight = module.weight
        if weight.dtype != torch.float32 or not weight.is_contiguous():
            raise NotFusable(f"{weight.dtype} weights, not contiguous float32", field)
        return weight.data, DENSE_F32, _float_or_none(module.bias, field)
    if isinstance(module, StackedLinear):  # row ranges in different block kinds
        blob, code, bias = module.packed()
        return blob, code, _float_or_none(bias, field)
    raise NotFusable(f"{type(module).__name__} (not a linear the op runs)", field)


def _float_or_none(bias: torch.Tensor | None, field: str) -> torch.Tensor | None:
    if bias is None:
        return None
    if bias.dtype != torch.float32:
        raise NotFusable(f"{bias.dtype} bias", field)
    return bias.data.contiguous()


class NormArgs(NamedTuple):
    """One norm as the op takes it: the weight row (ones for a weightless LayerNorm, ``1 + w``
    for the ``(1 + w)`` forms; made once here), bias, kind code and eps."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    kind: int
    eps: float


def _norm(norm: Norm | None, field: str, *, width: int) -> NormArgs:
    if norm is None:
        raise NotFusable("a layer without a pre-norm", field)
    if norm.kind not in NORM_KINDS:
        raise NotFusable(f"norm kind {norm.kind}", field)
    weight = norm.weight
    if weight is not None and weight.dim() != 1:
        raise NotFusable("a norm with one weight row per head", field)
    for tensor in (weight, norm.bias):
        if tensor is not None and tensor.dtype != torch.float32:
            raise NotFusable(f"{tensor.dtype} norm weights, not float32", field)
    if weight is None:  # NormSpec: only LayerNorm may have none
        row = torch.ones(width, dtype=torch.float32)
    elif norm.kind.endswith("one_plus"):
        row = (1.0 + weight.data).contiguous()
    else:
        row = weight.data.contiguous()
    bias = None if norm.bias is None else norm.bias.data.contiguous()
    return NormArgs(weight=row, bias=bias, kind=NORM_KINDS[norm.kind], eps=float(norm.eps))


class StackLayer(NamedTuple):
    """One layer's arguments to ``llmrt_kernels.DecodeStack``, in its constructor's order."""

    #: attn_norm, mlp_norm, and the qkv, o, up, down weights (borrowed).
    tensors: tuple[torch.Tensor, ...]
    #: qkv, o, up, down, attn_norm and mlp_norm biases; q_norm and k_norm weights, biases.
    biases: tuple[torch.Tensor | None, ...]
    #: qkv, o, up, down weight kinds; heads, KV heads, head_dim, window, activation, gated,
    #: the RoPE table index (-1: none), attn_norm kind, mlp_norm kind (-1: none, a parallel
    #: layer's MLP reading the attention's normed input), parallel, q/k norm kind (-1: none).
    ints: tuple[int, ...]
    #: eps, attention scale, residual multiplier, mlp_norm eps, q/k/v clip (inf: none), q/k
    #: norm eps.
    floats: tuple[float, ...]


def fused_layer_args(layer: DecoderLayer, *, width: int) -> StackLayer:
    """The stack's arguments for ``layer`` of hidden size ``width`` (weights borrowed), or
    ``NotFusable``."""
    attention = layer.attention
    if type(attention) is not Attention:
        raise NotFusable(f"attention part {type(attention).__name__}")
    if layer.post_attn_norm is not None or layer.post_mlp_norm is not None:
        raise NotFusable("post-attention / post-MLP norms")
    q_norm, k_norm = _qk_norms(attention)
    if attention.softcap is not None:
        raise NotFusable("attention-logit soft-capping")
    if isinstance(layer.mlp, MoE):
        raise NotFusable("mixture-of-experts MLP")
    if type(layer.mlp) is not MLP:
        raise NotFusable(f"mlp part {type(layer.mlp).__name__}")
    if layer.mlp.activation not in ACTIVATIONS:
        raise NotFusable(f"activation {layer.mlp.activation}")
    attn_norm = _norm(layer.attn_norm, "attn_norm", width=width)
    if layer.parallel and layer.mlp_norm is None:
        mlp_norm = NormArgs(weight=attn_norm.weight, bias=None, kind=-1, eps=attn_norm.eps)
    else:
        mlp_norm = _norm(layer.mlp_norm, "mlp_norm", width=width)
    clip = attention.clip_qkv
    linears = [
        _linear(attention.qkv, "qkv"),
        _linear(attention.o, "o"),
        _linear(layer.mlp.up, "up"),
        _linear(layer.mlp.down, "down"),
    ]
    return StackLayer(
        tensors=(attn_norm.weight, mlp_norm.weight, *(weight for weight, _, _ in linears)),
        biases=(
            *(bias for _, _, bias in linears),
            attn_norm.bias,
            mlp_norm.bias,
            None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight,
            None if q_norm is None else q_norm.bias,
            None if k_norm is None else k_norm.bias,
        ),
        ints=(
            *(kind for _, kind, _ in linears),
            attention.num_heads,
            attention.num_kv_heads,
            attention.head_dim,
            int(attention.window or 0),
            ACTIVATIONS[layer.mlp.activation],
            int(bool(layer.mlp.gated)),
            -1 if layer.rope is None else layer.rope,
            attn_norm.kind,
            mlp_norm.kind,
            int(layer.parallel),
            -1 if q_norm is None else q_norm.kind,
        ),
        floats=(
            attn_norm.eps,
            float(attention.scale),
            float(layer.residual_multiplier),
            mlp_norm.eps,
            math.inf if clip is None else float(clip),
            0.0 if q_norm is None else q_norm.eps,
        ),
    )


def _qk_norms(attention: Attention) -> tuple[NormArgs | None, NormArgs | None]:
    """The per-head q/k norms as the op takes them (weight and bias: one ``[head_dim]`` row
    for every head, or one row per head flattened; the same form for q and k), or None;
    ``NotFusable`` for the others."""
    if attention.q_norm is None and attention.k_norm is None:
        return None, None
    if attention.q_norm is None or attention.k_norm is None:
        raise NotFusable("q/k norms on only one of q and k")
    if attention.norm_over_proj:
        raise NotFusable("q/k norms over the whole projection")
    q = _qk_norm(attention.q_norm, "q_norm", head_dim=attention.head_dim)
    k = _qk_norm(attention.k_norm, "k_norm", head_dim=attention.head_dim)
    if (q.kind, q.eps) != (k.kind, k.eps):
        raise NotFusable("q/k norms of different forms")
    return q, k


def _qk_norm(norm: Norm, field: str, *, head_dim: int) -> NormArgs:
    tensors = [t for t in (norm.weight, norm.bias) if t is not None]
    if all(t.dim() == 1 for t in tensors):
        try:
            return _norm(norm, field, width=head_dim)
        except NotFusable as exc:
            raise NotFusable(f"q/k norms: {exc.part}", exc.where) from exc
    if any(t.dim() != 2 or t.shape[-1] != head_dim for t in tensors):
        raise NotFusable("q/k norms with weights not one row per head", field)
    if norm.kind not in NORM_KINDS or any(t.dtype != torch.float32 for t in tensors):
        raise NotFusable(f"q/k norms: norm kind {norm.kind} over {tensors[0].dtype}", field)
    # One weight (and bias) row per head, flattened to [heads * head_dim]: the op reads
    # them as rows per head.
    weight = _rows(norm.weight)
    if weight is None:
        weight = torch.ones(tensors[0].numel(), dtype=torch.float32)
    elif norm.kind.endswith("one_plus"):
        weight = 1.0 + weight
    return NormArgs(
        weight=weight, bias=_rows(norm.bias), kind=NORM_KINDS[norm.kind], eps=float(norm.eps)
    )


def _rows(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.data.reshape(-1).contiguous()


class StackEnds(NamedTuple):
    """The step's ends, in ``DecodeStack.set_ends``'s order (weights borrowed)."""

    #: Token embedding rows (ggml blocks or float32), their kind, and the embedding scale.
    embed: torch.Tensor
    embed_kind: int
    embed_scale: float
    #: Final norm weight row and eps.
    norm: torch.Tensor
    eps: float
    #: LM head weight, kind and bias.
    head: torch.Tensor
    head_kind: int
    head_bias: torch.Tensor | None
    #: Final norm bias and kind (``NORM_KINDS``).
    norm_bias: torch.Tensor | None
    norm_kind: int


def fused_ends_args(backbone: FusableBackbone) -> StackEnds:
    """The embedding and final norm + LM head arguments, or ``NotFusable``."""
    if backbone.embed_positions is not None:
        raise NotFusable("learned position embeddings", "embed_positions")
    vocab = backbone.spec.model.vocab_size
    embed = backbone.embed_tokens
    if isinstance(embed, QuantizedEmbedding):
        table, embed_kind = embed.blocks, embed.ggml_type
    elif embed.weight.dtype == torch.float32 and embed.weight.is_contiguous():
        table, embed_kind = embed.weight.data, DENSE_F32
    else:
        raise NotFusable(
            f"{embed.weight.dtype} embedding rows, not float32 or ggml blocks", "embed_tokens"
        )
    norm = _norm(backbone.norm, "norm", width=backbone.spec.model.hidden_size)
    head, head_kind, head_bias = _linear(backbone.lm_head, "lm_head")
    return StackEnds(
        # Ids past the model's vocabulary read its last row, as the torch path clamps them.
        embed=table[:vocab],
        embed_kind=embed_kind,
        embed_scale=float(backbone.spec.embedding_scale),
        norm=norm.weight,
        eps=norm.eps,
        head=head,
        head_kind=head_kind,
        head_bias=head_bias,
        norm_bias=norm.bias,
        norm_kind=norm.kind,
    )


def gemm_dtype_rows(backbone: Any, *, limit: int) -> int:
    """The fewest decode rows (below ``limit``) at which a block-quantized linear of
    ``backbone`` multiplies in ``device.gemm_dtype`` (``QuantizedLinear.runs_gemm_dtype``),
    else ``limit``. The op keeps the float32 / two-level numerics at every row count, so
    batches from there take the torch ops: ``gemm_dtype_min_rows`` means the same whichever
    path a step runs (a 16-row step of a 1B Q4_K_M under int8 from 16 rows: 180 against 290
    ms fused)."""
    linears = quantized_linears(backbone)
    lowest = min((linear.gemm_dtype_min_rows for linear in linears), default=limit)
    for rows in range(lowest, limit):  # neither dtype applies below its linear's threshold
        if any(linear.runs_gemm_dtype(rows) for linear in linears):
            return rows
    return limit


class FusedDecode:
    """One backbone as a ``llmrt_kernels.DecodeStack`` (built once from its modules,
    borrowing their weights): a decode step is one call from token ids to logits."""

    def __init__(self, *, layers: list[StackLayer], ends: StackEnds, max_rows: int) -> None:
        self._stack = torch.classes.llmrt_kernels.DecodeStack(
            [t for layer in layers for t in layer.tensors],
            [b for layer in layers for b in layer.biases],
            [i for layer in layers for i in layer.ints],
            [f for layer in layers for f in layer.floats],
        )
        self._stack.set_ends(*ends)
        #: Steps with this many rows or more run the torch ops instead.
        self.max_rows = max_rows
        #: The KV binding and RoPE tables the stack holds (borrowed) since ``bind``.
        self._bound: tuple[BoundKV, tuple[torch.Tensor, ...]] | None = None
        entry = python_entry()
        self._entry = entry.decode_step if entry is not None else None
        self._address = int(self._stack.address())

    @classmethod
    def build(cls, backbone: FusableBackbone) -> FusedDecode:
        """Every part's arguments, or ``NotFusable`` naming the first part that is not."""
        placed = backbone.embed_tokens.weight.device
        if placed.type != "cpu":  # asked first: no kernel build for a model that cannot use it
            raise NotFusable(f"the weights are on {placed} (the fused op runs on the CPU)")
        ok, why = kernels_available()
        if not ok:
            raise NotFusable(f"the kernels are not available ({why})")
        layers: list[DecoderLayer] = list(backbone.layers)  # type: ignore[arg-type]
        built = []
        for i, layer in enumerate(layers):
            try:
                built.append(fused_layer_args(layer, width=backbone.spec.model.hidden_size))
            except NotFusable as exc:
                raise exc.at(f"layers.{i}") from exc
        ends = fused_ends_args(backbone)
        dense = all(
            isinstance(linear, FrozenLinear)
            for layer in layers
            for linear in (layer.attention.qkv, layer.attention.o, layer.mlp.up, layer.mlp.down)
        )
        limit = MAX_ROWS_DENSE if dense else MAX_ROWS_BLOCKS
        return cls(layers=built, ends=ends, max_rows=gemm_dtype_rows(backbone, limit=limit))

    def step(
        self,
        *,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        page_table: torch.Tensor,
        ropes: list[tuple[torch.Tensor, torch.Tensor]],
        kv: BoundKV,
    ) -> torch.Tensor:
        """Token ids ``[B]`` at ``positions`` ``[B]`` (negative: a padding row that writes
        nothing) through the whole model, RoPE read from the ``ropes`` cos/sin caches;
        returns float32 logits ``[B, vocab]`` (before any logit scale or soft-cap). Binds
        ``kv`` and ``ropes`` first when the stack holds others (or none)."""
        bound = self._bound
        if bound is None or bound[0] is not kv or not _same(bound[1], _tables(ropes)):
            self.bind(kv=kv, ropes=ropes)
        return self.step_bound(tokens=tokens, positions=positions, page_table=page_table)

    def bind(self, *, kv: BoundKV, ropes: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Hold (borrow) ``kv``'s caches and the RoPE tables for ``step_bound``, until
        ``release`` or the next ``bind``."""
        self._stack.bind_cache(
            [cos for cos, _ in ropes],
            [sin for _, sin in ropes],
            list(kv.keys),
            list(kv.values),
        )
        self._bound = (kv, _tables(ropes))

    def release(self) -> None:
        """Drop the borrowed caches and tables (a KV cache unbound, RoPE tables resized)."""
        self._stack.release_cache()
        self._bound = None

    @property
    def bound_kv(self) -> BoundKV | None:
        """The KV binding ``step_bound`` reads, if any."""
        return self._bound[0] if self._bound is not None else None

    def step_bound(
        self, *, tokens: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor
    ) -> torch.Tensor:
        """``step`` over what ``bind`` bound, through the library's Python entry where it
        imports (``python_entry.cpp`` says why), else the TorchScript method."""
        if self._bound is None:
            raise RuntimeError("FusedDecode.step_bound before bind")
        try:
            if self._entry is not None:
                logits: torch.Tensor = self._entry(self._address, tokens, positions, page_table)
            else:
                logits = self._stack.step_bound(tokens, positions, page_table)
        except (IndexError, RuntimeError) as exc:
            # The op's bounds check (page-table entries against the KV pool) ran before any
            # write: the caches are as they were.
            if BOUNDS_ERROR in str(exc):
                raise DeviceError(f"fused decode step: {exc}") from exc
            raise
        return logits


def _tables(ropes: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    return tuple(t for pair in ropes for t in pair)


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


#: KV cache dtypes the op reads and writes (converted to and from float32 in registers).
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fused_step_allowed(*, device: torch.device, dtype: torch.dtype, kv: BoundKV) -> bool:
    """Whether a step may run fused: eager, on the CPU, float32 activations, a KV cache in a
    dtype the op converts."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and kv.keys[0].dtype in KV_DTYPES
        and not torch.compiler.is_compiling()
    )


def select_decode_kernel(model: object, *, choice: str, device: torch.device) -> str | None:
    """Point ``model``'s decode steps at ``choice``; returns why they are not fused (None if
    they are). ``fused`` on a model or device the op cannot run raises ``ConfigError``."""
    field = "device.decode_kernel"
    if choice not in DECODE_KERNELS:
        raise ConfigError(field, choice, f"must be one of {list(DECODE_KERNELS)}")
    backbone = getattr(model, "backbone", None)
    status = getattr(backbone, "fused_decode_status", None)
    if status is None:
        why: str | None = f"{type(backbone).__name__} has no fused decode path"
    else:
        backbone.fused_decode = choice != "ops"  # type: ignore[union-attr]
        why = status() if device.type == "cpu" else f"runs on {device.type}, not the CPU"
        if why is None and choice == "auto" and not vector_kernels():
            # The op's scalar loops lost to torch's ops (float32 SmolLM2 on an AVX2 EPYC
            # before its AVX2 paths: 2x slower); ``fused`` still runs them. arm64 is here
            # too: the step's attention loops (scores, softmax, values) and its activation
            # have AVX2/AVX-512 code only, so on arm64 the ops path runs (its linears are the
            # same NEON/sdot/smmla kernels, its elementwise parts torch's vectorised ops).
            backbone.fused_decode = False  # type: ignore[union-attr]
            level = kernels_isa()[0]
            why = f"the kernels have no vector loops at level {level} (the ops are faster)"
        elif why is None and choice == "auto" and not kernels_openmp():
            # Built without OpenMP (Apple clang): the step's team of threads is an OpenMP
            # region, so it would run on one thread; the ops path's loops use torch's pool.
            backbone.fused_decode = False  # type: ignore[union-attr]
            why = "the kernels were built without OpenMP (the step would run on one thread)"
    if choice == "fused" and why is not None:
        raise ConfigError(field, choice, f"this model's decode steps are {why}")
    return why
