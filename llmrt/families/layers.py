"""Small building blocks the families share (norms and linear layers built from weights).

This module is the one place linear layers and embeddings are made: ``frozen_linear`` and
``frozen_embedding`` take a float tensor or a block-``QuantizedWeight`` and return the layer
that runs it, and ``apply_weight_format`` turns a built model's float linears into quantized
ones (``checkpoint.weights: int8 | int4``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from llmrt.device.cpu_features import (
    CpuFeatures,
    bfloat16_gemm_advantage,
    int8_gemm_advantage,
    isa_at_least,
    read_cpu_features,
    usable_cpu_features,
)
from llmrt.errors import ConfigError
from llmrt.families.base import CausalLM
from llmrt.kernels.formats import (
    INTERLEAVABLE_KINDS,
    QUANTIZE_TO,
    CheckpointTensor,
    QuantizedWeight,
    StackedWeight,
    concat_rows,
    quantize,
)
from llmrt.kernels.native import (
    int8_dot_supported,
    integer_gemm_supported,
    kernels_loaded,
    kquant_gemm_max_rows,
    load_kernels,
    q8_gemm,
    q8_gemm_supported,
    vector_kernels,
)

#: A checkpoint weight as the layer factories take it: float, kept in ggml blocks, or row
#: ranges in different block kinds (a fused projection of a mixed-type GGUF).
Weight = CheckpointTensor | StackedWeight
#: Activation rows from which a quantized linear dequantizes its weight and runs a GEMM
#: (prefill) instead of the in-register kernel (decode).
GEMM_MIN_ROWS = 16
#: A weight whose float32 form is larger than this streams out of cache when dequantized
#: (an LM head over a large vocabulary: 113 MB for SmolLM2), which costs more than the
#: in-register kernel saves below ``LARGE_GEMM_MIN_ROWS`` rows (measured on a 2-core EPYC:
#: 11 ms in-register vs 51 ms dequantize + GEMM at 16 rows; even at 128).
DEQUANTIZE_BUDGET_BYTES = 32 << 20
LARGE_GEMM_MIN_ROWS = 128
#: Bytes of dequantized weight a dequantize + GEMM call holds at a time: a larger weight is
#: dequantized and multiplied a slice of its output rows at a time. Why: the whole
#: dequantized weight is a transient the size of its float form, which a prefill's peak RSS
#: carries (a 3B Q4_K_M's fused gate/up in bfloat16 is 96 MiB: a 130-token prompt at AMX
#: bfloat16 peaked 135 MiB above a 3-token one); slices this size keep the GEMM's width.
DEQUANTIZE_SLICE_BYTES = 16 << 20
#: ``GEMM_MIN_ROWS`` for interleaved blocks: their integer-dot kernel keeps up with
#: dequantize + GEMM longer (one SmolLM2 layer, 2 threads: 1.7 against 1.9-8 ms at 32 rows,
#: 3.9 against 2.7-3.4 ms at 64), and short prompts skip dequantizing every weight.
INTERLEAVED_GEMM_MIN_ROWS = 48
#: Rows from which interleaved blocks run a float32 GEMM where the integer GEMM does not win
#: at every size (``integer_gemm_supported``: below AVX-512 VNNI). With VNNI, a float32-mode
#: linear never dequantizes: from 16 rows the kernels run an integer GEMM
#: (``interleaved_gemm.cpp``), which beat dequantize + MKL sgemm at every size and shape
#: tried (SmolLM2's linears at 16-512 rows, 2 threads, medians of alternated runs:
#: 1.1-2.5x), with the decode kernels' numerics (two 8-bit activation levels; SmolLM2's
#: parity logits within ~1e-2 of the float32 reference). At AVX2 its 16-bit variant runs
#: from 16 rows up to here (1.1-2.3x the AVX2 sgemm's speed at 16-64 rows, 0.9x at 512).
INTERLEAVED_FLOAT32_GEMM_MIN_ROWS = 128


def gemm_min_rows(weight: QuantizedWeight) -> int:
    """Rows from which a linear over ``weight`` dequantizes it and runs a GEMM."""
    if 4 * weight.shape[0] * weight.shape[1] > DEQUANTIZE_BUDGET_BYTES:
        return LARGE_GEMM_MIN_ROWS
    return INTERLEAVED_GEMM_MIN_ROWS if weight.layout == "interleaved" else GEMM_MIN_ROWS


#: How a ``FrozenLinear`` multiplies: ``aten`` is ``F.linear``; ``onednn`` calls oneDNN's
#: matmul directly on the plain weight. On CPU, aten sends float32 to MKL's sgemm, which
#: runs well below the AVX-512 peak on AMD cores (about 220 against 480 GFLOPS on this
#: project's 2-core EPYC), where oneDNN reaches it; on Intel cores MKL is at least as fast
#: (SmolLM2's shapes on a 2-core Emerald Rapids: 180-266 against 160-249 GFLOPS; a mixed
#: prefill of 8,448 tokens 3.6% faster, median of four alternations). bfloat16 already goes
#: through oneDNN in aten.
LinearKernel = Literal["aten", "onednn"]
LinearKernelChoice = Literal["auto", "aten", "onednn"]
LINEAR_KERNEL_CHOICES: tuple[str, ...] = get_args(LinearKernelChoice)


#: The kernels' activation codes (``csrc/vecmath.h``: the fused decode step and
#: ``native_mlp_activation``).
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "relu2": 4}


def native_mlp_activation(
    y: torch.Tensor, *, activation: str, gated: bool, dtype: torch.dtype
) -> torch.Tensor:
    """``activation(gate) * up`` (``y`` = [gate, up] when ``gated``) in one C++ pass, from
    ``y``'s dtype to ``dtype`` (float32 or bfloat16), computed in float32 (``activation.cpp``).
    """
    out: torch.Tensor = torch.ops.llmrt_kernels.mlp_activation(
        y, ACTIVATIONS[activation], gated, dtype
    )
    return out


def native_rms_norm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``native_rms_norm`` takes this call: float32 on the CPU, one weight row, not
    under torch.compile (inductor fuses the torch form itself), kernels loaded with vector
    loops at the running level (``vector_kernels``: the scalar loop lost to torch's op)."""
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and weight.dim() == 1
        and not torch.compiler.is_compiling()
        and kernels_loaded()
        and vector_kernels()
    )


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dim in one C++ pass per row, rows
    split across threads (``rms_norm.cpp``); torch's float32 result to ~1e-7 relative."""
    out: torch.Tensor = torch.ops.llmrt_kernels.rms_norm(x, weight, eps)
    return out


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, as Hugging Face does."""

    def __init__(self, *, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = _parameter(weight)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def onednn_linear_available() -> bool:
    """Whether this torch build can run oneDNN matmuls on CPU tensors."""
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")


@torch.library.custom_op("llmrt::onednn_linear", mutates_args=())
def _onednn_linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """oneDNN linear as an opaque op, so ``torch.compile`` calls it instead of lowering it.

    Inductor's own lowering of the oneDNN linear needs weights frozen into constants.
    """
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out


@_onednn_linear_op.register_fake
def _onednn_linear_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class FrozenLinear(nn.Module):
    """``y = x W^T + b`` over frozen weights ``[out, in]``, with a selectable kernel."""

    def __init__(self, *, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = _parameter(weight)
        self.bias = None if bias is None else _parameter(bias)
        self.kernel: LinearKernel = "aten"

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _matmul(x, self.weight, self.bias, kernel=self.kernel)

    def forward_raw(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` (a float weight multiplies in its own dtype)."""
        return self.forward(x)

    def gemm_input_dtype(self, rows: int) -> torch.dtype:
        """The dtype ``rows`` activation rows are multiplied in: the weight's."""
        return self.weight.dtype

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, kernel={self.kernel}"
        )


