"""Every kernel source compiles with clang, for x86-64 and for aarch64: the cheap CI check of
the clang build (``scripts/clang_check.sh`` builds the whole library with clang and runs the
kernel suite at every level; ``scripts/arm_check.sh --run`` runs the arm64 kernels).

Each source holds every instruction-set level's code (function target attributes: AVX2,
AVX-512, VNNI, BF16; NEON, dotprod, i8mm), so one compile per target covers every level. The
compile generates code (``-c -O0``, not ``-fsyntax-only``): clang reports an intrinsic used
outside its level's function only when it generates code. Built without OpenMP, as Apple
clang builds it. x86-64 runs by default (about a minute of CPU on two cores); aarch64 is
``slow``. Skipped where clang++ (or, for aarch64, the aarch64 C++ headers of
g++-aarch64-linux-gnu) is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

CLANG = shutil.which("clang++")
CSRC = Path(__file__).resolve().parents[2] / "llmrt" / "kernels" / "csrc"
TORCH_INCLUDE = Path(torch.__file__).parent / "include"
AARCH64_HEADERS = Path("/usr/aarch64-linux-gnu/include")

TARGETS = [
    pytest.param("x86_64-linux-gnu", id="x86_64"),
    pytest.param(
        "aarch64-linux-gnu",
        id="aarch64",
        marks=[
            pytest.mark.slow,  # scripts/arm_check.sh compiles (and runs) arm64 with g++
            pytest.mark.skipif(
                not AARCH64_HEADERS.is_dir(),
                reason="needs the aarch64 C++ headers (apt-get install g++-aarch64-linux-gnu)",
            ),
        ],
    ),
]


def compile_source(source: Path, target: str, out: Path) -> str:
    """clang's complaints about ``source`` for ``target`` ("" when it compiled)."""
    assert CLANG is not None
    run = subprocess.run(
        [CLANG, f"--target={target}", "-std=c++20", "-O0", "-Wall", "-Werror=unused-variable",
         "-Wno-unused-const-variable",  # one architecture's tile constants, unused on the other
         "-fPIC", "-c", str(source), "-o", str(out / f"{source.stem}.o"),
         "-DTORCH_EXTENSION_NAME=llmrt_kernels", "-DTORCH_API_INCLUDE_EXTENSION_H",
         "-isystem", str(TORCH_INCLUDE),
         "-isystem", str(TORCH_INCLUDE / "torch" / "csrc" / "api" / "include"),
         "-isystem", sysconfig.get_paths()["include"]],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    return "" if run.returncode == 0 else f"{source.name}:\n{run.stderr[-3000:]}"


@pytest.mark.skipif(CLANG is None, reason="needs clang++ on PATH")
@pytest.mark.parametrize("target", TARGETS)
def test_every_kernel_source_compiles_with_clang(target: str, tmp_path: Path) -> None:
    sources = sorted(CSRC.glob("*.cpp"))
    assert len(sources) >= 10
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        errors = [e for e in pool.map(lambda s: compile_source(s, target, tmp_path), sources) if e]
    assert not errors, "\n".join(errors)
    assert len(list(tmp_path.glob("*.o"))) == len(sources)
