"""``llmrt.testing.gguf_blocks``: the random blocks the kernel and loader tests share are
valid for gguf-py (finite, of the stated size), and an unknown kind is named."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from llmrt.testing.gguf_blocks import HALF_FIELDS, random_blocks, random_quantized


@pytest.mark.parametrize("kind", sorted(HALF_FIELDS))
def test_random_blocks_dequantize_to_finite_weights_of_the_typical_size(kind: str) -> None:
    blocks = random_blocks(kind, 8, 512, seed=3)
    values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind.upper()])
    assert values.shape == (8, 512) and np.isfinite(values).all()
    # "around 0.05": within a decade either way, and not all zero
    assert 0.005 < float(np.abs(values).mean()) < 0.5


def test_an_unknown_kind_is_named() -> None:
    with pytest.raises(ValueError, match=r"kind 'Q4_K' .*q4_k"):
        random_blocks("Q4_K", 2, 256, seed=0)
    with pytest.raises(ValueError, match="'iq2_xs'"):
        random_quantized("iq2_xs", 2, 256, seed=0)
