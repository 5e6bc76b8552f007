"""Shared layers: FrozenLinear kernels (oneDNN against aten, the choice, compiled calls) and
the RoPE cache."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from llmrt.device.cpu_features import CpuFeatures
from llmrt.errors import ConfigError
from llmrt.families.layers import (
    FrozenLinear,
    onednn_linear_available,
    resolve_linear_kernel,
    use_linear_kernel,
)
from llmrt.families.rope import rope_lookup

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="torch without oneDNN")

CPU = torch.device("cpu")


def _layer(*, bias: bool, dtype: torch.dtype = torch.float32, seed: int = 0) -> FrozenLinear:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(48, 40, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype) if bias else None
    return FrozenLinear(weight=weight, bias=b)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "shape", [(5, 40), (2, 3, 40), (0, 40)], ids=["2d", "3d", "empty"]
)
def test_onednn_matches_aten(bias: bool, shape: tuple[int, ...]) -> None:
    layer = _layer(bias=bias)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    expected = layer(x)
    layer.kernel = "onednn"
    got = layer(x)
    assert got.shape == expected.shape == (*shape[:-1], 48)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@needs_onednn
def test_onednn_accepts_a_non_contiguous_input() -> None:
    layer = _layer(bias=True)
    x = torch.randn(3, 40, 7).transpose(1, 2)
    assert not x.is_contiguous()
    expected = layer(x)
    layer.kernel = "onednn"
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)


@needs_onednn
def test_a_bfloat16_product_runs_where_onednn_has_no_bfloat16_inner_product() -> None:
    """oneDNN capped at AVX2 (an AVX2-only CPU; ``LLMRT_KERNELS_ISA=avx2`` caps it the same
    way) cannot create a bfloat16 inner product: a layer on the oneDNN kernel multiplying in
    bfloat16 (``device.gemm_dtype: bfloat16`` dequantizes to bfloat16) must still run, and
    give torch's own bfloat16 product. In a fresh process: the cap is read at oneDNN's first
    use."""
    script = """
import torch
from llmrt.families.layers import FrozenLinear
g = torch.Generator().manual_seed(0)
layer = FrozenLinear(weight=torch.randn(48, 40, generator=g).bfloat16(), bias=None)
layer.kernel = "onednn"
x = torch.randn(17, 40, generator=g).bfloat16()
got = layer(x)
with torch.backends.mkldnn.flags(enabled=False):
    want = torch.nn.functional.linear(x, layer.weight)
torch.testing.assert_close(got, want)
print("ok", got.dtype)
"""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ok", "torch.bfloat16"]


@needs_onednn
def test_onednn_runs_under_torch_compile_as_an_opaque_op() -> None:
    layer = _layer(bias=True)
    layer.kernel = "onednn"
    x = torch.randn(4, 40)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x))


def test_auto_picks_onednn_for_float32_on_a_non_intel_cpu_only() -> None:
    amd, intel = CpuFeatures(vendor="AuthenticAMD"), CpuFeatures(vendor="GenuineIntel")
    fp32 = resolve_linear_kernel("auto", device=CPU, dtype=torch.float32, cpu=amd)
    assert fp32 == ("onednn" if onednn_linear_available() else "aten")
    # MKL's sgemm is Intel's own: at least as fast as oneDNN there.
    assert resolve_linear_kernel("auto", device=CPU, dtype=torch.float32, cpu=intel) == "aten"
    assert resolve_linear_kernel("auto", device=CPU, dtype=torch.bfloat16, cpu=amd) == "aten"
    if onednn_linear_available():
        asked = resolve_linear_kernel("onednn", device=CPU, dtype=torch.float32, cpu=intel)
        assert asked == "onednn"
    cuda = torch.device("cuda", 0)
    assert resolve_linear_kernel("auto", device=cuda, dtype=torch.float32) == "aten"
    assert resolve_linear_kernel("aten", device=CPU, dtype=torch.float32) == "aten"


def test_onednn_off_cpu_or_an_unknown_kernel_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"device\.linear.*needs a cpu device"):
        resolve_linear_kernel("onednn", device=torch.device("cuda", 0), dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"device\.linear.*must be one of"):
        resolve_linear_kernel("blas", device=CPU, dtype=torch.float32)  # type: ignore[arg-type]


def test_use_linear_kernel_sets_every_linear_under_a_module() -> None:
    tree = torch.nn.Sequential(_layer(bias=False), torch.nn.ReLU(), _layer(bias=True, seed=1))
    assert use_linear_kernel(tree, kernel="onednn") == 2
    assert [m.kernel for m in tree if isinstance(m, FrozenLinear)] == ["onednn", "onednn"]
    assert "kernel=onednn" in repr(tree[0])


def test_the_rope_cache_spans_the_bound_kv_cache_not_the_model_maximum() -> None:
    """A long-context checkpoint holds RoPE tables only for positions its KV cache can reach,
    and looking them up gives what computing the angles directly does."""
    from types import SimpleNamespace

    from lane_fixtures import tiny_llama

    model = tiny_llama(max_position_embeddings=1_000_000)
    backbone: Any = model.backbone  # type: ignore[attr-defined]
    meta = model.attention_metadata()
    shape = meta.kv_shape(num_blocks=6, block_size=4)
    layers = range(meta.num_layers)
    model.set_kv_cache(
        SimpleNamespace(
            keys=[torch.zeros(shape) for _ in layers],
            values=[torch.zeros(shape) for _ in layers],
            block_size=4,
        )
    )
    assert backbone.rope_cos.shape == backbone.rope_sin.shape == (24, meta.head_dim // 2)
    positions = torch.tensor([[0, 7, 23, 40]])  # 40: a padding token past the cache
    cos, sin = rope_lookup(
        cos_cache=backbone.rope_cos, sin_cache=backbone.rope_sin, positions=positions
    )
    angles = positions[..., :3, None].float() * backbone.inv_freq
    direct = torch.cat((angles, angles), dim=-1)[..., None, :]
    torch.testing.assert_close(cos[:, :3], direct.cos())
    torch.testing.assert_close(sin[:, :3], direct.sin())
    torch.testing.assert_close(cos[:, 3], cos[:, 2])  # clamped to the last row
