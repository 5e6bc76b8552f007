"""``decoder.Norm``: an RMSNorm in float32 takes torch's one-op form with the weight, and gives
what the two-pass form (HF's: normalise, then multiply by the weight) gives, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmrt.families.decoder import Norm
from llmrt.families.parts import NormSpec


@pytest.mark.parametrize("shape", [(3, 7, 576), (1, 300, 64), (5, 16)])
def test_float32_rms_norm_equals_the_two_pass_form(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=gen) * 3
    w = torch.randn(shape[-1], generator=gen)
    norm = Norm(spec=NormSpec(kind="rms", eps=1e-5), weight=w, bias=None)
    want = w * F.rms_norm(x, (shape[-1],), eps=1e-5)
    assert torch.equal(norm(x), want)


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
