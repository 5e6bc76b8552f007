"""A dequantize + GEMM linear holds at most ``DEQUANTIZE_SLICE_BYTES`` of dequantized weight.

A weight larger than that is dequantized and multiplied a slice of output rows at a time;
the product is still ``x W^T + b`` with ``W`` as gguf-py dequantizes the blocks (the
independent reference), in float32 and in the bfloat16 GEMM mode. One slice is alive at a
time (the last is freed before the next is made), and the slices' products land in the
output as one whole-weight GEMM gives them (up to the BLAS's summation order).
"""

from __future__ import annotations

import weakref

import gguf
import numpy as np
import pytest
import torch

from llmrt.families import layers
from llmrt.families.layers import QuantizedLinear
from llmrt.kernels.formats import GGML_TYPE, QuantizedWeight
from llmrt.kernels.native import kernels_available
from llmrt.testing.gguf_blocks import random_blocks

pytestmark = pytest.mark.skipif(not kernels_available()[0], reason="needs the CPU kernels")

OUT, K, ROWS = 200, 256, 20


def _weight(kind: str) -> QuantizedWeight:
    blocks = torch.from_numpy(random_blocks(kind, OUT, K, seed=5))
    return QuantizedWeight(kind=kind, shape=(OUT, K), blocks=blocks)  # type: ignore[arg-type]


def _reference(weight: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    kind = gguf.GGMLQuantizationType(GGML_TYPE[weight.kind])
    dense = np.asarray(gguf.quants.dequantize(weight.blocks.numpy(), kind), dtype=np.float64)
    return x.double() @ torch.from_numpy(dense.reshape(OUT, K)).T + bias.double()


@pytest.fixture
def dequantized_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every weight slice the kernels dequantize, in call order."""
    seen: list[int] = []
    for name in ("gguf_dequantize", "gguf_dequantize_bf16"):
        op = getattr(torch.ops.llmrt_kernels, name)

        def counted(blocks: torch.Tensor, *args: object, _op: object = op) -> torch.Tensor:
            seen.append(int(blocks.shape[0]))
            return _op(blocks, *args)  # type: ignore[operator]

        monkeypatch.setattr(torch.ops.llmrt_kernels, name, counted)
    return seen


@pytest.mark.parametrize("kind", ["q8_0", "q6_k"])
@pytest.mark.parametrize("gemm_dtype", [torch.float32, torch.bfloat16])
def test_a_large_weight_is_dequantized_in_slices(
    kind: str,
    gemm_dtype: torch.dtype,
    dequantized_rows: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weight = _weight(kind)
    bias = torch.randn(OUT, generator=torch.Generator().manual_seed(1))
    x = torch.randn(ROWS, K, generator=torch.Generator().manual_seed(2))
    linear = QuantizedLinear(weight=weight, bias=bias)
    linear.gemm_dtype, linear.gemm_dtype_min_rows = gemm_dtype, 1
    linear.gemm_min_rows = 1  # every row count takes dequantize + GEMM
    monkeypatch.setattr(layers, "kquant_gemm_max_rows", lambda kernel_type: 0)
    monkeypatch.setattr(layers, "DEQUANTIZE_SLICE_BYTES", 1)  # the 64-row floor
    got = linear.forward_raw(x)
    assert dequantized_rows == [64, 64, 64, 8]
    assert got.dtype == gemm_dtype and got.shape == (ROWS, OUT)
    want = _reference(weight, x, bias)
    scale = (x.abs().double() @ _reference(weight, torch.eye(K), torch.zeros(OUT)).abs()).amax()
    tolerance = 1e-5 if gemm_dtype == torch.float32 else 2e-2
    assert (got.double() - want).abs().max() <= tolerance * scale


def test_a_weight_within_the_slice_is_dequantized_once(
    dequantized_rows: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    linear = QuantizedLinear(weight=_weight("q8_0"))
    linear.gemm_min_rows = 1
    monkeypatch.setattr(layers, "kquant_gemm_max_rows", lambda kernel_type: 0)
    linear.forward_raw(torch.ones(ROWS, K))
    assert dequantized_rows == [OUT]


@pytest.mark.parametrize("gemm_dtype", [torch.float32, torch.bfloat16])
def test_one_dequantized_slice_is_alive_at_a_time(
    gemm_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    alive_before: list[int] = []
    made: list[weakref.ref[torch.Tensor]] = []
    for name in ("gguf_dequantize", "gguf_dequantize_bf16"):
        op = getattr(torch.ops.llmrt_kernels, name)

        def tracked(blocks: torch.Tensor, *args: object, _op: object = op) -> torch.Tensor:
            alive_before.append(sum(ref() is not None for ref in made))
            dense: torch.Tensor = _op(blocks, *args)  # type: ignore[operator]
            made.append(weakref.ref(dense))
            return dense

        monkeypatch.setattr(torch.ops.llmrt_kernels, name, tracked)
    linear = QuantizedLinear(weight=_weight("q6_k"), bias=torch.randn(OUT))
    linear.gemm_dtype, linear.gemm_dtype_min_rows = gemm_dtype, 1
    linear.gemm_min_rows = 1
    monkeypatch.setattr(layers, "kquant_gemm_max_rows", lambda kernel_type: 0)
    x = torch.randn(ROWS, K, generator=torch.Generator().manual_seed(3))
    whole = linear.forward_raw(x)
    assert alive_before == [0]
    monkeypatch.setattr(layers, "DEQUANTIZE_SLICE_BYTES", 1)  # slices of 64 rows
    alive_before.clear()
    sliced = linear.forward_raw(x)
    assert alive_before == [0, 0, 0, 0]
    # The same products up to the GEMM's summation order: a BLAS may block a 64-column
    # product differently from a 200-column one (MKL's sgemm does on AVX-512 Zen 4).
    assert sliced.dtype == whole.dtype
    torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=1e-5)