def _matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, kernel: LinearKernel
) -> torch.Tensor:
    # oneDNN's linear only for float32 (what ``resolve_linear_kernel`` picked it for): its
    # bfloat16 inner product needs AVX-512 (or AVX2-VNNI-2), so a bfloat16 GEMM on an AVX2
    # CPU failed to create its primitive; F.linear runs bfloat16 everywhere, through oneDNN
    # where it can (the same time on Zen 4: 2.3-46 ms against 2.3-45 on SmolLM2/1B shapes).
    if kernel == "onednn" and weight.dtype == torch.float32:
        if torch.compiler.is_compiling():
            out: torch.Tensor = _onednn_linear_op(x, weight, bias)
            return out
        out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return out
    return F.linear(x, weight, bias)


class _BlockWeightModule(nn.Module):
    """A module over one ``QuantizedWeight``: its blocks as a buffer and their kernel type
    code, swappable for the same matrix in another layout (``use_weight``)."""

    def __init__(self, *, weight: QuantizedWeight) -> None:
        super().__init__()
        load_kernels()
        self.weight = weight
        self.blocks: torch.Tensor
        self.register_buffer("blocks", weight.blocks, persistent=False)
        #: The kernel ops' type code for ``blocks`` (ggml type id, + layout).
        self.ggml_type = weight.kernel_type

    def use_weight(self, weight: QuantizedWeight) -> None:
        """Read ``weight`` instead (the same matrix in another layout)."""
        if weight.shape != self.weight.shape or weight.kind != self.weight.kind:
            raise ValueError(
                f"{weight.kind} {weight.shape} does not replace {self.weight.kind} "
                f"{self.weight.shape}"
            )
        self.weight = weight
        self.blocks = weight.blocks
        self.ggml_type = weight.kernel_type


