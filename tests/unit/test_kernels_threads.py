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


def _llvm_openmp_build() -> bool:
    """Whether the loaded library is a clang build on LLVM's runtime (``__kmpc_*`` calls),
    which runs its own pool beside torch's by design (``native._openmp_flags`` warns)."""
    return b"__kmpc_fork_call" in (load_kernels() / f"{LIBRARY}.so").read_bytes()


def test_kernels_are_compiled_with_openmp() -> None:
    data = (load_kernels() / f"{LIBRARY}.so").read_bytes()
    assert b"GOMP_parallel" in data or b"__kmpc_fork_call" in data, (
        "at::parallel_for compiled as a serial loop"
    )


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc (Linux)")
def test_one_openmp_runtime_in_the_process() -> None:
    load_kernels()
    if _llvm_openmp_build():
        pytest.skip("a clang build links LLVM's libomp beside torch's libgomp (warned at build)")
    runtimes = {
        line.split()[-1]
        for line in Path("/proc/self/maps").read_text().splitlines()
        if "libgomp" in line or "libiomp" in line or "libomp." in line
    }
    assert len(runtimes) == 1, f"more than one OpenMP runtime mapped: {sorted(runtimes)}"


def test_old_builds_are_pruned_to_the_most_recently_used(tmp_path: Path) -> None:
    """Each source or torch change builds a new library beside the old ones: after a build
    only the most recently used few stay; the one just built always does, and directories
    that are not builds are left alone."""
    import os
    import time

    from llmrt.kernels.native import prune_builds

    now = time.time()
    builds = []
    for age in range(5):
        build = tmp_path / f"digest{age}"
        build.mkdir()
        (build / f"{LIBRARY}.so").write_bytes(b"\x7fELF")
        os.utime(build, (now - 100 * age, now - 100 * age))
        builds.append(build)
    other = tmp_path / "notes"
    other.mkdir()
    newest_but_oldest = builds[4]  # e.g. a build another process just loaded and touched
    os.utime(newest_but_oldest, (now + 10, now + 10))
    removed = prune_builds(tmp_path, keep=builds[3], kept=2)
    assert sorted(removed) == sorted([builds[1], builds[2]])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["digest0", "digest3", "digest4", "notes"]
    assert prune_builds(tmp_path / "absent", keep=builds[0]) == []
