"""The interleaved block layout and its integer-dot kernels.

The layout is restated here from its definition (a row is groups of 4 blocks for Q4_0/Q4_1,
2 for Q8_0; a group holds its blocks' quants, then their fp16 d, then (Q4_1) their fp16 m;
Q8_0 quants are stored plus 128), and checked byte by byte. Products run on activations
split into two 8-bit levels per 32-wide block, so the stated error bound is the larger of
float32 accumulation and one 256th of an 8-bit step of each block.
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

from llmrt.device.cpu_features import (
    ISA_VARIABLE,
    TORCH_ISA_VARIABLES,
    CpuFeatures,
    isa_at_least,
)
from llmrt.errors import ConfigError
from llmrt.families.layers import (
    QuantizedEmbedding,
    QuantizedLinear,
    auto_interleaved_kinds,
    select_weight_layout,
)
from llmrt.kernels.formats import BLOCK_BYTES, QuantizedWeight, concat_rows
from llmrt.kernels.native import (
    int8_dot_supported,
    integer_gemm_supported,
    kquant_gemm_max_rows,
    q8_gemm_supported,
)

GROUP = {"q4_0": 4, "q4_1": 4, "q8_0": 2}
#: Widths whose last group holds 1, 2, 3 or 4 blocks (and several groups).
WIDTHS = [32, 64, 96, 128, 160, 576]


def expected_layout(weight: QuantizedWeight) -> np.ndarray:
    """The interleaved bytes of ``weight`` (ggml layout), built from the definition."""
    raw = weight.blocks.numpy()
    bb = BLOCK_BYTES[weight.kind]
    nb = weight.shape[1] // 32
    out = np.zeros_like(raw)
    g = GROUP[weight.kind]
    for b0 in range(0, nb, g):
        c = min(g, nb - b0)
        base = b0 * bb
        for i in range(c):
            blk = raw[:, (b0 + i) * bb : (b0 + i + 1) * bb]
            if weight.kind == "q8_0":
                out[:, base + 32 * i : base + 32 * i + 32] = blk[:, 2:34] ^ 0x80
                out[:, base + 32 * c + 2 * i : base + 32 * c + 2 * i + 2] = blk[:, 0:2]
            else:
                head = 4 if weight.kind == "q4_1" else 2
                out[:, base + 16 * i : base + 16 * i + 16] = blk[:, head : head + 16]
                out[:, base + 16 * c + 2 * i : base + 16 * c + 2 * i + 2] = blk[:, 0:2]
                if weight.kind == "q4_1":
                    out[:, base + 18 * c + 2 * i : base + 18 * c + 2 * i + 2] = blk[:, 2:4]
    return out


def two_level_bound(x: torch.Tensor, w64: torch.Tensor) -> torch.Tensor:
    """Per-output bound: float32 accumulation plus |w| times each block's rounding
    (max |x| of the block / 127 / 256)."""
    x64 = x.double().reshape(-1, x.shape[-1])
    blocks = x64.reshape(x64.shape[0], -1, 32).abs().amax(-1, keepdim=True)
    step = (blocks / 127 / 256).expand(-1, -1, 32).reshape(x64.shape)
    return step @ w64.abs().T + 1e-5 * (x64.abs() @ w64.abs().T) + 1e-6


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cols", WIDTHS)
def test_interleave_follows_the_layout_and_dequantizes_exactly(kind: str, cols: int) -> None:
    weight = random_weight(kind, rows=5, cols=cols, seed=cols)
    inter = weight.interleaved()
    assert inter.layout == "interleaved" and inter.shape == weight.shape
    assert inter.blocks.shape == weight.blocks.shape
    assert inter.blocks.data_ptr() != weight.blocks.data_ptr()
    assert np.array_equal(inter.blocks.numpy(), expected_layout(weight))
    assert torch.equal(inter.dequantize().double(), reference(weight))
    assert inter.interleaved() is inter


@pytest.mark.parametrize("kind", KINDS)
# 1-15 rows: the tile loop; from 16 the integer GEMM (6-row tiles with VNNI, 4 at AVX2, so
# 17 and 33 end in a partial tile; at AVX2 the 70 output rows are too few for
# kquant_gemm.cpp's panels, so 130 rows stay on the integer GEMM for the 4-bit kinds (the
# panels: test_wide_linears_at_prefill_rows_are_within_the_two_level_bound) and dequantize
# for Q8_0); 70 output rows end in a partial panel of 32 (VNNI) or 16 (AVX2) columns.
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 15, 16, 17, 33, 130])
@pytest.mark.parametrize("cols", [96, 160, 576])
def test_linear_on_interleaved_blocks_is_within_the_two_level_bound(
    kind: str, rows: int, cols: int
) -> None:
    weight = random_weight(kind, rows=70, cols=cols, seed=rows)
    w64 = reference(weight)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols, generator=gen)
    x[:, 3] = 40.0  # an outlier: every other value of its block is rounded against it
    x[0, 32:64] = 0.0  # an all-zero block
    linear = QuantizedLinear(weight=weight.interleaved())
    got = linear(x).double()
    error = (got - x.double() @ w64.T).abs()
    assert bool((error <= two_level_bound(x, w64)).all())
    panels = kquant_gemm_max_rows(linear.ggml_type) >= rows
    if rows >= 16 and (integer_gemm_supported() or (int8_dot_supported() and rows < 128) or panels):
        # The integer GEMM quantizes each row as the one-row loop does: the two differ only
        # in float32 summation order (a loose pack or scale would show far above that).
        alone = torch.cat([linear(x[r : r + 1]) for r in range(rows)]).double()
        sums = x.double().abs() @ w64.abs().T
        assert bool(((got - alone).abs() <= 1e-5 * sums + 1e-6).all())
    # One 8-bit level would be off by up to 256 times more: the second level is there.
    one_level = (two_level_bound(x, w64) - 1e-5 * (x.double().abs() @ w64.abs().T)) * 256
    assert float(error.max()) < float(one_level.max()) / 16


@pytest.mark.parametrize("kind", ["q4_0", "q4_1"])
def test_wide_linears_at_prefill_rows_are_within_the_two_level_bound(kind: str) -> None:
    # At AVX2 below VNNI, 4-bit linears of 1024 output rows or more take kquant_gemm.cpp's
    # panels from 128 activation rows (narrower ones interleaved_gemm.cpp's loop): 1030
    # output rows end in a partial 8-column panel, 130 activation rows in a partial tile.
    weight = random_weight(kind, rows=1030, cols=96, seed=11)
    w64 = reference(weight)
    x = torch.randn(130, 96, generator=torch.Generator().manual_seed(11))
    x[5, 40] = 50.0
    linear = QuantizedLinear(weight=weight.interleaved())
    got = linear(x).double()
    error = (got - x.double() @ w64.T).abs()
    assert bool((error <= two_level_bound(x, w64)).all())
    if int8_dot_supported() and not linear.runs_gemm(130):
        # Each row quantized as the one-row loop does: only float32 summation order differs.
        alone = torch.cat([linear(x[r : r + 1]) for r in range(0, 130, 13)]).double()
        sums = x[::13].double().abs() @ w64.abs().T
        assert bool(((got[::13] - alone).abs() <= 1e-5 * sums + 1e-6).all())


_AVX2_GEMM_CHILD = """
import sys, torch
from test_kernels_gguf_blocks import random_weight
from llmrt.families.layers import QuantizedLinear
from llmrt.kernels.native import load_kernels
load_kernels()
out = {}
for kind in ("q4_0", "q4_1", "q8_0"):
    linear = QuantizedLinear(weight=random_weight(kind, rows=70, cols=160, seed=3).interleaved())
    for rows in (16, 17, 33, 100):
        x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
        out[kind, rows] = linear(x)