class QuantizedLinear(_BlockWeightModule):
    """``y = x W^T + b`` with ``W`` kept in ggml blocks (float32 activations and output).

    Few rows (decode) run the in-register kernel, which reads the blocks once per call;
    from ``GEMM_MIN_ROWS`` rows (prefill) the weight is dequantized for the call and the
    float GEMM (``kernel``, as for ``FrozenLinear``) does the work, except where the kernels'
    integer GEMM is faster (interleaved blocks; the K-quants up to ``kquant_gemm_max_rows``).
    """

    def __init__(self, *, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight=weight)
        self.bias = None if bias is None else _parameter(bias)
        self.kernel: LinearKernel = "aten"
        #: The dtype GEMM calls of ``gemm_dtype_min_rows`` rows or more multiply in
        #: (``device.gemm_dtype``); smaller GEMMs stay float32.
        self.gemm_dtype = torch.float32
        self.gemm_dtype_min_rows = GEMM_DTYPE_MIN_ROWS
        #: The dtype those GEMMs multiply in where ``gemm_dtype`` is int8 and this kind has
        #: no int8 GEMM at the running level: bfloat16 where the CPU multiplies it faster.
        self.int8_fallback_dtype = torch.float32
        self.gemm_min_rows = gemm_min_rows(weight)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def use_weight(self, weight: QuantizedWeight) -> None:
        """Run on ``weight`` instead (the same matrix in another layout)."""
        super().use_weight(weight)
        self.gemm_min_rows = gemm_min_rows(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_raw(x).to(x.dtype)

    def forward_raw(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` left in the dtype it was computed in: ``gemm_dtype`` for a GEMM,
        float32 for the in-register kernel (a caller that feeds another GEMM skips a cast
        there and back)."""
        rows = x.numel() // self.in_features
        dtype = self.gemm_input_dtype(rows)
        x = x.to(dtype)
        if self.runs_int8_gemm(rows):
            return q8_gemm(
                x,
                self.blocks,
                kernel_type=self.ggml_type,
                in_features=self.in_features,
                bias=self.bias,
            )
        if self.runs_gemm(rows):
            return self._dequantized_gemm(x, dtype)
        out: torch.Tensor = torch.ops.llmrt_kernels.gguf_linear(
            x, self.blocks, self.ggml_type, self.in_features, self.bias
        )
        return out

    def _dequantized_gemm(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x W^T + b`` by dequantizing ``W`` to ``dtype`` and a float GEMM, at most
        ``DEQUANTIZE_SLICE_BYTES`` of dequantized rows at a time."""
        bias = None if self.bias is None else self.bias.to(dtype)
        step = max(64, DEQUANTIZE_SLICE_BYTES // (dtype.itemsize * self.in_features))
        if step >= self.out_features:
            return self._slice_product(x, dtype, bias, start=0, stop=self.out_features)
        # Each slice's product is written into the output as it is made, and a slice's
        # dequantized rows are freed before the next slice's are made: collecting the slices
        # for one ``torch.cat`` held them twice at its end, beside the last dequantized slice.
        out = torch.empty((*x.shape[:-1], self.out_features), dtype=dtype, device=x.device)
        for start in range(0, self.out_features, step):
            stop = min(start + step, self.out_features)
            out[..., start:stop] = self._slice_product(x, dtype, bias, start=start, stop=stop)
        return out

    def _slice_product(
        self,
        x: torch.Tensor,
        dtype: torch.dtype,
        bias: torch.Tensor | None,
        *,
        start: int,
        stop: int,
    ) -> torch.Tensor:
        """``x`` times output rows ``[start, stop)`` of the weight, dequantized to ``dtype``
        (freed on return)."""
        blocks = self.blocks[start:stop]
        if dtype == torch.float32:
            dense = torch.ops.llmrt_kernels.gguf_dequantize(
                blocks, self.ggml_type, self.in_features
            )
        else:
            dense = torch.ops.llmrt_kernels.gguf_dequantize_bf16(
                blocks, self.ggml_type, self.in_features
            )
        part = None if bias is None else bias[start:stop]
        return _matmul(x, dense, part, kernel=self.kernel)

    def runs_gemm(self, rows: int) -> bool:
        """Whether ``rows`` activation rows run dequantize + GEMM (else the in-register
        kernel)."""
        if rows < self.gemm_min_rows:
            return False
        if rows >= self.gemm_dtype_min_rows and self.float_gemm_dtype() == torch.bfloat16:
            return True
        if rows <= kquant_gemm_max_rows(self.ggml_type):
            return False  # the kernels' panel GEMM (csrc/kquant_gemm.cpp) is faster
        if self.weight.layout != "interleaved":
            return True
        return not integer_gemm_supported() and rows >= INTERLEAVED_FLOAT32_GEMM_MIN_ROWS

    def runs_int8_gemm(self, rows: int) -> bool:
        """Whether ``rows`` activation rows run the kernels' GEMM over one-level 8-bit
        activations (``device.gemm_dtype: int8``; kinds without that kernel keep their
        float32 path). Never below ``GEMM_MIN_ROWS``: decode-sized calls keep the decode
        kernels' numerics."""
        return (
            self.gemm_dtype == torch.int8
            and rows >= max(self.gemm_dtype_min_rows, GEMM_MIN_ROWS)
            and q8_gemm_supported(self.ggml_type)
        )

    def runs_gemm_dtype(self, rows: int) -> bool:
        """Whether ``rows`` activation rows multiply in ``gemm_dtype`` (the one-level int8
        GEMM, or a bfloat16 GEMM) rather than at the float32 / two-level kernels' numerics,
        which the fused decode op keeps: from here a decode batch takes the torch ops."""
        return self.runs_int8_gemm(rows) or self.gemm_input_dtype(rows) == torch.bfloat16

    def float_gemm_dtype(self) -> torch.dtype:
        """The float dtype GEMMs of ``gemm_dtype_min_rows`` rows or more take when they do not
        run the int8 GEMM: ``gemm_dtype``, or under int8 ``int8_fallback_dtype`` for a kind
        without that kernel at the running level (float32 for one with it: its smaller GEMMs
        keep the float32 paths)."""
        if self.gemm_dtype != torch.int8:
            return self.gemm_dtype
        return torch.float32 if q8_gemm_supported(self.ggml_type) else self.int8_fallback_dtype

    def gemm_input_dtype(self, rows: int) -> torch.dtype:
        """The dtype ``rows`` activation rows are multiplied in (what ``x`` is cast to;
        float32 for the int8 GEMM, which quantizes its rows itself)."""
        bfloat16 = rows >= self.gemm_dtype_min_rows and self.float_gemm_dtype() == torch.bfloat16
        return torch.bfloat16 if bfloat16 and self.runs_gemm(rows) else torch.float32

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, format={self.weight.kind}, kernel={self.kernel}"
        )


class QuantizedEmbedding(_BlockWeightModule):
    """Token embedding over a ggml-block table: the looked-up rows are dequantized."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, ids.reshape(-1))
        dense: torch.Tensor = torch.ops.llmrt_kernels.gguf_dequantize(
            rows, self.ggml_type, self.weight.shape[1]
        )
        return dense.reshape(*ids.shape, self.weight.shape[1])

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}, format={self.weight.kind}"


class StackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s row ranges in different block kinds (``StackedWeight``):
    one ``QuantizedLinear`` per part, outputs concatenated. Why: a float32 copy of the whole
    matrix is what llmrt must not make, and the parts keep every per-kind policy (layout,
    GEMM dtype) of a ``QuantizedLinear``. The fused decode step runs it as one stacked weight
    (``packed``: ``csrc/stacked.cpp``)."""

    def __init__(self, *, weight: StackedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        sizes = [p.shape[0] for p in weight.parts]
        biases = [None] * len(sizes) if bias is None else list(bias.split(sizes))
        self.weight = weight
        self.parts = nn.ModuleList(
            QuantizedLinear(weight=p, bias=b) for p, b in zip(weight.parts, biases, strict=True)
        )

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def packed(self) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """The parts as they are now (after any layout change) as one stacked weight: blob,
        kernel type and bias, for the fused decode step. The parts move onto views of the
        blob, so their bytes are held once."""
        parts: list[QuantizedLinear] = [p for p in self.parts if isinstance(p, QuantizedLinear)]
        current = StackedWeight(parts=tuple(part.weight for part in parts))
        blob, code, viewed = current.packed()
        for part, weight in zip(parts, viewed.parts, strict=True):
            part.use_weight(weight)
        self.weight = viewed
        bias = None
        if any(part.bias is not None for part in parts):
            bias = torch.cat(
                [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]
            )
        return blob, code, bias

    def forward_raw(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` (parts may compute in different dtypes; the result is ``x``'s)."""
        return self.forward(x)

    def gemm_input_dtype(self, rows: int) -> torch.dtype:
        """The dtype ``x`` should arrive in: float32 (each part casts it as it needs)."""
        return torch.float32

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " + (
            f"formats={list(self.weight.kinds)}"
        )


#: What ``frozen_linear`` / ``frozen_embedding`` return.
Linear = FrozenLinear | QuantizedLinear | StackedLinear
Embedding = nn.Embedding | QuantizedEmbedding


def frozen_linear(*, weight: Weight, bias: torch.Tensor | None = None) -> Linear:
    """The linear layer for ``weight`` ``[out, in]`` (and ``bias``), without copying them.

    A float tensor gives a ``FrozenLinear``; a ``QuantizedWeight`` a ``QuantizedLinear``; a
    ``StackedWeight`` a ``StackedLinear``.
    """
    if isinstance(weight, StackedWeight):
        return StackedLinear(weight=weight, bias=bias)
    if isinstance(weight, QuantizedWeight):
        return QuantizedLinear(weight=weight, bias=bias)
    return FrozenLinear(weight=weight, bias=bias)


def bind_weight(parts: list[Weight], *, device: torch.device, dtype: torch.dtype) -> Weight:
    """One weight from checkpoint ``parts`` stacked along dim 0 (fused projections).

    Float parts are cast to ``dtype`` on ``device``; ggml-block parts stay quantized (they
    compute in float32 on the CPU): one ``QuantizedWeight`` when all parts share a kind, else
    a ``StackedWeight`` of them (never a float32 copy).
    """
    quantized = [p for p in parts if isinstance(p, QuantizedWeight)]
    if quantized:
        if len(quantized) != len(parts):
            dense = [p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts]
            return bind_weight(list(dense), device=device, dtype=dtype)
        kinds = {p.kind for p in quantized}
        if len(kinds) > 1:  # packed now, while the build's freed parts can still be trimmed
            return StackedWeight(parts=tuple(quantized)).packed()[2]
        return concat_rows(quantized)
    tensors = [p.to(device=device, dtype=dtype) for p in parts if isinstance(p, torch.Tensor)]
    return tensors[0].contiguous() if len(tensors) == 1 else torch.cat(tensors, dim=0)


def apply_weight_format(model: CausalLM, *, weights: str, field: str) -> int:
    """Quantize every float ``FrozenLinear`` of ``model`` for ``weights`` (``int8``/``int4``).

    Other formats leave the model as built. Returns how many layers were replaced.
    Embeddings stay float (a step reads one row of them); a tied LM head gets its own
    quantized copy.
    """
    kind = QUANTIZE_TO.get(weights)
    if kind is None:
        return 0
    if not isinstance(model, nn.Module):
        raise ConfigError(field, weights, f"needs a torch model, not a {type(model).__name__}")
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FrozenLinear):
                qweight = quantize(child.weight.float(), kind=kind, field=field)
                linear = QuantizedLinear(weight=qweight, bias=child.bias)
                linear.kernel = child.kernel
                setattr(parent, name, linear)
                replaced += 1
    if replaced:
        _forget_fused_decode(model)
    return replaced


def _forget_fused_decode(model: CausalLM) -> None:
    """Drop the fused decode stack's borrowed weights after linears were replaced (it is
    rebuilt from the new ones on the next step)."""
    forget = getattr(getattr(model, "backbone", None), "forget_fused_decode", None)
    if callable(forget):
        forget()


def linear_weight_bytes(model: CausalLM) -> int:
    """Bytes of linear weights (and biases) one decode step reads: the step's bandwidth floor."""
    total = 0
    for _, module in model.iter_executor_named_modules():
        for sub in module.modules():
            if isinstance(sub, FrozenLinear):
                total += sub.weight.numel() * sub.weight.element_size()
            elif isinstance(sub, QuantizedLinear):
                total += sub.weight.nbytes
            else:
                continue
            if sub.bias is not None:
                total += sub.bias.numel() * sub.bias.element_size()
    return total


def resolve_linear_kernel(
    choice: LinearKernelChoice,
    *,
    device: torch.device,
    dtype: torch.dtype,
    cpu: CpuFeatures | None = None,
) -> LinearKernel:
    """The kernel ``choice`` means for weights of ``dtype`` on ``device``.

    ``auto`` picks oneDNN for float32 on a CPU other than Intel's (``cpu``, read from
    ``/proc/cpuinfo`` when not given) when this torch build has it, else aten (MKL on Intel).
    ``onednn`` anywhere but a CPU device (or without oneDNN) is a ``ConfigError``.
    """
    if choice not in LINEAR_KERNEL_CHOICES:
        raise ConfigError("device.linear", choice, f"must be one of {list(LINEAR_KERNEL_CHOICES)}")
    usable = device.type == "cpu" and onednn_linear_available()
    if choice == "onednn":
        if not usable:
            reason = (
                "needs a cpu device"
                if device.type != "cpu"
                else "this torch build has no oneDNN (torch.backends.mkldnn)"
            )
            raise ConfigError("device.linear", choice, reason)
        return "onednn"
    if choice == "auto" and usable and dtype == torch.float32:
        vendor = (cpu if cpu is not None else read_cpu_features()).vendor
        return "aten" if vendor == "GenuineIntel" else "onednn"
    return "aten"


def select_linear_kernel(
    model: CausalLM, *, choice: LinearKernelChoice, device: torch.device, dtype: torch.dtype
) -> LinearKernel:
    """Resolve ``choice`` for the model's weights and point all its linear layers at it."""
    kernel = resolve_linear_kernel(choice, device=device, dtype=dtype)
    for _, module in model.iter_executor_named_modules():
        use_linear_kernel(module, kernel=kernel)
    return kernel


def use_linear_kernel(module: nn.Module, *, kernel: LinearKernel) -> int:
    """Point every linear layer under ``module`` at ``kernel`` (quantized ones use it for
    GEMMs); returns how many."""
    count = 0
    for sub in module.modules():
        if isinstance(sub, (FrozenLinear, QuantizedLinear)):
            sub.kernel = kernel
            count += 1
    return count


#: ``device.weight_layout``: ``auto`` interleaves 4-bit blocks on CPUs with AVX-512 VNNI
#: (their integer-dot kernels read Q4 weights ~2x faster at one activation row, 1.2-1.9x
#: at 3-32 rows, measured on a 2-core EPYC); ``ggml`` keeps the file's order (float32
#: activation kernels, results within float32 rounding of the reference); ``interleaved``
#: asks for it (and, on a CPU without VNNI, runs a slow portable loop).
WeightLayoutChoice = Literal["auto", "ggml", "interleaved"]
WEIGHT_LAYOUT_CHOICES: tuple[str, ...] = get_args(WeightLayoutChoice)
#: Block kinds ``auto`` interleaves on every CPU with AVX-512 VNNI.
AUTO_INTERLEAVED_KINDS: tuple[str, ...] = ("q4_0", "q4_1")


def auto_interleaved_kinds(cpu: CpuFeatures | None = None) -> tuple[str, ...]:
    """The block kinds ``auto`` interleaves on ``cpu`` (read from ``/proc/cpuinfo`` when not
    given): Q4_0 and Q4_1 everywhere, Q8_0 too on Intel's CPUs and at levels below AVX-512.

    Why Q8_0 only there: on a 2-core Emerald Rapids its integer kernel made SmolLM2's batch-1
    step (whose tied Q8_0 LM head is 30 of the 99 MB a step reads) 0.89-0.95x as long
    (in-process A/B, medians), as fast at 4-8 rows and 0.96x at 15; on a 2-core EPYC it was
    no faster at one row and slower at 3-8 rows than the float32 kernel. That float32
    kernel is AVX-512 code: below AVX-512 the ggml layout runs a slower AVX2 float loop, and
    the integer kernel is the fast one on every vendor."""
    features = cpu if cpu is not None else read_cpu_features()
    if features.vendor == "GenuineIntel" or not isa_at_least("avx512", features):
        return (*AUTO_INTERLEAVED_KINDS, "q8_0")
    return AUTO_INTERLEAVED_KINDS


#: Called with each ggml weight ``select_weight_layout`` replaced and its copy, as soon as
#: every module reads the copy (``Checkpoint.follow_relayout``: the checkpoint's views of
#: the old buffer move too, so it is freed before the next weight is copied).
OnRelayout = Callable[[QuantizedWeight, QuantizedWeight], object]


def select_weight_layout(
    model: CausalLM,
    *,
    choice: str,
    device: torch.device,
    cpu: CpuFeatures | None = None,
    on_replaced: OnRelayout | None = None,
) -> int:
    """Put the block-quantized linears of ``model`` in the layout ``choice`` means (``auto``:
    ``auto_interleaved_kinds(cpu)``); returns how many linears changed. Interleaving copies
    each weight once; an embedding tied to an interleaved LM head looks its rows up in the
    same copy. Weights are copied one at a time and every module that read one (and
    ``on_replaced``, for holders outside the model) moves to its copy before the next, so
    the ggml blocks are released as the copies are made when nothing else holds them: the
    build peaks at about one copy of the weights, not two."""
    field = "device.weight_layout"
    if choice not in WEIGHT_LAYOUT_CHOICES:
        raise ConfigError(field, choice, f"must be one of {list(WEIGHT_LAYOUT_CHOICES)}")
    if choice == "ggml" or not isinstance(model, nn.Module):
        return 0
    if device.type != "cpu":
        if choice == "interleaved":
            raise ConfigError(field, choice, f"is a cpu layout, the model is on {device}")
        return 0
    if choice == "auto" and not int8_dot_supported():
        return 0
    kinds = auto_interleaved_kinds(cpu) if choice == "auto" else None
    # id of a ggml weight to replace -> (that weight, the modules reading it); the entry
    # keeps the weight alive, so its id stays its own until it is popped.
    readers: dict[int, tuple[QuantizedWeight, list[_BlockWeightModule]]] = {}
    stacks: dict[int, StackedLinear] = {}  # id of a part's module -> its stacked linear
    for module in model.modules():
        if isinstance(module, StackedLinear):
            stacks.update((id(part), module) for part in module.parts)
        if not isinstance(module, QuantizedLinear) or module.weight.layout == "interleaved":
            continue
        if kinds is not None and module.weight.kind not in kinds:
            continue
        if module.weight.kind not in INTERLEAVABLE_KINDS:
            continue
        readers.setdefault(id(module.weight), (module.weight, []))[1].append(module)
    for module in model.modules():
        if isinstance(module, QuantizedEmbedding) and id(module.weight) in readers:
            readers[id(module.weight)][1].append(module)
    if readers:
        _forget_fused_decode(model)  # it borrows the weights being replaced
    changed = 0
    while readers:
        old, modules = readers.pop(next(iter(readers)))
        new = old.interleaved()
        for module in modules:
            module.use_weight(new)
            changed += isinstance(module, QuantizedLinear)
            stack = stacks.get(id(module))
            if stack is not None:  # its StackedWeight lists the old part
                parts = [p for p in stack.parts if isinstance(p, QuantizedLinear)]
                stack.weight = StackedWeight(parts=tuple(p.weight for p in parts))
        if on_replaced is not None:
            on_replaced(old, new)
        del old, new, modules
    return changed


#: ``device.gemm_dtype``: the dtype GEMMs over block-quantized weights (from
#: ``GEMM_DTYPE_MIN_ROWS`` rows: prefill, large batches) multiply in. ``bfloat16`` rounds
#: the activations and the dequantized weight to bfloat16 and accumulates in float32
#: (oneDNN: AMX tiles, or AVX-512 BF16 dot products at about 2x the float32 GEMM rate on a
#: 2-core EPYC, 400 against 200 GFLOPS, but 0.6x on an Emerald Rapids without AMX). ``int8``
#: quantizes the activations in one 8-bit level (llama.cpp's Q8_0 / Q8_K scheme) and
#: multiplies them with the weights' integer quants (the kernels' ``q8_gemm``): half the
#: integer products of the two-level activations the other integer kernels take, which is
#: what bounds a prefill on CPUs without ``vpdpbusd``; kinds without that kernel take
#: ``int8_fallback_dtype`` (bfloat16 where the CPU multiplies it faster, else float32).
#: ``auto`` (block-quantized weights on a CPU) is ``bfloat16`` on AMX, else ``int8`` on x86
#: from AVX2 (``int8_gemm_advantage``; on Zen 4 too: pp512 of a 1B Q4_0 / Q4_K_M 1.39x /
#: 1.50x its bfloat16 rate, SmolLM2 Q4_1 1.19x), else ``bfloat16`` where it is faster
#: (``bfloat16_gemm_advantage``), else ``float32``.
GemmDtype = Literal["float32", "bfloat16", "int8"]
GEMM_DTYPES: tuple[str, ...] = get_args(GemmDtype)
GemmDtypeChoice = Literal["auto", "float32", "bfloat16", "int8"]
GEMM_DTYPE_CHOICES: tuple[str, ...] = get_args(GemmDtypeChoice)
#: ``device.gemm_dtype_min_rows``: GEMMs of fewer activation rows stay float32 whatever
#: ``gemm_dtype`` says. Why: bfloat16 GEMMs move SmolLM2's logits by up to ~0.5, and the
#: float32 reference's first answer token to the chat parity prompt leads the runner-up by
#: 0.08; bfloat16 kept it (by 0.035) or lost it (by 0.004) depending on 1e-7 changes in the
#: attention's rounding. Short prompts (chat turns) take the interleaved integer kernel there
#: (``INTERLEAVED_FLOAT32_GEMM_MIN_ROWS``) or a float32 GEMM; long prompts, where GEMMs
#: dominate, keep the 2x rate.
GEMM_DTYPE_MIN_ROWS = 128


def resolve_gemm_dtype(
    choice: str, *, device: torch.device, quantized: bool, cpu: CpuFeatures | None = None
) -> tuple[GemmDtype, str]:
    """The dtype ``choice`` means for a model on ``device`` (``quantized``: whether it has
    block-quantized linears), and why. ``auto``: ``bfloat16`` on AMX (``cpu``, read from
    ``/proc/cpuinfo`` when not given), else ``int8`` where the kernels have one-level 8-bit
    GEMMs (x86 from AVX2), else ``bfloat16`` where the CPU multiplies it faster than
    float32, else ``float32``; block-quantized weights run on CPUs only."""
    if choice not in GEMM_DTYPE_CHOICES:
        raise ConfigError("device.gemm_dtype", choice, f"must be one of {list(GEMM_DTYPE_CHOICES)}")
    if choice != "auto":
        return choice, "asked for"  # type: ignore[return-value]
    if not quantized:
        return "float32", "no block-quantized weights (float weights keep their dtype)"
    if device.type != "cpu":
        return "float32", f"block-quantized GEMMs run on the CPU, not {device.type}"
    features = cpu if cpu is not None else usable_cpu_features()
    bfloat16_why = bfloat16_gemm_advantage(features)
    if bfloat16_why is not None and "amx_bf16" in features.flags:
        return "bfloat16", bfloat16_why
    why = int8_gemm_advantage(features)
    if why is not None:
        return "int8", why
    if bfloat16_why is not None:
        return "bfloat16", bfloat16_why
    return "float32", "this CPU multiplies neither bfloat16 nor int8 GEMMs faster than float32"


def int8_fallback_dtype(cpu: CpuFeatures | None = None) -> GemmDtype:
    """What GEMMs of kinds without an int8 kernel multiply in under ``gemm_dtype: int8``:
    ``bfloat16`` where ``cpu`` (this one when not given) multiplies it faster than float32
    (the int8 choice already accepted a few tenths of a logit), else ``float32``."""
    features = cpu if cpu is not None else usable_cpu_features()
    return "bfloat16" if bfloat16_gemm_advantage(features) is not None else "float32"


def select_gemm_dtype(
    model: CausalLM,
    *,
    choice: str,
    min_rows: int = GEMM_DTYPE_MIN_ROWS,
    int8_fallback: GemmDtype = "float32",
) -> int:
    """Point every block-quantized linear of ``model`` at ``choice`` for GEMMs of
    ``min_rows`` rows or more (fewer run float32); under ``int8``, kinds without that kernel
    at the running level take ``int8_fallback`` (float32 or bfloat16); returns how many
    linears.

    ``bfloat16`` without block-quantized linears is a ``ConfigError`` naming
    ``device.gemm_dtype`` (float weights keep their own dtype).
    """
    field = "device.gemm_dtype"
    if choice not in GEMM_DTYPES:
        raise ConfigError(field, choice, f"must be one of {list(GEMM_DTYPES)}")
    if not isinstance(model, nn.Module):
        raise ConfigError(field, choice, f"needs a torch model, not a {type(model).__name__}")
    linears = quantized_linears(model)
    if choice != "float32" and not linears:
        raise ConfigError(
            field,
            choice,
            "applies to block-quantized weights (checkpoint.weights: int8, int4 or gguf-native)",
        )
    if int8_fallback not in ("float32", "bfloat16"):
        raise ConfigError(field, int8_fallback, "an int8 fallback is float32 or bfloat16")
    dtypes = {"bfloat16": torch.bfloat16, "int8": torch.int8}
    dtype = dtypes.get(choice, torch.float32)
    fallback = dtypes.get(int8_fallback, torch.float32)
    if isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < 1:
        raise ConfigError("device.gemm_dtype_min_rows", min_rows, "must be a positive integer")
    for linear in linears:
        linear.gemm_dtype = dtype
        linear.gemm_dtype_min_rows = min_rows
        linear.int8_fallback_dtype = fallback
    _forget_fused_decode(model)  # its row limit follows the linears' GEMM dtype
    return len(linears)


def quantized_linears(module: nn.Module) -> list[QuantizedLinear]:
    """Every block-quantized linear of ``module`` (its own submodules, in module order)."""
    return [m for m in module.modules() if isinstance(m, QuantizedLinear)]


def int8_gemm_coverage(model: CausalLM) -> tuple[int, int]:
    """(block-quantized linears whose GEMMs the running level multiplies with int8
    activations, all block-quantized linears) for ``model`` in its current layout; the rest
    keep their float32 path under ``device.gemm_dtype: int8``."""
    linears = quantized_linears(model)  # type: ignore[arg-type]
    return sum(q8_gemm_supported(m.ggml_type) for m in linears), len(linears)


def frozen_layer_norm(*, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> nn.LayerNorm:
    """An ``nn.LayerNorm`` wrapping ``weight``/``bias`` without copying them."""
    norm = nn.LayerNorm(weight.shape[0], eps=eps, device="meta")
    norm.weight = _parameter(weight)
    norm.bias = _parameter(bias)
    return norm


def frozen_embedding(*, weight: Weight) -> Embedding:
    """An embedding over ``weight`` ``[num, dim]`` without copying it (float or ggml blocks)."""
    if isinstance(weight, QuantizedWeight):
        return QuantizedEmbedding(weight=weight)
    if isinstance(weight, StackedWeight):
        raise ValueError(f"an embedding table is one block kind, got {list(weight.kinds)}")
    # ``_weight`` skips the random init (on "meta" it imports torch._dynamo: seconds).
    embedding = nn.Embedding(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True)
    embedding.weight = _parameter(weight)
    return embedding


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    """``tensor`` as a frozen parameter; an existing parameter is reused so ties stay one object."""
    if isinstance(tensor, nn.Parameter):
        return tensor
    return nn.Parameter(tensor, requires_grad=False)
