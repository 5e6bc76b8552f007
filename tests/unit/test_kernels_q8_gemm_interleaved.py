"""``interleaved_gemm_q8``: interleaved Q4_0 / Q4_1 / Q8_0 blocks times activations in one
8-bit level per 32 values.

The activation rounding is restated here from its definition: per 32-value block of a row,
``amax = max |x|``, ``d = amax / 127`` and ``q = nearbyint(x / d)`` (half to even), all in
float32, and ``d = 0, q = 0`` where ``amax`` is 0. The kernel must equal that quantized ``x``
times gguf-py's dequantized weight (float64) to float32 accumulation, and its error against
the unquantized product must be what one 8-bit level per block predicts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_kernels_gguf_blocks import KINDS, random_weight, reference
from torch._subclasses.fake_tensor import FakeTensorMode

from llmrt.device.cpu_features import (
    ISA_VARIABLE,
    TORCH_ISA_VARIABLES,
    forceable_levels,
    isa_at_least,
    read_cpu_features,
)
from llmrt.kernels.formats import QuantizedWeight
from llmrt.kernels.native import interleaved_gemm_q8_supported, load_kernels

load_kernels()

SUPPORTED = isa_at_least("avx2")
needs_kernel = pytest.mark.skipif(not SUPPORTED, reason="the one-level GEMM needs x86 AVX2")

#: (k, n): 3, 13, 25 and 16 blocks (partial interleaved groups; 512 the one multiple of 256), and
#: outputs that are no multiple of any panel width (8, 16, 32).
SHAPES = [(96, 40), (416, 72), (800, 52), (512, 33)]
ROWS = [1, 5, 17, 130, 512]


def quantize_one_level(x: np.ndarray) -> np.ndarray:
    """``x`` (float32 ``[rows, k]``) as its one-level 8-bit value ``d * q``, float64."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    q = np.rint(blocks / np.where(amax > 0, d, np.float32(1)))
    assert np.abs(q).max() <= 127
    return (d.astype(np.float64) * q).reshape(x.shape)