torch.save(out, sys.argv[1])
"""


@pytest.mark.skipif(
    not isa_at_least("avx512_vnni") or bool(os.environ.get(ISA_VARIABLE)),
    reason="compares the CPU's own VNNI GEMM with the AVX2 one (needs AVX-512 VNNI)",
)
def test_the_avx2_integer_gemm_gives_the_vnni_gemms_bits(tmp_path: Path) -> None:
    """Both GEMMs sum 256 * sum(w h) + sum(w l) exactly per block (dpbusd per level against
    one madd on h and l joined into 16 bits) and scale it in the same float32 steps, so a
    child forced to avx2 must return this process's bits: 4-bit and 8-bit kinds, whole and
    partial tiles and panels (70 output columns)."""
    here = Path(__file__).resolve().parent
    outs = {}
    for level in ("avx2", ""):
        path = tmp_path / f"{level or 'native'}.pt"
        env = {k: v for k, v in os.environ.items() if k not in TORCH_ISA_VARIABLES}
        run = subprocess.run(
            [sys.executable, "-c", _AVX2_GEMM_CHILD, str(path)],
            env={**env, ISA_VARIABLE: level, "PYTHONPATH": str(here)},
            capture_output=True,
            text=True,
            cwd=here.parents[1],
        )
        assert run.returncode == 0, run.stderr[-3000:]
        outs[level] = torch.load(path)
    assert outs["avx2"].keys() == outs[""].keys()
    for key, got in outs["avx2"].items():
        assert torch.equal(got, outs[""][key]), key


@pytest.mark.parametrize("kind", ["q4_0", "q4_1"])
def test_interleaved_linear_is_deterministic_and_row_independent(kind: str) -> None:
    # 12 rows: a tile of eight (its sums from one shuffle tree) and one of four.
    weight = random_weight(kind, rows=100, cols=576, seed=7).interleaved()
    linear = QuantizedLinear(weight=weight)
    x = torch.randn(12, 576)
    batch = linear(x)
    assert torch.equal(batch, linear(x))
    for r in (0, 5, 11):
        assert torch.equal(linear(x[r : r + 1])[0], batch[r])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cols", [96, 160, 576, 1536])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 101])
def test_one_activation_row_matches_the_batched_rows_bit_for_bit(
    kind: str, cols: int, rows: int
) -> None:
    # One activation row runs its own loop (four weight rows per pass over the prepared
    # activations, the rest one at a time; whole groups apart from the last, narrower one);
    # its sums must equal, bit for bit, those the batched tile loop computes for the same
    # row, whatever the row count and the last group's width (96 columns: a lone 4-bit group
    # of 3 blocks, Q8_0 a group and a lone block; 160: a 4-bit group of 1; 576: 4 groups and
    # one of 2).
    weight = random_weight(kind, rows=rows, cols=cols, seed=rows + cols).interleaved()
    linear = QuantizedLinear(weight=weight)
    x = torch.randn(5, cols)
    batch = linear(x)
    for r in range(5):
        assert torch.equal(linear(x[r : r + 1])[0], batch[r]), r
    reference = x.double() @ weight.dequantize().double().T
    assert torch.allclose(batch.double(), reference, rtol=1e-2, atol=1e-2 * cols**0.5)


@pytest.mark.parametrize("kind", KINDS)
def test_many_rows_span_row_chunks_and_panels_within_the_bound(kind: str) -> None:
    # 300 rows of 1536 features prepare in chunks (a chunk's prepared rows stay under
    # 768 KB: 222 rows here), and 33 output rows are a whole panel and one column of the next.
    weight = random_weight(kind, rows=33, cols=1536, seed=5)
    w64 = reference(weight)
    x = torch.randn(300, 1536, generator=torch.Generator().manual_seed(5))
    x[7, 100] = 60.0
    got = QuantizedLinear(weight=weight.interleaved())(x).double()
    error = (got - x.double() @ w64.T).abs()
    assert bool((error <= two_level_bound(x, w64)).all())
    if integer_gemm_supported():  # the integer GEMM's rows are independent of their neighbours
        tail = QuantizedLinear(weight=weight.interleaved())(x[250:290]).double()
        assert torch.equal(tail, got[250:290])


def test_concat_and_select_rows_keep_the_layout() -> None:
    a = random_weight("q4_1", rows=3, cols=96, seed=1)
    b = random_weight("q4_1", rows=4, cols=96, seed=2)
    fused = concat_rows([a.interleaved(), b.interleaved()])
    assert fused.layout == "interleaved"
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    picked = fused.select_rows(torch.tensor([6, 0]))
    assert picked.layout == "interleaved"
    assert torch.equal(picked.dequantize(), fused.dequantize()[[6, 0]])
    with pytest.raises(ValueError, match="layouts"):
        concat_rows([a, b.interleaved()])


def test_interleaving_twice_or_a_dense_weight_is_refused() -> None:
    weight = random_weight("q4_0", rows=2, cols=64, seed=3).interleaved()
    with pytest.raises(RuntimeError, match="interleaved already"):
        torch.ops.llmrt_kernels.gguf_interleave(weight.blocks, weight.kernel_type, 64)
    with pytest.raises(ValueError, match="layout"):
        QuantizedWeight(kind="q4_0", shape=(2, 64), blocks=weight.blocks, layout="tiled")  # type: ignore[arg-type]


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = QuantizedLinear(weight=random_weight("q4_1", rows=8, cols=64, seed=1))
        self.b = QuantizedLinear(weight=random_weight("q4_0", rows=8, cols=64, seed=2))
        self.c = QuantizedLinear(weight=random_weight("q8_0", rows=8, cols=64, seed=3))


def _layouts(model: _Model) -> dict[str, str]:
    return {name: m.weight.layout for name, m in model.named_children()}


_AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
AMD = CpuFeatures(vendor="AuthenticAMD", flags=_AVX512)
INTEL = CpuFeatures(vendor="GenuineIntel", flags=_AVX512)
AMD_AVX2 = CpuFeatures(vendor="AuthenticAMD", flags=_AVX2)


def _q8_interleaved(cpu: CpuFeatures) -> bool:
    """Q8_0 interleaves on Intel, and wherever the level runs below AVX-512 (no float32
    block kernel of that level beats the integer one)."""
    return cpu.vendor == "GenuineIntel" or not isa_at_least("avx512", cpu)


def test_auto_interleaves_q8_0_on_intel_and_below_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ISA_VARIABLE, raising=False)
    assert auto_interleaved_kinds(AMD) == ("q4_0", "q4_1")
    assert auto_interleaved_kinds(INTEL) == ("q4_0", "q4_1", "q8_0")
    assert auto_interleaved_kinds(AMD_AVX2) == ("q4_0", "q4_1", "q8_0")
    assert auto_interleaved_kinds(CpuFeatures()) == ("q4_0", "q4_1", "q8_0")
    monkeypatch.setenv(ISA_VARIABLE, "avx2")  # the same EPYC forced to AVX2
    assert auto_interleaved_kinds(AMD) == ("q4_0", "q4_1", "q8_0")


@pytest.mark.parametrize("cpu", [AMD, INTEL], ids=["amd", "intel"])
def test_weight_layout_choices(cpu: CpuFeatures) -> None:
    device = torch.device("cpu")
    model = _Model()
    before = {name: m.weight.dequantize() for name, m in model.named_children()}
    assert select_weight_layout(model, choice="ggml", device=device, cpu=cpu) == 0  # type: ignore[arg-type]
    assert set(_layouts(model).values()) == {"ggml"}
    changed = select_weight_layout(model, choice="auto", device=device, cpu=cpu)  # type: ignore[arg-type]
    if int8_dot_supported():
        q8 = "interleaved" if _q8_interleaved(cpu) else "ggml"
        assert changed == (3 if _q8_interleaved(cpu) else 2)
        assert _layouts(model) == {"a": "interleaved", "b": "interleaved", "c": q8}
        assert model.a.ggml_type == 3 + 256 and model.a.blocks is model.a.weight.blocks
    else:
        assert changed == 0
    select_weight_layout(model, choice="interleaved", device=device, cpu=cpu)  # type: ignore[arg-type]
    assert set(_layouts(model).values()) == {"interleaved"}
    for name, m in model.named_children():
        assert torch.equal(m.weight.dequantize(), before[name])


class _Tied(torch.nn.Module):
    """An embedding and LM head over one Q8_0 table (tied word embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        table = random_weight("q8_0", rows=50, cols=96, seed=4)
        self.embed = QuantizedEmbedding(weight=table)
        self.head = QuantizedLinear(weight=table)


@pytest.mark.parametrize("choice", ["auto", "interleaved"])
def test_a_tied_embedding_follows_its_head_into_one_copy(choice: str) -> None:
    model = _Tied()
    ids = torch.tensor([0, 7, 49, 7])
    rows = model.embed(ids)
    ggml_blocks = model.embed.blocks
    changed = select_weight_layout(model, choice=choice, device=torch.device("cpu"), cpu=INTEL)  # type: ignore[arg-type]
    if choice == "auto" and not int8_dot_supported():
        assert changed == 0
        return
    assert changed == 1
    assert model.head.weight.layout == "interleaved"
    assert model.embed.weight is model.head.weight  # one interleaved copy, shared
    assert model.embed.blocks is model.head.blocks and model.embed.blocks is not ggml_blocks
    assert model.embed.ggml_type == 8 + 256
    assert torch.equal(model.embed(ids), rows)  # the same rows, bit for bit
    with pytest.raises(ValueError, match="does not replace"):
        model.embed.use_weight(random_weight("q8_0", rows=49, cols=96, seed=4))


def test_weight_layout_errors_name_the_field() -> None:
    model = _Model()
    with pytest.raises(ConfigError, match=r"device\.weight_layout"):
        select_weight_layout(model, choice="tiled", device=torch.device("cpu"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cpu layout"):
        select_weight_layout(model, choice="interleaved", device=torch.device("cuda", 0))  # type: ignore[arg-type]
    assert select_weight_layout(model, choice="auto", device=torch.device("cuda", 0)) == 0  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not replace"):
        model.a.use_weight(random_weight("q4_1", rows=9, cols=64, seed=1))


@pytest.mark.parametrize("layout", ["ggml", "interleaved"])
@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_dequantize_rounds_the_float32_weight(kind: str, layout: str) -> None:
    """What bfloat16 GEMMs multiply: the float32 dequantization rounded to nearest even."""
    weight = random_weight(kind, rows=37, cols=160, seed=11)
    if layout == "interleaved":
        weight = weight.interleaved()
    got = torch.ops.llmrt_kernels.gguf_dequantize_bf16(weight.blocks, weight.kernel_type, 160)
    assert got.dtype == torch.bfloat16 and got.shape == (37, 160)
    assert torch.equal(got, weight.dequantize().to(torch.bfloat16))


def test_int8_leaves_kinds_without_its_kernel_to_the_fallback_dtype() -> None:
    # Under gemm_dtype int8, a kind the int8 GEMM does not cover (Q4_1 in the file's block
    # order) multiplies in int8_fallback_dtype from gemm_dtype_min_rows rows: bfloat16 where
    # the CPU does that faster (Zen 4), else float32; a covered kind runs the int8 GEMM.
    weight = random_weight("q4_1", rows=40, cols=64, seed=12)
    covered, uncovered = (
        QuantizedLinear(weight=weight.interleaved()),
        QuantizedLinear(weight=weight),
    )
    for layer in (covered, uncovered):
        layer.gemm_dtype = torch.int8
        layer.gemm_dtype_min_rows = 128
        layer.int8_fallback_dtype = torch.bfloat16
    assert not q8_gemm_supported(uncovered.ggml_type) and not uncovered.runs_int8_gemm(128)
    if q8_gemm_supported(covered.ggml_type):
        assert covered.runs_int8_gemm(128) and not covered.runs_int8_gemm(127)
        assert covered.gemm_input_dtype(128) == torch.float32  # it quantizes its own rows
    assert [uncovered.gemm_input_dtype(r) for r in (127, 128)] == [torch.float32, torch.bfloat16]
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(13))
    reference = x @ weight.dequantize().T
    bf16 = uncovered.forward_raw(x)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), reference, atol=0.05, rtol=0.02)
    uncovered.int8_fallback_dtype = torch.float32
    f32 = uncovered.forward_raw(x)
    assert f32.dtype == torch.float32
    torch.testing.assert_close(f32, reference, atol=1e-4, rtol=1e-4)


