"""Block floating point as a Tenstorrent chip stores ``bfloat8_b`` / ``bfloat4_b`` tensors.

Why: the fake ttnn (and the emulator built on it) must hold what a chip holds, or a test
passes on values the chip never sees. A ``bfloat8_b`` tile keeps, for every row of 16
elements of each 16x16 face (16 consecutive elements of the last dimension, aligned at 16),
one shared 8-bit exponent (the largest of the 16 float32 exponents) and per element a sign
and a 7-bit magnitude that includes the hidden bit: the float32 significand (with its
hidden 1) is shifted right by its exponent's distance to the shared one, then rounded to 7
bits to nearest, ties to even, saturating at 127 (``bfloat4_b``: 3 bits). So an element much
smaller than its row's largest loses its low bits or flushes to zero, and every element
keeps at most 6 bits after its leading one: coarser than bfloat16. The layout is tt-metal's
``pack_as_bfp_tiles`` with ``is_exp_a=False`` (the ``_b`` formats keep float32's exponent
bias); tile padding is zeros, which never raise a row's shared exponent.
"""

from __future__ import annotations

import torch

FACE_WIDTH = 16
"""Elements sharing one exponent: a row of a 16x16 face."""
TILE_WIDTH = 32

MANTISSA_BITS = {"bfloat8_b": 7, "bfloat4_b": 3}
"""Magnitude bits per element (the hidden bit included) of each block-float format."""


def round_block_float(values: torch.Tensor, *, mantissa_bits: int) -> torch.Tensor:
    """``values`` as float32 after a round trip through a block-float tile format."""
    if mantissa_bits not in MANTISSA_BITS.values():
        raise ValueError(f"mantissa_bits must be one of {sorted(MANTISSA_BITS.values())}")
    x = values.detach().to(torch.float32)
    shape = x.shape
    x = x.reshape(1) if x.dim() == 0 else x
    width = x.shape[-1]
    if x.numel() == 0:
        return x.clone().reshape(shape)
    padded = -(-width // TILE_WIDTH) * TILE_WIDTH
    x = torch.nn.functional.pad(x, (0, padded - width))
    rows = x.reshape(*x.shape[:-1], padded // FACE_WIDTH, FACE_WIDTH).contiguous()
    bits = rows.view(torch.int32)  # int32 throughout: every value below fits 25 bits
    exponent = (bits >> 23) & 0xFF
    negative = bits < 0
    zero = (bits & 0x7FFFFFFF) == 0
    shared = torch.where(zero, 0, exponent).amax(dim=-1, keepdim=True)
    significand = (bits & 0x7FFFFF) | (1 << 23)
    aligned = significand >> (shared - exponent).clamp(max=31)
    shift = 24 - mantissa_bits
    rest = aligned & ((1 << shift) - 1)
    kept = aligned >> shift
    tie = 1 << (shift - 1)
    up = (rest > tie) | ((rest == tie) & ((kept & 1) == 1))
    kept = torch.clamp(kept + up.to(torch.int32), max=(1 << mantissa_bits) - 1)
    kept = torch.where(zero, 0, kept)
    scale = torch.pow(2.0, (shared - 127 - (mantissa_bits - 1)).to(torch.float64))
    out = kept.to(torch.float64) * scale
    out = torch.where(negative & (kept > 0), -out, out).to(torch.float32)
    return out.reshape(*x.shape[:-1], padded)[..., :width].reshape(shape)
