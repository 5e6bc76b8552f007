"""``decoder_layers.Norm``: an RMSNorm in float32 takes the native one-pass op on the CPU (within
float32 rounding of the exact value) and otherwise torch's one-op form with the weight, which
gives what the two-pass form (HF's: normalise, then multiply by the weight) gives, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmrt.families import decoder_layers
from llmrt.families.decoder_layers import Norm
from llmrt.families.parts import NormSpec
from llmrt.kernels.native import kernels_loaded, vector_kernels

SHAPES = [(3, 7, 576), (1, 300, 64), (5, 16), (4, 7), (0, 32)]


def _inputs(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = torch.randn(shape, generator=gen) * 3
    if x.numel():
        x.view(-1, shape[-1])[0, 1] = 300.0  # a large value dominates its row's mean
    return x, torch.randn(shape[-1], generator=gen)


@pytest.mark.parametrize("shape", SHAPES)
def test_float32_rms_norm_is_within_rounding_of_the_exact_value(shape: tuple[int, ...]) -> None:
    x, w = _inputs(shape)
    norm = Norm(spec=NormSpec(kind="rms", eps=1e-5), weight=w, bias=None)
    got = norm(x)
    assert got.shape == x.shape and got.dtype == torch.float32
    x64 = x.double()
    exact = w.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.allclose(got.double(), exact, rtol=2e-6, atol=1e-6)
    # As close as torch's own float32 form is.
    torch_form = w * F.rms_norm(x, (shape[-1],), eps=1e-5)
    assert torch.allclose(got, torch_form, rtol=4e-6, atol=1e-6)
    # Strided input gives the same values.
    if len(shape) == 3 and shape[0] > 1:
        strided = x.transpose(0, 1).contiguous().transpose(0, 1)
        assert torch.equal(norm(strided), got)


def test_the_cpu_takes_the_native_op_where_kernels_load() -> None:
    """Where the running level has the op's vector loops; at ``scalar`` torch's op, which
    was faster than the scalar loop."""
    if not kernels_loaded():
        pytest.skip("llmrt's CPU kernels are not built here")
    x, w = _inputs((2, 64))
    norm = Norm(spec=NormSpec(kind="rms", eps=1e-6), weight=w, bias=None)
    if vector_kernels():
        assert torch.equal(norm(x), torch.ops.llmrt_kernels.rms_norm(x, w, 1e-6))
    else:
        want = torch.nn.functional.rms_norm(x, (64,), weight=w, eps=1e-6)
        assert torch.equal(norm(x), want)


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_without_the_native_op_the_torch_form_equals_the_two_pass_form(
    shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decoder_layers, "native_rms_norm_usable", lambda x, w: False)
    x, w = _inputs(shape)
    norm = Norm(spec=NormSpec(kind="rms", eps=1e-5), weight=w, bias=None)
    want = w * F.rms_norm(x, (shape[-1],), eps=1e-5)
    assert torch.equal(norm(x), want)


def test_the_native_op_refuses_what_it_does_not_compute() -> None:
    if not kernels_loaded():
        pytest.skip("llmrt's CPU kernels are not built here")
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.llmrt_kernels.rms_norm(x.double(), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match=r"weight must be float32 \[8\]"):
        torch.ops.llmrt_kernels.rms_norm(x, torch.ones(9), 1e-6)


def test_other_norms_keep_their_forms() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 32, generator=gen)
    heads = torch.randn(2, 32, generator=gen)  # per-head weights broadcast over [.., 2, 32]
    per_head = Norm(spec=NormSpec(kind="rms", eps=1e-6), weight=heads, bias=None)
    xh = torch.randn(4, 2, 32, generator=gen)
    assert torch.equal(per_head(xh), heads * F.rms_norm(xh, (32,), eps=1e-6))
    w = torch.randn(32, generator=gen)
    gemma = Norm(spec=NormSpec(kind="rms_one_plus", eps=1e-6), weight=w, bias=None)
    assert torch.equal(gemma(x), F.rms_norm(x, (32,), eps=1e-6) * (1.0 + w))
    bf16 = Norm(spec=NormSpec(kind="rms", eps=1e-6), weight=w.bfloat16(), bias=None)
    got = bf16(x.bfloat16())
    assert got.dtype == torch.bfloat16
    want = w.bfloat16() * F.rms_norm(x.bfloat16().float(), (32,), eps=1e-6).bfloat16()
    assert torch.equal(got, want)