def test_interleaved_rows_keep_the_integer_kernel_where_a_gemm_would_be_float32() -> None:
    weight = random_weight("q4_1", rows=40, cols=64, seed=9)
    linear = QuantizedLinear(weight=weight.interleaved())
    ggml = QuantizedLinear(weight=weight)

    def path(layer: QuantizedLinear, rows: int) -> str:
        if not layer.runs_gemm(rows):
            return "kernel"
        return "bf16-gemm" if layer.gemm_input_dtype(rows) == torch.bfloat16 else "f32-gemm"

    # float32 GEMMs (the default gemm_dtype) never replace the kernels under 128 rows, nor
    # at any size where the CPU runs them (from 16 rows they run an integer GEMM; at AVX2
    # below VNNI, from 128 rows the panel GEMM of csrc/kquant_gemm.cpp).
    panels = kquant_gemm_max_rows(linear.ggml_type) >= 4096
    big = "kernel" if integer_gemm_supported() or panels else "f32-gemm"
    assert [path(linear, r) for r in (47, 48, 127, 128, 4096)] == ["kernel"] * 3 + [big] * 2
    linear.gemm_dtype = torch.bfloat16
    linear.gemm_dtype_min_rows = 128
    assert [path(linear, r) for r in (48, 127, 128)] == ["kernel", "kernel", "bf16-gemm"]
    # The forward really takes the kernel there: bit-equal to the op called directly.
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(10))
    direct = torch.ops.llmrt_kernels.gguf_linear(x, linear.blocks, linear.ggml_type, 64, None)
    assert torch.equal(linear(x), direct)
    # Where bfloat16 GEMMs start lower, they take over from 48 rows (INTERLEAVED_GEMM_MIN_ROWS).
    linear.gemm_dtype_min_rows = 1
    assert [path(linear, r) for r in (47, 48)] == ["kernel", "bf16-gemm"]
    assert not torch.equal(linear(x), direct)
    # The file's block order keeps its float32 GEMM from 16 rows.
    assert [path(ggml, r) for r in (15, 16)] == ["kernel", "f32-gemm"]
