"""``kquant_gemm_q8`` (``csrc/kquant_q8_gemm.cpp``): Q4_K / Q5_K / Q6_K blocks against
activations quantized in one 8-bit level, on random valid blocks of odd shapes.

The activation rule, restated here from the op's contract: per row and per 256 consecutive
values, ``amax = max |x|``, ``d = amax / 127`` and ``q = nearbyint(x * (127 / amax))`` in
float32 (ties to even; all zero where ``amax`` is 0). The kernel then is exact integer dot
products scaled in float32, so it must equal ``(q * d) @ W.T`` in float64, ``W`` gguf-py's
dequantization, within float32 rounding of the sums (1e-5 of ``|q d| @ |W|.T``).

Against the unquantized ``x @ W.T`` the error is one 8-bit level's: each value is off by at
most ``d / 2`` (``amax / 254`` of its 256), so ``|err| <= |W| @ (amax / 254)``; and uniformly
spread rounding errors predict an RMS of ``sqrt((W^2) @ (d^2 / 12))`` per output, which the
observed RMS must match within a factor of 2 (a kernel that quantized nothing, or twice as
coarsely, fails).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from isa_products import assert_same_bits, has_level

from llmrt.kernels.formats import GGML_TYPE
from llmrt.kernels.native import kernels_available, kernels_isa
from llmrt.testing.gguf_blocks import random_blocks

pytestmark = pytest.mark.skipif(not kernels_available()[0], reason="needs the CPU kernels")

KINDS = ("q4_k", "q5_k", "q6_k")
SUPPORTED = kernels_available()[0] and kernels_isa()[0] in (
    "avx2", "avx_vnni", "avx512", "avx512_vnni"
)  # fmt: skip
needs_kernel = pytest.mark.skipif(not SUPPORTED, reason="kquant_gemm_q8 needs x86 AVX2")


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The op's activation rule: (q, d) per 256 values, q float32 integers, d ``[rows, k/256]``."""
    v = x.astype(np.float32).reshape(x.shape[0], -1, 256)
    amax = np.abs(v).max(-1)
    with np.errstate(divide="ignore"):
        s = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(v * s[..., None]).astype(np.float32)
    d = (amax / np.float32(127)).astype(np.float32)
    return q, d


def dequantized(kind: str, blocks: np.ndarray, k: int) -> np.ndarray:
    values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(GGML_TYPE[kind]))
    return np.asarray(values, dtype=np.float64).reshape(blocks.shape[0], k)


def gemm_q8(x: torch.Tensor, blocks: np.ndarray, kind: str, k: int,
            bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    out: torch.Tensor = torch.ops.llmrt_kernels.kquant_gemm_q8(
        x, torch.from_numpy(blocks), GGML_TYPE[kind], k, bias
    )
    return out


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_the_one_level_product(kind: str, with_bias: bool) -> None:
    rng = np.random.default_rng(GGML_TYPE[kind] + 100 * with_bias)
    for n, k in ((13, 256), (67, 768), (203, 2048)):
        blocks = random_blocks(kind, n, k, seed=n * 31 + k, scale=10.0)
        w = dequantized(kind, blocks, k)
        bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
        for rows in (1, 5, 17, 130, 512):
            if rows == 512 and k != 2048:
                continue
            x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 4, (rows, 1))).astype(np.float32)
            x[0, :256] = 0.0  # a super-block of zeros: d = 0
            q, d = quantize_rows(x)
            xq = (q.astype(np.float64) * d[..., None]).reshape(rows, k)
            expected = xq @ w.T + (0.0 if bias is None else bias.astype(np.float64))
            got = gemm_q8(
                torch.from_numpy(x), blocks, kind, k,
                None if bias is None else torch.from_numpy(bias),
            ).numpy()  # fmt: skip
            tol = 1e-5 * (np.abs(xq) @ np.abs(w).T) + 1e-6 * (1 + np.abs(expected))
            error = np.abs(got - expected)
            assert (error <= tol).all(), (
                f"{kind} [{n}, {k}] x {rows} rows: error {error.max():.3g}, "
                f"tolerance there {tol.flat[error.argmax()]:.3g}"
            )


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
def test_error_is_one_8_bit_level(kind: str) -> None:
    rng = np.random.default_rng(7)
    n, k, rows = 45, 1024, 40
    blocks = random_blocks(kind, n, k, seed=11, scale=10.0)
    w = dequantized(kind, blocks, k)
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 4, (rows, 1))).astype(np.float32)
    got = gemm_q8(torch.from_numpy(x), blocks, kind, k).numpy().astype(np.float64)
    error = got - x.astype(np.float64) @ w.T
    _, d = quantize_rows(x)
    d_per_value = np.repeat(d.astype(np.float64), 256, axis=1)
    bound = (d_per_value / 2) @ np.abs(w).T * (1 + 1e-5) + 1e-5 * (np.abs(x) @ np.abs(w).T)
    assert (np.abs(error) <= bound).all()
    predicted_rms = np.sqrt(((d_per_value**2 / 12) @ (w**2).T).mean())
    observed_rms = np.sqrt((error**2).mean())
    assert 0.5 * predicted_rms < observed_rms < 2 * predicted_rms, (observed_rms, predicted_rms)


