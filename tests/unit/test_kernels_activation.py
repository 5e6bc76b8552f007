"""``llmrt_kernels.mlp_activation`` and the MLP path that uses it.

The op against torch's own activations computed in float32 (the four passes it replaces),
for every activation code, gated and plain, float32 and bfloat16 on either side; and a
block-quantized MLP whose C++ activation path must give what the torch path gives.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from llmrt.families.decoder_layers import MLP
from llmrt.families.layers import ACTIVATIONS, frozen_linear
from llmrt.kernels.formats import quantize
from llmrt.kernels.native import load_kernels

load_kernels()
op = torch.ops.llmrt_kernels.mlp_activation

TORCH_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda v: torch.square(F.relu(v)),
}
DTYPES = (torch.float32, torch.bfloat16)


def torch_reference(y: torch.Tensor, name: str, gated: bool, dtype: torch.dtype) -> torch.Tensor:
    wide = y.float()
    if not gated:
        return TORCH_ACTIVATIONS[name](wide).to(dtype)
    gate, up = wide.chunk(2, dim=-1)
    return (TORCH_ACTIVATIONS[name](gate) * up).to(dtype)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("src", DTYPES, ids=["in-f32", "in-bf16"])
@pytest.mark.parametrize("dst", DTYPES, ids=["out-f32", "out-bf16"])
def test_matches_torch_in_float32(
    name: str, gated: bool, src: torch.dtype, dst: torch.dtype
) -> None:
    # 37 rows of 2 x 83 columns: row counts and widths that are not multiples of 16.
    y = (torch.randn(37, 166, generator=torch.Generator().manual_seed(3)) * 4).to(src)
    got = op(y, ACTIVATIONS[name], gated, dst)
    expected = torch_reference(y, name, gated, dst)
    assert got.dtype == dst and got.shape == expected.shape
    if dst == torch.bfloat16:
        # Both round the same float32 value to bfloat16; float32 differences of a few ulps
        # may move a value across a rounding boundary (one bfloat16 step, 2^-7 relative).
        bound = 2.0**-7 * expected.float().abs() + 1e-5
        close = (got.float() - expected.float()).abs() <= bound
        assert bool(close.all())
        # SiLU's vector e^x is within float32 rounding; the others' scalar erf/tanh differ
        # from torch's by more ulps, so more values land across a boundary (5.4% for GELU
        # where LLMRT_KERNELS_ISA=scalar caps torch's own erf at its unvectorized form).
        assert (got != expected).float().mean() < (0.01 if name == "silu" else 0.08)
    else:
        # GELU's 1 + erf cancels for negative inputs: std::erf and torch's vectorized erf
        # differ there by a few 1e-6 absolute.
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=5e-6)


def test_batched_leading_dims_and_strided_inputs() -> None:
    y = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(4))
    strided = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(5))[..., ::2]
    for x in (y, strided):
        got = op(x, ACTIVATIONS["silu"], True, torch.float32)
        assert got.shape == (2, 5, 32)
        torch.testing.assert_close(got, torch_reference(x, "silu", True, torch.float32))
    assert op(torch.empty(0, 8), 0, True, torch.bfloat16).shape == (0, 4)


def test_bad_inputs_name_the_problem() -> None:
    with pytest.raises(RuntimeError, match="even last dim"):
        op(torch.randn(3, 7), 0, True, torch.float32)
    with pytest.raises(RuntimeError, match="unknown activation 9"):
        op(torch.randn(3, 8), 9, True, torch.float32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16, got Half"):
        op(torch.randn(3, 8).half(), 0, True, torch.float32)
    with pytest.raises(RuntimeError, match="output dtype must be float32 or bfloat16"):
        op(torch.randn(3, 8), 0, True, torch.float16)


@pytest.mark.parametrize("gemm_dtype", DTYPES, ids=["f32-gemm", "bf16-gemm"])
@pytest.mark.parametrize("rows", [3, 64, 160], ids=["kernel-rows", "f32-gemm-rows", "gemm-rows"])
def test_a_quantized_mlp_gives_what_the_torch_path_gives(
    gemm_dtype: torch.dtype, rows: int
) -> None:
    gen = torch.Generator().manual_seed(6)
    up = frozen_linear(
        weight=quantize(torch.randn(2 * 96, 64, generator=gen) * 0.2, kind="q4_1", field="w")
    )
    down = frozen_linear(
        weight=quantize(torch.randn(64, 96, generator=gen) * 0.2, kind="q8_0", field="w")
    )
    for linear in (up, down):
        linear.gemm_dtype = gemm_dtype  # type: ignore[union-attr]
    mlp = MLP(activation="silu", gated=True, up=up, down=down)
    x = torch.randn(1, rows, 64, generator=gen)
    assert mlp._native(x)
    # GEMMs of 128 rows or more run in gemm_dtype (bfloat16 from there on).
    assert up.gemm_input_dtype(rows) == (gemm_dtype if rows >= 128 else torch.float32)  # type: ignore[union-attr]
    got = mlp(x)
    mlp.allow_native = False
    expected = mlp(x)
    assert got.dtype == torch.float32
    # The same roundings in the same places: equal up to the activation's float32 ulps
    # (which, in a bfloat16 GEMM's input, can move one value by a bfloat16 step).
    torch.testing.assert_close(
        got, expected, rtol=2e-2 if gemm_dtype == torch.bfloat16 else 1e-5, atol=1e-4
    )


def test_float_weights_and_other_activations_keep_the_torch_path() -> None:
    linear = frozen_linear(weight=torch.randn(16, 8))
    down = frozen_linear(weight=torch.randn(8, 8))
    mlp = MLP(activation="silu", gated=True, up=linear, down=down)
    assert not mlp._native(torch.randn(2, 8))
    # A model whose float linears become block-quantized after the build
    # (``checkpoint.weights: int8 | int4``) takes the native path from then on.
    mlp.up = frozen_linear(weight=quantize(torch.randn(16, 32), kind="q8_0", field="w"))
    assert mlp._native(torch.randn(2, 32))
    mlp.activation = "gelu"
    assert not mlp._native(torch.randn(2, 32))
