"""llmrt's compiled kernels run on torch's OpenMP thread pool.

``at::parallel_for`` is an OpenMP pragma in torch's headers: a library compiled without
OpenMP runs every kernel on one thread without any error (the first wave of quantized kernels
did). The built library must call into OpenMP, and the process must hold one OpenMP runtime
(torch's), not a second pool competing for the same cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmrt.kernels.native import LIBRARY, load_kernels


def test_kernels_are_compiled_with_openmp() -> None:
    library = load_kernels() / f"{LIBRARY}.so"
    assert b"GOMP_parallel" in library.read_bytes(), "at::parallel_for compiled as a serial loop"


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc (Linux)")
def test_one_openmp_runtime_in_the_process() -> None:
    load_kernels()
    runtimes = {
        line.split()[-1]
        for line in Path("/proc/self/maps").read_text().splitlines()
        if "libgomp" in line or "libiomp" in line
    }
    assert len(runtimes) == 1, f"more than one OpenMP runtime mapped: {sorted(runtimes)}"