@needs_kernel
def test_leading_dims_and_strided_x() -> None:
    kind, n, k = "q4_k", 21, 512
    blocks = random_blocks(kind, n, k, seed=3, scale=10.0)
    base = torch.randn(k, 2, 3).permute(1, 2, 0)  # [2, 3, k], not contiguous
    assert not base.is_contiguous()
    got = gemm_q8(base, blocks, kind, k)
    assert got.shape == (2, 3, n)
    flat = gemm_q8(base.reshape(6, k).contiguous(), blocks, kind, k)
    assert torch.equal(got.reshape(6, n), flat)


@needs_kernel
def test_bad_arguments_name_the_argument() -> None:
    blocks = random_blocks("q4_k", 8, 256, seed=1)
    x = torch.randn(3, 256)
    assert gemm_q8(x, blocks, "q4_k", 256).shape == (3, 8)
    with pytest.raises(RuntimeError, match="kind"):
        torch.ops.llmrt_kernels.kquant_gemm_q8(x, torch.from_numpy(blocks), 2, 256, None)
    with pytest.raises(RuntimeError, match="features"):
        gemm_q8(torch.randn(3, 512), blocks, "q4_k", 256)
    with pytest.raises(RuntimeError, match="bias"):
        gemm_q8(x, blocks, "q4_k", 256, torch.zeros(7))


def test_supported_only_for_k_quants_at_avx2_and_above() -> None:
    for kind in KINDS:
        assert torch.ops.llmrt_kernels.kquant_gemm_q8_supported(GGML_TYPE[kind]) == SUPPORTED
    for other in ("q4_0", "q4_1", "q8_0", "q5_0"):
        assert not torch.ops.llmrt_kernels.kquant_gemm_q8_supported(GGML_TYPE[other])


#: The products the next test compares across levels: one, two and three panels (9 and 17
#: columns leave a panel alone, the one-panel tile), two pack blocks (203 x 768: 16 + 10
#: panels), row counts around the 4- and 6-row tiles.
_PRODUCTS = """
import sys, torch
from llmrt.kernels.formats import GGML_TYPE
from llmrt.testing.gguf_blocks import random_blocks
out = {}
for kind in ("q4_k", "q5_k", "q6_k"):
    for n, k in ((9, 256), (13, 256), (17, 256), (203, 768)):
        blocks = torch.from_numpy(random_blocks(kind, n, k, seed=n + k, scale=10.0))
        x = torch.randn(41, k, generator=torch.Generator().manual_seed(n))
        for rows in (1, 5, 6, 7, 12, 41):
            out[kind, n, rows] = torch.ops.llmrt_kernels.kquant_gemm_q8(
                x[:rows].contiguous(), blocks, GGML_TYPE[kind], k, None)
torch.save(out, sys.argv[1])
"""


@needs_kernel
@pytest.mark.parametrize("level", ["avx_vnni", "avx512_vnni"])
def test_the_vnni_loops_give_the_avx2_loops_bits(level: str, tmp_path: Path) -> None:
    # Integer dot products both ways (vpdpbusd against vpmaddubsw + vpmaddwd), then the same
    # float steps: the same bits, one panel or two per broadcast.
    if not has_level(level):
        pytest.skip(f"this CPU has no {level}")
    assert_same_bits(level, "avx2", code=_PRODUCTS, directory=tmp_path)