def offsets(weight: QuantizedWeight) -> np.ndarray:
    """Per weight, the block offset ``m`` the kernel splits off (w = d * u + m with u the
    unsigned quant: Q4_0 m = -8 d, Q4_1 its m, Q8_0 m = -128 d), float64 ``[n, k]``."""
    raw = weight.blocks.numpy().reshape(weight.shape[0], weight.shape[1] // 32, -1)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    if weight.kind == "q4_1":
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    else:
        m = (-8.0 if weight.kind == "q4_0" else -128.0) * d
    return np.repeat(m, 32, axis=1)


def gemm(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    inter = weight.interleaved()
    out: torch.Tensor = torch.ops.llmrt_kernels.interleaved_gemm_q8(
        x, inter.blocks, inter.kernel_type, weight.shape[1], bias
    )
    return out


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_one_level_activations_times_gguf_weights(
    kind: str, k: int, n: int, rows: int, with_bias: bool
) -> None:
    seed = rows * 7 + k + n
    weight = random_weight(kind, rows=n, cols=k, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.rand(rows, k // 32, 1, generator=gen).repeat(
        1, 1, 32
    ).reshape(rows, k)
    x[0, :32] = 0.0  # a block of zeros (d = 0)
    bias = torch.randn(n, generator=gen) if with_bias else None
    got = gemm(x, weight, bias).double().numpy()
    w64 = reference(weight).numpy()
    xq = quantize_one_level(x.numpy())
    want = xq @ w64.T
    if bias is not None:
        want = want + bias.double().numpy()
    # float32 scaling of exact per-block integer sums: relative to the summed magnitudes of
    # the kernel's terms (d_x d_w u and d_x m per weight).
    m = offsets(weight)
    terms = np.abs(xq) @ (np.abs(w64 - m) + np.abs(m)).T
    scale = terms + (0.0 if bias is None else np.abs(bias.double().numpy()))
    assert np.all(np.abs(got - want) <= 2e-6 * scale + 1e-6), np.abs(got - want).max()

    # Against the unquantized product: each value moved by at most d / 2 of its block, and
    # (uniform rounding) the outputs' error spread is what d^2 / 12 per value predicts.
    x64 = x.double().numpy()
    exact = x64 @ w64.T + (0.0 if bias is None else bias.double().numpy())
    err = got - exact
    step = np.repeat(np.abs(x64).reshape(rows, -1, 32).max(-1) / 127, 32, axis=1)
    assert np.all(np.abs(err) <= (step / 2) @ np.abs(w64).T + 1e-5 * scale + 1e-6)
    if rows * n >= 200:
        predicted = np.sqrt(((step**2) / 12) @ (w64**2).T)
        ratio = np.sqrt(np.mean(err**2)) / np.sqrt(np.mean(predicted**2))
        assert 0.7 < ratio < 1.3, ratio


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
def test_leading_dims_and_strided_x(kind: str) -> None:
    weight = random_weight(kind, rows=70, cols=416, seed=5)
    big = torch.randn(3, 9, 2 * 416, generator=torch.Generator().manual_seed(5))
    x = big[:, 1:8, ::2]
    assert not x.is_contiguous()
    got = gemm(x, weight, None)
    assert got.shape == (3, 7, 70)
    assert torch.equal(got, gemm(x.contiguous().reshape(21, 416), weight, None).reshape(3, 7, 70))


def test_the_fake_gives_the_output_shape() -> None:
    inter = random_weight("q4_0", rows=70, cols=416, seed=5).interleaved()
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = torch.ops.llmrt_kernels.interleaved_gemm_q8(
            torch.empty(3, 7, 416), inter.blocks, inter.kernel_type, 416, None
        )
    assert out.shape == (3, 7, 70) and out.dtype == torch.float32


@needs_kernel
def test_rows_are_independent_of_their_neighbours() -> None:
    weight = random_weight("q4_0", rows=100, cols=416, seed=9)
    x = torch.randn(130, 416, generator=torch.Generator().manual_seed(9))
    batch = gemm(x, weight, None)
    for r in (0, 5, 129):
        assert torch.equal(gemm(x[r : r + 1], weight, None)[0], batch[r])


def test_supported_at_avx2_and_above_for_interleaved_kinds_only() -> None:
    for kind in KINDS:
        inter = random_weight(kind, rows=2, cols=64, seed=1).interleaved()
        assert torch.ops.llmrt_kernels.interleaved_gemm_q8_supported(inter.kernel_type) == SUPPORTED
        assert interleaved_gemm_q8_supported(inter.kernel_type) == SUPPORTED
        plain = random_weight(kind, rows=2, cols=64, seed=1)
        assert not torch.ops.llmrt_kernels.interleaved_gemm_q8_supported(plain.kernel_type)


@needs_kernel
def test_bad_arguments_name_the_argument() -> None:
    weight = random_weight("q4_1", rows=8, cols=64, seed=2)
    inter = weight.interleaved()
    x = torch.randn(3, 64)
    op = torch.ops.llmrt_kernels.interleaved_gemm_q8
    with pytest.raises(RuntimeError, match="kind"):
        op(x, weight.blocks, weight.kernel_type, 64, None)
    with pytest.raises(RuntimeError, match="k must be"):
        op(x, inter.blocks, inter.kernel_type, 60, None)
    with pytest.raises(RuntimeError, match="x has 96 features"):
        op(torch.randn(3, 96), inter.blocks, inter.kernel_type, 64, None)
    with pytest.raises(RuntimeError, match="bias"):
        op(x, inter.blocks, inter.kernel_type, 64, torch.zeros(7))
    with pytest.raises(RuntimeError, match="blocks"):
        op(x, inter.blocks[:, :-2], inter.kernel_type, 64, None)


@pytest.mark.skipif(SUPPORTED, reason="the level runs the one-level GEMM")
def test_a_level_without_the_kernel_refuses_the_call() -> None:
    inter = random_weight("q4_0", rows=8, cols=64, seed=2).interleaved()
    with pytest.raises(RuntimeError, match="needs x86 AVX2"):
        torch.ops.llmrt_kernels.interleaved_gemm_q8(
            torch.randn(3, 64), inter.blocks, inter.kernel_type, 64, None
        )


_CHILD = """
import sys, torch
from test_kernels_gguf_blocks import random_weight
from llmrt.kernels.native import interleaved_gemm_q8_supported, load_kernels
load_kernels()
out = {}
for kind in ("q4_0", "q4_1", "q8_0"):
    inter = random_weight(kind, rows=70, cols=416, seed=3).interleaved()
    for rows in (1, 7, 130):
        x = torch.randn(rows, 416, generator=torch.Generator().manual_seed(rows))
        out[kind, rows] = torch.ops.llmrt_kernels.interleaved_gemm_q8(
            x, inter.blocks, inter.kernel_type, 416, None)
torch.save(out, sys.argv[1])
"""


@pytest.mark.skipif(
    not isa_at_least("avx512_vnni") or bool(os.environ.get(ISA_VARIABLE)),
    reason="compares the CPU's own VNNI loop with the AVX2 one (needs AVX-512 VNNI)",
)
def test_every_level_gives_the_same_bits(tmp_path: Path) -> None:
    """Every level sums exact integers per block and scales them in the same float32 steps,
    so children forced to avx2 (vpmaddubsw) and avx_vnni where the CPU has it (256-bit
    vpdpbusd) return the native (AVX-512 VNNI) bits."""
    here = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k not in TORCH_ISA_VARIABLES}
    outs = {}
    levels = [lv for lv in ("avx2", "avx_vnni") if lv in forceable_levels(read_cpu_features())]
    for level in [*levels, ""]:
        path = tmp_path / f"{level or 'native'}.pt"
        run = subprocess.run(
            [sys.executable, "-c", _CHILD, str(path)],
            env={**env, ISA_VARIABLE: level, "PYTHONPATH": str(here)},
            capture_output=True,
            text=True,
            cwd=here.parents[1],
        )
        assert run.returncode == 0, run.stderr[-3000:]
        outs[level] = torch.load(path)
    for level in levels:
        assert outs[level].keys() == outs[""].keys()
        for key, got in outs[level].items():
            assert torch.equal(got, outs[""][key]), (level, key)
