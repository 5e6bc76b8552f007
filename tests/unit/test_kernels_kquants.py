"""The GGUF block types of ``csrc/kquants.cpp`` (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16, BF16)
against gguf-py's own dequantization, on random valid blocks of odd shapes.

The GEMV bound: activations are quantized per 32 values in two 8-bit levels (x ~ d1 q1 +
d2 q2, d1 = amax / 127, d2 <= d1 / 254), so each value is off by at most amax / (2 * 127 *
254) ~ 1.6e-5 amax of its group. The result may thus differ from the float32 product of the
dequantized weight by sum_i |w_i| * 1.6e-5 * amax(group of i), plus float32 rounding of the
sums (1e-5 of sum |w_i x_i|); the test asserts 2e-5 and 1e-5 of those. The K-quants'
GEMVs at AVX2 below AVX-512 VNNI share one scale per 256 values (their super-block, ggml's
Q8_K; ``kblock_path`` in kquants.cpp), so there "group" is the 256 values of a super-block:
the bound for the K-quants takes amax over 256. 16-bit float rows read float32 x directly:
float32 rounding only.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from isa_products import assert_same_bits, has_level

from llmrt.device.cpu_features import read_cpu_features
from llmrt.kernels.formats import (
    GGML_TYPE,
    QuantizedWeight,
    StackedWeight,
    quantize,
)
from llmrt.kernels.native import kernels_available
from llmrt.testing.gguf_blocks import random_quantized

pytestmark = pytest.mark.skipif(not kernels_available()[0], reason="needs the CPU kernels")

KINDS = ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "f16", "bf16")
#: Widths per kind: block multiples, not powers of two where the block allows.
WIDTHS = {"q5_0": (32, 96, 576), "q5_1": (64, 160), "q4_k": (256, 768), "q5_k": (256, 512),
          "q6_k": (256, 1536), "f16": (8, 40, 576), "bf16": (24, 200)}  # fmt: skip
ROWS = (1, 7, 17, 40)


def reference(kind: str, blocks: np.ndarray, k: int) -> torch.Tensor:
    values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(GGML_TYPE[kind]))
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(blocks.shape[0], k))


def weight(kind: str, rows: int, k: int, seed: int = 0) -> QuantizedWeight:
    return random_quantized(kind, rows, k, seed=seed, scale=10.0)


def linear(w: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.llmrt_kernels.gguf_linear(
        x, w.blocks, w.kernel_type, w.shape[1], None
    )
    return out


def gemv_bound(kind: str, dense: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The stated bound (module doc) for every output of ``x @ dense.T``."""
    rounding = 1e-5 * (x.abs() @ dense.abs().T) + 1e-6
    if kind in ("f16", "bf16"):
        return rounding
    group = 256 if kind in ("q4_k", "q5_k", "q6_k") else 32
    groups = x.abs().reshape(x.shape[0], -1, group).amax(-1).repeat_interleave(group, dim=-1)
    return 2e-5 * (groups @ dense.abs().T) + rounding


#: The products the next test compares across levels: each K-quant kind at 1-5 rows.
_PRODUCTS = """
import sys, torch
from llmrt.testing.gguf_blocks import random_quantized
out = {}
for kind in ("q4_k", "q5_k", "q6_k"):
    w = random_quantized(kind, 48, 512, seed=7, scale=10.0)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    for rows in range(1, 6):
        out[kind, rows] = torch.ops.llmrt_kernels.gguf_linear(
            x[:rows].contiguous(), w.blocks, w.kernel_type, 512, None)
torch.save(out, sys.argv[1])
"""


#: Zen 4 (AMD family 25) with AVX-512 VNNI: 512-bit ops in two halves, so its K-quants take
#: the block-scaled path (``zmm_halves`` in csrc/cpu.h); other AVX-512 VNNI CPUs (Intel, Zen 5)
#: run the per-32 VNNI tile, whose numerics differ.
_CPU = read_cpu_features()
_ZEN4_VNNI = _CPU.vendor == "AuthenticAMD" and _CPU.family == "25" and has_level("avx512_vnni")


