"""The GGUF block kernels against gguf-py's float64 dequantization of random blocks.

Blocks are random bytes with random fp16 scales (ggml's Q4_0 / Q4_1 / Q8_0 layouts), so
every nibble/byte value and sign occurs; the reference dequantization is gguf-py's
(independent of llmrt's C++), taken in float64.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmrt.errors import ConfigError
from llmrt.families.layers import (
    GEMM_MIN_ROWS,
    QuantizedEmbedding,
    QuantizedLinear,
    frozen_embedding,
    frozen_linear,
)
from llmrt.kernels.formats import (
    BLOCK_BYTES,
    GGML_TYPE,
    QuantizedWeight,
    concat_rows,
    dequantized,
    quantize,
)

KINDS = ("q4_0", "q4_1", "q8_0")


def random_weight(kind: str, *, rows: int, cols: int, seed: int) -> QuantizedWeight:
    """``rows x cols`` weights as random ggml blocks with random fp16 scales."""
    rng = np.random.default_rng(seed)
    nblocks = rows * cols // 32
    raw = rng.integers(0, 256, size=(nblocks, BLOCK_BYTES[kind]), dtype=np.uint8)
    d = (rng.uniform(1e-3, 5e-2, size=nblocks) * rng.choice([-1, 1], size=nblocks)).astype(
        np.float16
    )
    raw[:, 0:2] = d.view(np.uint8).reshape(nblocks, 2)
    if kind == "q4_1":
        m = rng.uniform(-0.5, 0.5, size=nblocks).astype(np.float16)
        raw[:, 2:4] = m.view(np.uint8).reshape(nblocks, 2)
    blocks = torch.from_numpy(raw.reshape(rows, -1).copy())
    return QuantizedWeight(kind=kind, shape=(rows, cols), blocks=blocks)  # type: ignore[arg-type]


def reference(weight: QuantizedWeight) -> torch.Tensor:
    """gguf-py's dequantization, float64."""
    values = gguf.quants.dequantize(
        weight.blocks.numpy().reshape(-1), gguf.GGMLQuantizationType(GGML_TYPE[weight.kind])
    )
    return torch.from_numpy(np.asarray(values, dtype=np.float64).reshape(weight.shape))


def assert_matmul_close(got: torch.Tensor, x: torch.Tensor, w64: torch.Tensor) -> None:
    """``got`` equals ``x @ w^T`` to float32 accumulation error (bounded by |x| @ |w|^T)."""
    x64 = x.double().reshape(-1, x.shape[-1])
    expected = x64 @ w64.T
    bound = 1e-5 * (x64.abs() @ w64.abs().T) + 1e-6
    error = (got.double().reshape(expected.shape) - expected).abs()
    assert bool((error <= bound).all()), float((error - bound).max())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cols", [64, 96], ids=["even-blocks", "odd-blocks"])
def test_dequantize_equals_gguf_reference_exactly(kind: str, cols: int) -> None:
    weight = random_weight(kind, rows=37, cols=cols, seed=1)
    got = weight.dequantize()
    assert got.dtype == torch.float32 and got.shape == (37, cols)
    assert torch.equal(got.double(), reference(weight))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_linear_kernel_matches_float64_reference(kind: str, rows: int) -> None:
    weight = random_weight(kind, rows=70, cols=96, seed=2)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(3))
    layer = frozen_linear(weight=weight)
    assert isinstance(layer, QuantizedLinear)
    assert rows < GEMM_MIN_ROWS  # the in-register kernel
    assert_matmul_close(layer(x), x, reference(weight))


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_rows_use_the_dequantized_gemm_and_agree(kind: str) -> None:
    weight = random_weight(kind, rows=40, cols=64, seed=4)
    bias = torch.randn(40)
    layer = frozen_linear(weight=weight, bias=bias)
    x = torch.randn(2, GEMM_MIN_ROWS, 64, generator=torch.Generator().manual_seed(5))
    w64 = reference(weight)
    got = layer(x)
    assert got.shape == (2, GEMM_MIN_ROWS, 40)
    assert_matmul_close(got - bias, x, w64)
    # Row by row (the decode kernel) gives the same numbers as the GEMM path.
    one_row = torch.stack([layer(x[:, i : i + 1]) for i in range(GEMM_MIN_ROWS)], dim=1)
    torch.testing.assert_close(one_row.squeeze(2), got, rtol=1e-5, atol=1e-5)


def test_linear_handles_empty_batches_and_strided_inputs() -> None:
    weight = random_weight("q4_1", rows=8, cols=32, seed=6)
    layer = frozen_linear(weight=weight)
    assert layer(torch.randn(0, 32)).shape == (0, 8)
    x = torch.randn(32, 3).T  # not contiguous
    assert_matmul_close(layer(x), x, reference(weight))


def test_linear_runs_under_torch_compile() -> None:
    weight = random_weight("q4_0", rows=24, cols=64, seed=7)
    layer = frozen_linear(weight=weight, bias=torch.randn(24))
    x = torch.randn(1, 64)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x))


@pytest.mark.parametrize("kind", KINDS)
def test_embedding_rows_are_the_dequantized_rows(kind: str) -> None:
    weight = random_weight(kind, rows=50, cols=64, seed=8)
    embedding = frozen_embedding(weight=weight)
    assert isinstance(embedding, QuantizedEmbedding)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    got = embedding(ids)
    assert got.shape == (2, 3, 64)
    assert torch.equal(got.double(), reference(weight)[ids])


