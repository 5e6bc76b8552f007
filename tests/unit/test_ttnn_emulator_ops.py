"""The fake ttnn's computing ops a tt_transformers-style decoder calls, against torch.

Each op computes on the values the device holds (bfloat16, or bfloat8_b's block floats)
with float32 accumulation and rounds its output to the output dtype, as a chip does; tile
inputs are required where ttnn requires them; ops replay from a captured trace.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from llmrt.testing.block_float import round_block_float
from llmrt.testing.fake_ttnn import FakeTtnn, TtnnRuleViolation

BF16_TOL = {"rtol": 2**-7, "atol": 1e-6}


@pytest.fixture
def tt() -> Iterator[tuple[FakeTtnn, object]]:
    fake = FakeTtnn()
    mesh = fake.open_mesh_device(fake.MeshShape(1, 1), trace_region_size=1 << 20)
    yield fake, mesh
    fake.close_mesh_device(mesh)


def _dev(fake: FakeTtnn, mesh: object, value: torch.Tensor, dtype: object) -> object:
    return fake.from_torch(value, dtype=dtype, layout=fake.TILE_LAYOUT, device=mesh)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_a_bfloat16_activation_times_a_bfloat8_b_weight(tt: tuple[FakeTtnn, object]) -> None:
    fake, mesh = tt
    x, w = torch.randn(4, 64, generator=_gen(1)), torch.randn(64, 96, generator=_gen(2))
    out = fake.matmul(_dev(fake, mesh, x, fake.bfloat16), _dev(fake, mesh, w, fake.bfloat8_b))

    held = x.bfloat16().float() @ round_block_float(w, mantissa_bits=7)
    assert out.dtype == fake.bfloat16
    assert torch.equal(fake.to_torch(out), held.bfloat16())


def test_linear_with_bias_transpose_and_fused_silu(tt: tuple[FakeTtnn, object]) -> None:
    fake, mesh = tt
    x = torch.randn(2, 3, 64, generator=_gen(3))
    w = torch.randn(32, 64, generator=_gen(4))  # [out, in]: transpose_b
    b = torch.randn(1, 32, generator=_gen(5))
    out = fake.linear(
        _dev(fake, mesh, x, fake.bfloat16),
        _dev(fake, mesh, w, fake.bfloat8_b),
        bias=_dev(fake, mesh, b, fake.bfloat16),
        transpose_b=True,
        activation="silu",
        dtype=fake.bfloat8_b,
    )

    wq = round_block_float(w, mantissa_bits=7)
    reference = torch.nn.functional.silu(x.bfloat16().float() @ wq.T + b.bfloat16().float())
    got = fake.to_torch(out)
    assert out.dtype == fake.bfloat8_b and out.layout == fake.TILE_LAYOUT
    assert torch.equal(got, round_block_float(reference, mantissa_bits=7))
    assert not torch.equal(got, reference.bfloat16().float())  # block floats, not bf16


def test_rms_norm_matches_the_reference_formula(tt: tuple[FakeTtnn, object]) -> None:
    fake, mesh = tt
    x = torch.randn(3, 128, generator=_gen(6)) * 4
    weight = torch.rand(128, generator=_gen(7)) + 0.5
    residual = torch.randn(3, 128, generator=_gen(8))
    out = fake.rms_norm(
        _dev(fake, mesh, x, fake.bfloat16),
        epsilon=1e-5,
        weight=_dev(fake, mesh, weight.reshape(1, -1), fake.bfloat16),
        residual_input_tensor=_dev(fake, mesh, residual, fake.bfloat16),
    )

    h = x.bfloat16().double() + residual.bfloat16().double()
    reference = h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-5) * weight.bfloat16().double()
    torch.testing.assert_close(fake.to_torch(out).double(), reference, **BF16_TOL)


def test_silu_and_softmax_keep_the_input_dtype(tt: tuple[FakeTtnn, object]) -> None:
    fake, mesh = tt
    x = torch.randn(4, 32, generator=_gen(9))
    dev = _dev(fake, mesh, x, fake.bfloat16)
    silu, soft = fake.silu(dev), fake.softmax(dev, dim=-1)
    held = x.bfloat16().double()
    torch.testing.assert_close(fake.to_torch(silu).double(), held * torch.sigmoid(held), **BF16_TOL)
    torch.testing.assert_close(fake.to_torch(soft).double(), torch.softmax(held, -1), **BF16_TOL)
    assert silu.dtype == soft.dtype == fake.bfloat16


def test_gelu_computes_the_variant_ttnn_documents(tt: tuple[FakeTtnn, object]) -> None:
    """``Accurate``: erf's GELU; ``Tanh``: the tanh approximation (both written out here);
    the unemulated ``FastLut`` table is refused."""
    fake, mesh = tt
    x = torch.randn(4, 32, generator=_gen(10)) * 3
    dev = _dev(fake, mesh, x, fake.bfloat16)
    held = x.bfloat16().double()
    erf = 0.5 * held * (1 + torch.erf(held / 2**0.5))
    tanh = 0.5 * held * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (held + 0.044715 * held**3)))
    accurate = fake.gelu(dev)
    approximate = fake.gelu(dev, variant=fake.GeluVariant.Tanh)
    torch.testing.assert_close(fake.to_torch(accurate).double(), erf, **BF16_TOL)
    torch.testing.assert_close(fake.to_torch(approximate).double(), tanh, **BF16_TOL)
    assert accurate.dtype == approximate.dtype == fake.bfloat16
    for refused in ({"variant": fake.GeluVariant.FastLut}, {"fast_and_approximate_mode": True}):
        with pytest.raises(NotImplementedError, match="FastLut"):
            fake.gelu(dev, **refused)


def test_row_major_inputs_are_refused_as_ttnn_does(tt: tuple[FakeTtnn, object]) -> None:
    fake, mesh = tt
    rm = fake.from_torch(torch.ones(32, 32), dtype=fake.bfloat16, device=mesh)
    tile = _dev(fake, mesh, torch.ones(32, 32), fake.bfloat16)
    for call in (lambda: fake.linear(rm, tile), lambda: fake.rms_norm(rm, epsilon=1e-5)):
        with pytest.raises(TtnnRuleViolation, match="TILE layout"):
            call()


def test_a_captured_norm_and_linear_replay_on_refreshed_inputs(
    tt: tuple[FakeTtnn, object],
) -> None:
    fake, mesh = tt
    w = _dev(fake, mesh, torch.randn(64, 64, generator=_gen(10)), fake.bfloat8_b)
    x = _dev(fake, mesh, torch.randn(32, 64, generator=_gen(11)), fake.bfloat16)

    def step() -> object:
        return fake.linear(fake.rms_norm(x, epsilon=1e-6), w)

    step()  # compile: the programs enter the cache before the capture
    trace = fake.begin_trace_capture(mesh, cq_id=0)
    out = step()
    fake.end_trace_capture(mesh, trace, cq_id=0)
    fresh = torch.randn(32, 64, generator=_gen(12))
    fake.copy_host_to_device_tensor(
        fake.from_torch(fresh, dtype=fake.bfloat16, layout=fake.TILE_LAYOUT), x
    )
    fake.execute_trace(mesh, trace, cq_id=0, blocking=True)

    eager = fake.to_torch(fake.linear(fake.rms_norm(x, epsilon=1e-6), w))
    assert torch.equal(fake.to_torch(out), eager)
    fake.release_trace(mesh, trace)