@pytest.mark.skipif(not _ZEN4_VNNI, reason="needs a Zen 4 CPU (AMD family 25) with AVX-512 VNNI")
def test_an_avx512_vnni_zen_runs_the_block_scaled_gemv_to_the_avx2_bits(tmp_path: Path) -> None:
    # On Zen 4 (512-bit ops in two halves) the K-quant GEMVs take the block-scaled path at
    # AVX-512 VNNI too, with vpdpwssd for vpmaddwd + vpaddd: integer sums, so the same bits.
    assert_same_bits(None, "avx2", code=_PRODUCTS, directory=tmp_path)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_equals_gguf_py(kind: str) -> None:
    for k in WIDTHS[kind]:
        for rows in ROWS:
            w = weight(kind, rows, k, seed=rows * k)
            expected = reference(kind, w.blocks.numpy(), k)
            # One rounding apart at most (a fused multiply-add where numpy rounds twice).
            torch.testing.assert_close(w.dequantize(), expected, rtol=2e-7, atol=1e-9)


@pytest.mark.parametrize("kind", KINDS)
def test_linear_is_the_float_product_within_its_bound(kind: str) -> None:
    torch.manual_seed(0)
    for k in WIDTHS[kind]:
        for rows in (1, 17, 40):
            w = weight(kind, rows, k, seed=rows + k)
            dense = reference(kind, w.blocks.numpy(), k)
            for m in (1, 2, 3, 5, 8, 13):
                x = torch.randn(m, k) * torch.rand(m, 1) * 4
                got, expected = linear(w, x), x @ dense.T
                error = (got - expected).abs()
                bound = gemv_bound(kind, dense, x)
                assert (error <= bound).all(), (
                    f"{kind} [{rows}, {k}] x {m} rows: error {error.max():.3g}, "
                    f"bound there {bound.flatten()[error.argmax()]:.3g}"
                )


@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k"])
def test_integer_gemm_is_the_float_product_within_its_bound(kind: str) -> None:
    """From ``kKquantGemmMinRows`` (8) rows the K-quants run the kernels' integer GEMM
    (``csrc/kquant_gemm.cpp``, per-call panels of 8 output columns, tiles of 4 or 6 rows): odd
    row and column counts exercise every tail, against gguf-py's dequantization."""
    torch.manual_seed(1)
    for n, k in ((1, 256), (13, 768), (45, 512), (67, 1536)):
        w = weight(kind, n, k, seed=n * 7 + k)
        dense = reference(kind, w.blocks.numpy(), k)
        for m in (8, 9, 11, 13, 37, 70):
            x = torch.randn(m, k) * torch.rand(m, 1) * 4
            error = (linear(w, x) - x @ dense.T).abs()
            bound = gemv_bound(kind, dense, x)
            assert (error <= bound).all(), (
                f"{kind} [{n}, {k}] x {m} rows: error {error.max():.3g}, "
                f"bound there {bound.flatten()[error.argmax()]:.3g}"
            )


def test_prefill_rows_take_the_integer_gemm_up_to_its_measured_limit() -> None:
    """A K-quant ``QuantizedLinear`` runs the integer GEMM (``gguf_linear``) up to
    ``kquant_gemm_max_rows`` rows and dequantizes + runs a float GEMM above it; both match
    the float product."""
    from llmrt.families.layers import QuantizedLinear
    from llmrt.kernels.native import kquant_gemm_max_rows

    w = weight("q4_k", 48, 512, seed=3)
    layer = QuantizedLinear(weight=w)
    limit = kquant_gemm_max_rows(w.kernel_type)
    x = torch.randn(2, 20, 512)
    assert layer.runs_gemm(40) == (limit < 40)
    above = max(limit + 1, layer.gemm_min_rows)
    assert layer.runs_gemm(above)
    torch.testing.assert_close(layer(x), x @ w.dequantize().T, rtol=1e-4, atol=2e-3)
    rows = min(above, 300)
    x = torch.randn(rows, 512)
    torch.testing.assert_close(layer(x), x @ w.dequantize().T, rtol=1e-4, atol=2e-3)


def test_embedding_rows_come_from_the_blocks() -> None:
    from llmrt.families.layers import frozen_embedding

    w = weight("q6_k", 33, 256, seed=5)
    embedding = frozen_embedding(weight=w)
    ids = torch.tensor([[0, 32, 7], [7, 1, 2]])
    assert torch.equal(embedding(ids), w.dequantize()[ids])


