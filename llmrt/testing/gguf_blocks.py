"""Random valid GGUF blocks of every kind the kernels run, for tests that check the kernels
and the loader against gguf-py and transformers on the same bytes."""

from __future__ import annotations

import numpy as np
import torch

from llmrt.kernels.formats import BLOCK_BYTES, BLOCK_WEIGHTS, QuantizedWeight

#: Byte offsets of each block kind's fp16 scale fields (random bytes there could be inf or
#: NaN), and the size that keeps a weight of random quants around 0.05 (d * sc * q).
HALF_FIELDS: dict[str, tuple[int, ...]] = {
    "q4_0": (0,), "q4_1": (0, 2), "q8_0": (0,), "q5_0": (0,), "q5_1": (0, 2),
    "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "q2_k": (80, 82),
}  # fmt: skip
SCALE_SIZE: dict[str, float] = {
    "q4_0": 6e-3, "q4_1": 6e-3, "q8_0": 8e-4, "q5_0": 3e-3, "q5_1": 3e-3,
    "q4_k": 2e-4, "q5_k": 1e-4, "q6_k": 3e-5, "q2_k": 2e-3,
}  # fmt: skip
#: Bytes per block of kinds without a kernel, for tests of the loader's refusal.
EXTRA_BLOCKS: dict[str, tuple[int, int]] = {"q2_k": (256, 84)}


def random_blocks(kind: str, rows: int, k: int, *, seed: int, scale: float = 1.0) -> np.ndarray:
    """``rows`` rows of ``kind`` blocks for width ``k`` (uint8 ``[rows, bytes]``): random
    quant bytes, finite scales of ``scale`` times the kind's typical size; ``f16`` /
    ``bf16`` rows hold normal values of standard deviation ``0.05 * scale``."""
    rng = np.random.default_rng(seed)
    if kind in ("f16", "bf16"):
        values = (rng.standard_normal((rows, k)) * 0.05 * scale).astype(np.float32)
        if kind == "f16":
            return values.astype(np.float16).view(np.uint8).reshape(rows, -1)
        bits = (values.view(np.uint32) >> 16).astype(np.uint16)
        return bits.view(np.uint8).reshape(rows, -1)
    if kind not in HALF_FIELDS:  # the block kinds made here (f16 / bf16 above)
        known = sorted({*HALF_FIELDS, "f16", "bf16"})
        raise ValueError(f"no random blocks for kind {kind!r} (kinds: {', '.join(known)})")
    per, size = EXTRA_BLOCKS.get(kind) or (BLOCK_WEIGHTS[kind], BLOCK_BYTES[kind])
    raw = rng.integers(0, 256, (rows, k // per, size), dtype=np.uint8)
    for offset in HALF_FIELDS[kind]:
        halves = (rng.standard_normal((rows, k // per)) * SCALE_SIZE[kind] * scale).astype(
            np.float16
        )
        raw[:, :, offset : offset + 2] = halves.view(np.uint8).reshape(rows, k // per, 2)
    return raw.reshape(rows, -1)


def random_quantized(
    kind: str, rows: int, k: int, *, seed: int, scale: float = 1.0
) -> QuantizedWeight:
    """A ``rows x k`` weight of ``random_blocks`` (the blocks as a torch tensor)."""
    blocks = torch.from_numpy(random_blocks(kind, rows, k, seed=seed, scale=scale))
    return QuantizedWeight(kind=kind, shape=(rows, k), blocks=blocks)  # type: ignore[arg-type]