def test_concat_and_select_rows_keep_blocks() -> None:
    a = random_weight("q4_1", rows=6, cols=64, seed=9)
    b = random_weight("q4_1", rows=4, cols=64, seed=10)
    fused = concat_rows([a, b])
    assert fused.shape == (10, 64)
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    order = torch.tensor([9, 0, 3])
    assert torch.equal(fused.select_rows(order).dequantize(), fused.dequantize()[order])
    with pytest.raises(ValueError, match="cannot fuse"):
        concat_rows([a, random_weight("q8_0", rows=2, cols=64, seed=11)])


def test_blocks_must_match_the_shape() -> None:
    weight = random_weight("q8_0", rows=4, cols=64, seed=12)
    with pytest.raises(ValueError, match="must be uint8"):
        QuantizedWeight(kind="q8_0", shape=(4, 96), blocks=weight.blocks)
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight(kind="q8_0", shape=(4, 40), blocks=weight.blocks)


@pytest.mark.parametrize(("kind", "levels"), [("q8_0", 127), ("q4_1", 15)])
def test_quantize_error_is_within_half_a_step(kind: str, levels: int) -> None:
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(13))
    q = quantize(w, kind=kind, field="checkpoint.weights")  # type: ignore[arg-type]
    blocks = w.reshape(-1, 32).double()
    if kind == "q8_0":
        step = blocks.abs().amax(dim=1, keepdim=True) / levels
    else:
        step = (blocks.amax(dim=1, keepdim=True) - blocks.amin(dim=1, keepdim=True)) / levels
    # Half a quantization step, plus fp16 rounding of the scale (and minimum).
    bound = 0.5 * step + blocks.abs().amax(dim=1, keepdim=True) * 2.0**-9
    error = (q.dequantize().double().reshape(-1, 32) - blocks).abs()
    assert bool((error <= bound).all())


def test_quantize_rejects_widths_that_are_not_whole_blocks() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint\.weights"):
        quantize(torch.randn(4, 40), kind="q8_0", field="checkpoint.weights")


def test_dequantized_leaves_float_tensors_alone() -> None:
    weight = random_weight("q4_0", rows=2, cols=32, seed=14)
    norm = torch.ones(3)
    dense = dequantized({"w": weight, "n": norm})
    assert dense["n"] is norm
    assert torch.equal(dense["w"], weight.dequantize())


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_gemms_round_to_bfloat16_and_leave_decode_rows_alone(kind: str) -> None:
    from torch import nn

    from llmrt.families.layers import select_gemm_dtype

    weight = random_weight(kind, rows=40, cols=64, seed=4)
    # A seeded bias: the bound below has no term for the bias's own bfloat16 rounding, and
    # the global generator's draw (which depends on the tests run before) broke it ~1%.
    bias = torch.randn(40, generator=torch.Generator().manual_seed(6))
    layer = frozen_linear(weight=weight, bias=bias)
    model = nn.Sequential(layer)
    x = torch.randn(GEMM_MIN_ROWS, 64, generator=torch.Generator().manual_seed(5))
    exact, decode = layer(x), layer(x[:1])
    assert select_gemm_dtype(model, choice="bfloat16", min_rows=GEMM_MIN_ROWS) == 1  # type: ignore[arg-type]
    low = layer(x)
    assert low.dtype == torch.float32
    # The GEMM really ran in bfloat16: x and w rounded to 8 mantissa bits, so not equal,
    # but within the rounding of both operands (2 * 2^-8 relative, summed over |x| |w|).
    x64, w64 = x.double(), reference(weight)
    bound = 2 * 2.0**-8 * (x64.abs() @ w64.abs().T) + 2.0**-8 * (x64 @ w64.T).abs() + 1e-3
    assert not torch.equal(low, exact)
    assert bool(((low - exact).double().abs() <= bound).all())
    assert torch.equal(layer(x[:1]), decode)  # one row: the float32 in-register kernel
    with pytest.raises(ConfigError, match="must be one of"):
        select_gemm_dtype(model, choice="float16")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="block-quantized"):
        select_gemm_dtype(nn.Sequential(nn.Linear(4, 4)), choice="bfloat16")  # type: ignore[arg-type]


def test_gemms_below_the_bfloat16_row_threshold_stay_float32() -> None:
    from torch import nn

    from llmrt.families.layers import select_gemm_dtype

    layer = frozen_linear(weight=random_weight("q4_1", rows=40, cols=64, seed=6))
    gen = torch.Generator().manual_seed(7)
    # The documented default (README, device.gemm_dtype_min_rows): bfloat16 from 128 rows.
    below = torch.randn(127, 64, generator=gen)
    at = torch.randn(128, 64, generator=gen)
    exact_below, exact_at = layer(below), layer(at)
    select_gemm_dtype(nn.Sequential(layer), choice="bfloat16")  # type: ignore[arg-type]
    assert torch.equal(layer(below), exact_below)  # the float32 GEMM, bit for bit
    assert not torch.equal(layer(at), exact_at)  # bfloat16 operands
    select_gemm_dtype(nn.Sequential(layer), choice="bfloat16", min_rows=8)  # type: ignore[arg-type]
    assert not torch.equal(layer(below[:8]), exact_below[:8])
    with pytest.raises(ConfigError, match="gemm_dtype_min_rows"):
        select_gemm_dtype(nn.Sequential(layer), choice="bfloat16", min_rows=0)  # type: ignore[arg-type]
