"""The kernels' portable loops (what a CPU without AVX-512 runs), tested on any CPU.

``LLMRT_KERNELS_ISA=portable`` turns off every AVX-512 / VNNI / BF16 path for a process, so
the kernel and fused-decode test modules run again in a child process against the same
independent references (gguf-py's dequantization, the torch-ops decode path).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
MODULES = (
    TESTS / "unit" / "test_kernels_gguf_blocks.py",
    TESTS / "unit" / "test_kernels_interleaved.py",
    TESTS / "unit" / "test_kernels_kquants.py",
    TESTS / "parity" / "test_fused_decode.py",
)


def test_portable_loops_pass_the_kernel_tests() -> None:
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "from llmrt.kernels.native import int8_dot_supported as f; print(f())",
        ],
        env={**os.environ, "LLMRT_KERNELS_ISA": "portable"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip() == "False"  # the switch really turns the fast paths off
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, MODULES)],
        env={**os.environ, "LLMRT_KERNELS_ISA": "portable"},
        capture_output=True,
        text=True,
        cwd=TESTS.parent,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
