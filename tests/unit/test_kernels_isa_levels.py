"""The kernel test modules again at every instruction-set level this CPU has below its own.

``LLMRT_KERNELS_ISA=<level>`` makes a process run only that level's code (and the policies
read the same level), so the AVX2 and scalar paths another CPU runs are checked here against
the same independent references (gguf-py's dequantization, torch's ops, the torch-ops decode
path); on a CPU with AVX-VNNI the avx_vnni level too (slow, like avx512). The CPU's own level
is the ordinary test run. The arm64 levels (neon, dotprod, i8mm) run from an x86 host under
qemu-user in ``test_kernels_arm64.py`` (``scripts/arm_check.sh --run``); on an arm64 host this
module covers them as it covers x86's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmrt.device.cpu_features import (
    ISA_VARIABLE,
    TORCH_ISA_VARIABLES,
    forceable_levels,
    read_cpu_features,
)

TESTS = Path(__file__).resolve().parents[1]
MODULES = (
    TESTS / "unit" / "test_kernels_gguf_blocks.py",
    TESTS / "unit" / "test_kernels_interleaved.py",
    TESTS / "unit" / "test_kernels_q8_gemm_interleaved.py",
    TESTS / "unit" / "test_kernels_q8_gemm_kquant.py",
    TESTS / "unit" / "test_kernels_kquants.py",
    TESTS / "unit" / "test_kernels_causal_attention.py",
    TESTS / "unit" / "test_kernels_activation.py",
    TESTS / "unit" / "test_families_norm.py",
    TESTS / "unit" / "test_kernels_rope.py",
    TESTS / "parity" / "test_fused_decode.py",
)
#: The levels this CPU can be forced to below its own (x86 with AVX-VNNI: avx_vnni too).
LOWER = forceable_levels(read_cpu_features())[:-1]


#: Levels the default run covers (the common AVX2 CPUs and the scalar loops); the rest are
#: ``slow`` (each level reruns ~3 minutes of tests).
DEFAULT_LEVELS = ("scalar", "avx2", "neon")


@pytest.mark.parametrize(
    "level",
    [lv if lv in DEFAULT_LEVELS else pytest.param(lv, marks=pytest.mark.slow) for lv in LOWER],
)
def test_the_kernel_suite_passes_at_each_lower_level(level: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         *(str(m) for m in MODULES if m.exists())],
        env={**_clean_env(), ISA_VARIABLE: level},
        capture_output=True,
        text=True,
        cwd=TESTS.parent,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def _clean_env() -> dict[str, str]:
    """This process's environment less the torch caps a forced level here may have set
    (``pin_torch_isa``), so the child caps its own."""
    return {k: v for k, v in os.environ.items() if k not in TORCH_ISA_VARIABLES}