def test_the_block_shape_is_checked() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedWeight(kind="q4_k", shape=(2, 288), blocks=torch.zeros(2, 162, dtype=torch.uint8))
    blocks = torch.zeros(2, 143, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"uint8 \(2, 144\)"):
        QuantizedWeight(kind="q4_k", shape=(2, 256), blocks=blocks)


def test_mixed_kinds_stack_instead_of_a_float_copy() -> None:
    """A fused projection whose parts are stored in different kinds (llama.cpp's mixes) runs
    each part from its own blocks; the fused decode step takes it as one stacked weight
    (``csrc/stacked.cpp``) whose parts then view the stacked blob."""
    from llmrt.families.fused_decode import _linear
    from llmrt.families.layers import StackedLinear, bind_weight, frozen_linear

    parts = [weight("q5_0", 24, 256, seed=1), weight("q4_k", 8, 256, seed=2)]
    parts.append(quantize(torch.randn(8, 256), kind="q8_0", field="test"))
    parts.append(weight("q5_0", 5, 256, seed=4))
    bound = bind_weight(list(parts), device=torch.device("cpu"), dtype=torch.float32)
    assert isinstance(bound, StackedWeight) and bound.shape == (45, 256)
    bias = torch.randn(45)
    layer = frozen_linear(weight=bound, bias=bias)
    assert isinstance(layer, StackedLinear)
    dense = torch.cat([p.dequantize() for p in parts])
    for m in (1, 3, 20):  # 20 rows: each part dequantizes and runs a GEMM
        x = torch.randn(m, 256)
        bound_error = gemv_bound("q5_0", dense, x) + 1e-5
        assert ((layer(x) - (x @ dense.T + bias)).abs() <= bound_error).all()
    blob, code, fused_bias = _linear(layer, "qkv")
    assert fused_bias is not None and torch.equal(fused_bias, bias)
    lo, hi = blob.data_ptr(), blob.data_ptr() + blob.numel()
    assert all(lo <= p.weight.blocks.data_ptr() < hi for p in layer.parts)  # type: ignore[union-attr]
    assert all(lo <= q.blocks.data_ptr() < hi for q in parts)  # the holders' parts read it too
    for m in (1, 2, 7):
        x = torch.randn(m, 256)
        got = torch.ops.llmrt_kernels.gguf_linear(x, blob, code, 256, None)
        assert ((got - x @ dense.T).abs() <= gemv_bound("q5_0", dense, x) + 1e-5).all()
        torch.testing.assert_close(got + bias, layer(x), rtol=0, atol=1e-5)
    assert torch.equal(torch.ops.llmrt_kernels.gguf_dequantize(blob, code, 256), dense)
    same = bind_weight(parts[:1] + parts[3:], device=torch.device("cpu"), dtype=torch.float32)
    assert isinstance(same, QuantizedWeight) and same.kind == "q5_0"


def test_a_stacked_header_that_lies_is_refused() -> None:
    parts = (weight("q5_0", 4, 64, seed=1), weight("q5_1", 4, 64, seed=2))
    blob, code, _ = StackedWeight(parts=parts).packed()
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="header does not match"):
        torch.ops.llmrt_kernels.gguf_linear(x, blob, code + (1 << 36), 64, None)
    broken = blob.clone()
    broken.view(-1)[16 + 32 + 24 : 16 + 32 + 32] = 255  # part 1's offset: far outside
    with pytest.raises(RuntimeError, match="outside the blob"):
        torch.ops.llmrt_kernels.gguf_linear(x, broken, code, 64, None)


def test_only_the_interleavable_kinds_interleave() -> None:
    with pytest.raises(ValueError, match="interleaved layout takes"):
        weight("q4_k", 4, 256).interleaved()


def test_the_recipe_requantizes_only_gguf_native_weights() -> None:
    from llmrt.errors import RecipeError
    from llmrt.recipe.schema import CheckpointSpec

    spec = CheckpointSpec(format="gguf", path="m.gguf", weights="gguf-native", requantize="q8_0")
    assert spec.requantize == "q8_0"
    with pytest.raises(RecipeError, match=r"checkpoint\.requantize"):
        CheckpointSpec(format="gguf", path="m.gguf", weights="int8", requantize="q8_0")
    with pytest.raises(RecipeError, match=r"checkpoint\.requantize"):
        CheckpointSpec(format="gguf", path="m.gguf", weights="gguf-native", requantize="q4_0")  # type: ignore[arg-type]
