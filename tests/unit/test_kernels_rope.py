"""``llmrt_kernels.rope`` against torch's RoPE (``apply_rope`` without ``native``): equal bits,
and ``apply_rope`` takes it only where it covers the call."""

from __future__ import annotations

import pytest
import torch

from llmrt.families import rope as rope_module
from llmrt.families.rope import apply_rope, rope_lookup
from llmrt.kernels.native import load_kernels

load_kernels()
op = torch.ops.llmrt_kernels.rope


def tables(positions: int, dim: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    cos_cache = torch.randn(positions, dim // 2, generator=gen)
    sin_cache = torch.randn(positions, dim // 2, generator=gen)
    return cos_cache, sin_cache


@pytest.mark.parametrize(
    ("shape", "dim"),
    [
        ((1, 300, 9), 64),  # a packed prefill's queries (SmolLM2)
        ((3, 40, 2), 128),  # padded rows, the widest head
        ((2, 7, 3), 24),  # a half of 12: masked lanes
        ((5, 1, 1), 2),  # the narrowest head
    ],
)
def test_native_rope_equals_torch_bit_for_bit(shape: tuple[int, int, int], dim: int) -> None:
    rows, length, heads = shape
    gen = torch.Generator().manual_seed(dim)
    # Queries as the attention hands them over: a strided slice of the fused qkv output.
    qkv = torch.randn(rows, length, heads * dim + 8, generator=gen)
    x = qkv[..., : heads * dim].unflatten(-1, (heads, dim))
    cos_cache, sin_cache = tables(64, dim, seed=1)
    positions = torch.randint(0, 64, (rows, length), generator=gen)
    cos, sin = rope_lookup(cos_cache=cos_cache, sin_cache=sin_cache, positions=positions)
    want = apply_rope(x, cos=cos, sin=sin)
    got = apply_rope(x, cos=cos, sin=sin, native=True)
    assert got.shape == x.shape
    assert torch.equal(got, want)


def test_apply_rope_takes_the_kernel_only_where_it_covers_the_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []

    def counted(*args: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return op(*args)

    monkeypatch.setattr(torch.ops.llmrt_kernels, "rope", counted)
    cos_cache, sin_cache = tables(16, 32, seed=2)
    cos, sin = rope_lookup(
        cos_cache=cos_cache, sin_cache=sin_cache, positions=torch.arange(4)[None]
    )
    x = torch.randn(1, 4, 2, 32)
    apply_rope(x, cos=cos, sin=sin, native=True)
    assert len(calls) == 1
    apply_rope(x, cos=cos, sin=sin)  # native off
    apply_rope(x.double(), cos=cos.double(), sin=sin.double(), native=True)  # not float32
    partial = torch.randn(1, 4, 2, 48)  # partial rotary: 32 of 48 channels
    want = apply_rope(partial, cos=cos, sin=sin)
    assert torch.equal(apply_rope(partial, cos=cos, sin=sin, native=True), want)
    assert len(calls) == 1
    assert not rope_module._native_rope_usable(x.double(), cos, sin)
    assert not rope_module._native_rope_usable(x, cos, sin[..., :16])
    assert not rope_module._native_rope_usable(x.transpose(-1, -2), cos, sin)


@pytest.mark.parametrize("dim", [64, 24])
def test_the_op_rotates_by_each_half_of_its_own_tables(dim: int) -> None:
    """Tables whose halves differ (``rope_lookup`` repeats one half): the op must read
    ``cos``/``sin`` at each output channel's own index."""
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(7, 3, dim, generator=gen)
    cos = torch.randn(7, dim, generator=gen)
    sin = torch.randn(7, dim, generator=gen)
    half = dim // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    want = x * cos[:, None] + turned * sin[:, None]
    assert torch.equal(op(x, cos, sin), want)


def test_bad_inputs_name_the_problem() -> None:
    x = torch.randn(4, 2, 8)
    table = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="float32 on the CPU"):
        op(x.double(), table, table)
    with pytest.raises(RuntimeError, match=r"\[tokens, heads, head_dim\]"):
        op(x[None], table, table)
    with pytest.raises(RuntimeError, match=r"must be \[tokens, head_dim\] = \[4, 8\]"):
        op(x, table[:3], table[:3])
    with pytest.raises(RuntimeError, match="head_dim must be even"):
        op(torch.randn(4, 2, 7), torch.randn(4, 7), torch.randn(4, 7))
