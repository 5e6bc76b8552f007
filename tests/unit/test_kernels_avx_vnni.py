"""The avx_vnni level's interleaved tiles (``csrc/interleaved_avxvnni.cpp``) and integer GEMM
micro tile (``csrc/interleaved_gemm.cpp``) against the avx2 level's.

Both form, per 32-bit lane, the exact integer 256 * (w . h) + (w . l) of a block's weights
and the two int8 levels of its activations (AVX2 with vpmaddubsw + vpmaddwd, AVX-VNNI with
vpdpbusd) and scale it in the same float32 steps in the same order, so a child forced to
``avx_vnni`` must return the bits of one forced to ``avx2`` (but for the Q8_0 decode tile: at
AVX2 it multiplies 16-bit joined activations and scales in another order, so the two agree to
float32 rounding: 1e-6 of the largest output): every interleaved kind, 1-15
activation rows (the one-row loop, whole and partial tiles of 4), 16-100 rows (the integer
GEMM, whose AVX-VNNI micro tile sums the same int16 pairs with vpdpwssd), widths whose last
group holds 1-4 blocks, weight row counts that are not a multiple of the one-row loop's 4. The
kernel suite itself (its bounds against gguf-py's dequantization) runs at ``avx_vnni`` in
``test_kernels_isa_levels.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmrt.device.cpu_features import (
    ISA_VARIABLE,
    TORCH_ISA_VARIABLES,
    forceable_levels,
    read_cpu_features,
)

_CHILD = """
import sys, torch
from test_kernels_gguf_blocks import random_weight
from llmrt.families.layers import QuantizedLinear
from llmrt.kernels.native import kernels_isa, load_kernels
load_kernels()
out = {"isa": kernels_isa()}
for kind in ("q4_0", "q4_1", "q8_0"):
    for cols, n in ((32, 5), (64, 19), (96, 7), (160, 70), (576, 33)):
        w = random_weight(kind, rows=n, cols=cols, seed=cols).interleaved()
        linear = QuantizedLinear(weight=w)
        for rows in (1, 2, 3, 4, 5, 8, 11, 15, 16, 33, 100):
            g = torch.Generator().manual_seed(1000 * rows + cols)
            x = torch.randn(rows, cols, generator=g)
            x[0, :32] *= 30.0  # one block far larger than the rest
            out[kind, cols, rows] = linear(x)
torch.save(out, sys.argv[1])
"""


@pytest.mark.skipif(
    "avx_vnni" not in forceable_levels(read_cpu_features()),
    reason="needs a CPU with AVX2 and AVX-VNNI",
)
def test_the_avx_vnni_tiles_give_the_avx2_tiles_bits(tmp_path: Path) -> None:
    here = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k not in TORCH_ISA_VARIABLES}
    outs = {}
    for level in ("avx2", "avx_vnni"):
        path = tmp_path / f"{level}.pt"
        run = subprocess.run(
            [sys.executable, "-c", _CHILD, str(path)],
            env={**env, ISA_VARIABLE: level},
            capture_output=True,
            text=True,
            cwd=here,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        outs[level] = torch.load(path)
    avx2, vnni = outs["avx2"], outs["avx_vnni"]
    assert avx2.pop("isa")[::3] == ("avx2", False)  # (run level, AVX-VNNI paths)
    assert vnni.pop("isa")[::3] == ("avx_vnni", True)
    assert avx2.keys() == vnni.keys() and len(avx2) == 3 * 5 * 11
    for key, want in avx2.items():
        if key[0] == "q8_0" and key[2] < 16:
            # the AVX2 Q8_0 tile joins the levels to 16 bits and scales in another order
            scale = float(want.abs().max())
            torch.testing.assert_close(vnni[key], want, rtol=0, atol=1e-6 * scale, msg=str(key))
        else:
            assert torch.equal(vnni[key], want), key
