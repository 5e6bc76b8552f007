"""llmrt's compiled kernels run on torch's OpenMP thread pool, or, built without OpenMP, on
torch's inter-op pool.

``at::parallel_for`` is an OpenMP pragma in torch's headers: a library compiled without
OpenMP would run every kernel on one thread without any error (the first wave of quantized
kernels did). The default build must call into OpenMP, and the process must hold one OpenMP
runtime (torch's), not a second pool competing for the same cores. A build without OpenMP
(``LLMRT_KERNELS_OPENMP=0``, as Apple clang builds; ``scripts/clang_check.sh`` runs this
module against one) runs its loops on torch's inter-op pool (``csrc/parallel.h``) instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from llmrt.kernels.native import LIBRARY, OPENMP_ENV, kernels_openmp, load_kernels

WITHOUT_OPENMP = os.environ.get(OPENMP_ENV) == "0"


def _llvm_openmp_build() -> bool:
    """Whether the loaded library is a clang build on LLVM's runtime (``__kmpc_*`` calls),
    which runs its own pool beside torch's by design (``native._openmp_flags`` warns)."""
    return b"__kmpc_fork_call" in (load_kernels() / f"{LIBRARY}.so").read_bytes()


@pytest.mark.skipif(WITHOUT_OPENMP, reason=f"{OPENMP_ENV}=0 builds without OpenMP")
def test_kernels_are_compiled_with_openmp() -> None:
    data = (load_kernels() / f"{LIBRARY}.so").read_bytes()
    assert b"GOMP_parallel" in data or b"__kmpc_fork_call" in data, (
        "at::parallel_for compiled as a serial loop"
    )
    assert kernels_openmp()


@pytest.mark.skipif(not WITHOUT_OPENMP, reason=f"runs against a {OPENMP_ENV}=0 build")
def test_a_build_without_openmp_says_so() -> None:
    data = (load_kernels() / f"{LIBRARY}.so").read_bytes()
    assert b"GOMP_parallel" not in data and b"__kmpc_fork_call" not in data
    assert not kernels_openmp()


def test_parallel_loops_run_on_as_many_threads_as_torch_has() -> None:
    """With or without OpenMP, a parallel loop over 4 items runs on min(4, torch's thread
    count) threads (each item waits until that many have started, so a serial loop fails)."""
    load_kernels()
    threads = torch.get_num_threads()
    assert torch.ops.llmrt_kernels.parallel_threads(4) == min(4, threads)
    assert torch.ops.llmrt_kernels.parallel_threads(1) == 1


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


def test_the_openmp_switch_names_its_own_build_and_rejects_other_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from llmrt.errors import ConfigError
    from llmrt.kernels.native import build_directories

    monkeypatch.setenv(OPENMP_ENV, "1")
    with_openmp = build_directories()
    monkeypatch.setenv(OPENMP_ENV, "0")
    without = build_directories()
    assert with_openmp[0].name != without[0].name  # two different libraries, side by side
    monkeypatch.setenv(OPENMP_ENV, "off")
    with pytest.raises(ConfigError, match=OPENMP_ENV):
        build_directories()


@pytest.mark.parametrize("compiler_has_openmp", [True, False])
def test_a_build_made_without_openmp_is_rebuilt_once_the_compiler_has_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiler_has_openmp: bool
) -> None:
    """A fallback build (the compiler lacked -fopenmp: clang before libomp-dev) sits in the
    directory a build with OpenMP would use; a later load asks the compiler again and rebuilds
    there only if it now takes -fopenmp. ``_build`` is the real one up to the compiler run:
    its marker is what the load reads."""
    from llmrt.kernels import native

    directory = tmp_path / "build"
    built: list[Path] = []
    loaded: list[str] = []
    flags = ["-fopenmp"] if compiler_has_openmp else []

    class FakeExtension:
        @staticmethod
        def load(*, build_directory: str, **_: object) -> None:
            built.append(Path(build_directory))
            (Path(build_directory) / f"{LIBRARY}.so").write_bytes(b"lib")

    monkeypatch.setenv(OPENMP_ENV, "1")
    monkeypatch.setattr(native, "build_directories", lambda: (directory,))
    monkeypatch.setattr(native, "pin_torch_isa", lambda: None)
    monkeypatch.setattr(native, "_register_fakes", lambda: None)
    monkeypatch.setattr(native, "prune_builds", lambda *a, **k: [])
    monkeypatch.setattr(native, "_touch", lambda d: None)
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr("torch.utils.cpp_extension.load", FakeExtension.load)
    # The first build: the compiler has no OpenMP, so the library is marked.
    monkeypatch.setattr(native, "_openmp_flags", lambda: ())
    assert native.load_kernels.__wrapped__() == directory
    assert built == [directory] and (directory / native.WITHOUT_OPENMP).is_file()
    marker = directory / native.WITHOUT_OPENMP

    def not_asked() -> tuple[str, ...]:
        raise AssertionError("a fresh marker must not run the compiler")

    # A later process within the day: the marked build is loaded without asking.
    monkeypatch.setattr(native, "_openmp_flags", not_asked)
    assert native.load_kernels.__wrapped__() == directory
    assert built == [directory] and loaded == [str(directory / f"{LIBRARY}.so")]
    # A day later: the compiler is asked again.
    old = marker.stat().st_mtime - native.REPROBE_OPENMP_S - 60
    os.utime(marker, (old, old))
    monkeypatch.setattr(native, "_openmp_flags", lambda: tuple(flags))
    assert native.load_kernels.__wrapped__() == directory
    if compiler_has_openmp:  # rebuilt with it, unmarked
        assert built == [directory, directory] and len(loaded) == 1
        assert not marker.exists()
    else:  # still without: loaded as it is, the marker renewed
        assert built == [directory] and len(loaded) == 2
        assert marker.stat().st_mtime > old + native.REPROBE_OPENMP_S
