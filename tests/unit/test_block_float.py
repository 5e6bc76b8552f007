"""Block-float rounding (bfloat8_b / bfloat4_b) against an element-by-element reference.

The reference restates tt-metal's per-element rule (``convert_u32_to_bfp`` then
``convert_bfp_to_u32``, ``is_exp_a=False``) with Python integers, one face row at a time.
"""

from __future__ import annotations

import struct

import pytest
import torch

from llmrt.testing.block_float import round_block_float
from llmrt.testing.fake_ttnn import FakeTtnn


def _bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _reference_row(row: list[float], bits: int) -> list[float]:
    words = [_bits(v) for v in row]
    shared = max(((w >> 23) & 0xFF) if w & 0x7FFFFFFF else 0 for w in words)
    out = []
    for w in words:
        if w & 0x7FFFFFFF == 0:
            out.append(0.0)
            continue
        exp, sign = (w >> 23) & 0xFF, w >> 31
        mant = ((1 << 23) | (w & 0x7FFFFF)) >> min(shared - exp, 31)
        shift = 24 - bits
        rest, mant = mant & ((1 << shift) - 1), mant >> shift
        if rest > (1 << (shift - 1)) or (rest == (1 << (shift - 1)) and mant & 1):
            mant += 1
        mant = min(mant, (1 << bits) - 1)
        value = mant * 2.0 ** (shared - 127 - (bits - 1))
        out.append(-value if sign and mant else value)
    return out


def _reference(values: torch.Tensor, bits: int) -> torch.Tensor:
    flat = values.reshape(-1, values.shape[-1]).tolist()
    out = []
    for row in flat:
        padded = row + [0.0] * (-len(row) % 32)
        done: list[float] = []
        for k in range(0, len(padded), 16):
            done += _reference_row(padded[k : k + 16], bits)
        out.append(done[: len(row)])
    return torch.tensor(out, dtype=torch.float32).reshape(values.shape)


def test_worked_values() -> None:
    row = torch.zeros(16)
    row[:5] = torch.tensor([1.0, 2.0**-8, 1 + 2.0**-7, 1 + 3 * 2.0**-7, -(2 - 2.0**-10)])
    got = round_block_float(row, mantissa_bits=7)[:5].tolist()
    # 2^-8 sits 8 binades under the shared exponent: flushed; two ties to even; a saturation.
    assert got == [1.0, 0.0, 1.0, 1.03125, -1.984375]


@pytest.mark.parametrize("bits", [7, 3])
@pytest.mark.parametrize("shape", [(3, 40), (2, 2, 33), (16,), (5, 64)])
def test_matches_the_element_rule_on_random_rows(bits: int, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape) + bits)
    values = torch.randn(shape, generator=gen) * torch.exp2(
        torch.randint(-12, 12, shape, generator=gen).float()
    )
    values[..., 3] = 0.0
    assert torch.equal(round_block_float(values, mantissa_bits=bits), _reference(values, bits))


def test_coarser_than_bfloat16_and_shared_per_face_row() -> None:
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(4, 64, generator=gen)
    eight = round_block_float(values, mantissa_bits=7)
    half = values.bfloat16().float()
    assert (eight - values).abs().mean() > (half - values).abs().mean()
    big = values.clone()
    big[0, 17] = 1000.0  # only the row 0 elements 16..31 share its exponent
    moved = round_block_float(big, mantissa_bits=7) != eight
    assert moved[0, 16:32].any() and not moved[0, :16].any() and not moved[1:].any()


def test_the_fake_device_holds_bfloat8_b_values() -> None:
    fake = FakeTtnn()
    mesh = fake.open_mesh_device(fake.MeshShape(1, 1))
    values = torch.randn(8, 48, generator=torch.Generator().manual_seed(5))
    tensor = fake.from_torch(values, dtype=fake.bfloat8_b, layout=fake.TILE_LAYOUT, device=mesh)
    held = fake.to_torch(tensor)
    assert torch.equal(held.float(), round_block_float(values, mantissa_bits=7))
    fake.deallocate(tensor)
    fake.close_mesh_device(mesh)
