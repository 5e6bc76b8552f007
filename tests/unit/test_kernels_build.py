"""Building the CPU kernels when things go wrong: a build killed earlier, another process
building, a compiler that is missing, a directory that cannot be written, a library damaged
after its build. The compiler itself is faked (torch's ``cpp_extension.load``); what is
tested is llmrt's handling around it (``llmrt.kernels.native``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from llmrt.kernels import native
from llmrt.kernels.native import LIBRARY, KernelUnavailableError


class FakeCompiler:
    """``cpp_extension.load`` writing a library of ``size`` bytes; records what it saw."""

    def __init__(self, size: int = 3) -> None:
        self.size = size
        self.built: list[Path] = []
        self.torch_lock_seen: list[bool] = []

    def load(self, *, build_directory: str, **_: object) -> None:
        directory = Path(build_directory)
        self.built.append(directory)
        self.torch_lock_seen.append((directory / "lock").exists())
        (directory / f"{LIBRARY}.so").write_bytes(b"x" * self.size)


@pytest.fixture
def compiler(monkeypatch: pytest.MonkeyPatch) -> FakeCompiler:
    fake = FakeCompiler()
    monkeypatch.setattr("torch.utils.cpp_extension.load", fake.load)
    monkeypatch.setenv("LLMRT_PROGRESS", "0")
    return fake


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next(
    compiler: FakeCompiler, tmp_path: Path
) -> None:
    directory = tmp_path / "build"
    directory.mkdir()
    (directory / "lock").write_text("")  # torch's baton, from a build killed mid-compile
    native._build(directory)
    assert compiler.built == [directory] and compiler.torch_lock_seen == [False]
    assert (directory / native.SIZE_RECORD).read_text().strip() == "3"


def test_a_process_arriving_during_a_build_waits_then_loads_what_it_built(
    compiler: FakeCompiler, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import fcntl

    directory = tmp_path / "build"
    directory.mkdir()
    loaded: list[str] = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    holder = (directory / native.BUILD_LOCK).open("a")
    fcntl.flock(holder.fileno(), fcntl.LOCK_EX)  # another build is running

    def finish_it() -> None:
        time.sleep(0.3)
        (directory / f"{LIBRARY}.so").write_bytes(b"lib")
        fcntl.flock(holder.fileno(), fcntl.LOCK_UN)

    other = threading.Thread(target=finish_it)
    start = time.monotonic()
    other.start()
    native._build(directory)
    other.join()
    holder.close()
    assert time.monotonic() - start >= 0.25  # it waited for the lock
    assert compiler.built == [] and loaded == [str(directory / f"{LIBRARY}.so")]


def test_a_failed_build_says_why_before_the_command_lines(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def missing_compiler(**_: Any) -> None:
        raise RuntimeError(
            "Error building extension 'llmrt_kernels': [1/20] c++ -MMD -MF gguf_blocks.o.d "
            "-DTORCH_EXTENSION_NAME=llmrt_kernels -O3 -c gguf_blocks.cpp\n"
            "FAILED: gguf_blocks.o\n/bin/sh: 1: c++: not found\nninja: build stopped"
        )

    monkeypatch.setattr("torch.utils.cpp_extension.load", missing_compiler)
    monkeypatch.setenv("LLMRT_PROGRESS", "0")
    with pytest.raises(KernelUnavailableError) as info:
        native._build(tmp_path / "build")
    first = str(info.value).splitlines()[0]
    assert "failed: /bin/sh: 1: c++: not found (needs a C++ compiler" in first, first


def test_an_unwritable_build_directory_is_a_kernel_error_not_an_oserror(
    compiler: FakeCompiler, tmp_path: Path
) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(KernelUnavailableError, match="cannot build the CPU kernels in"):
        native._build(tmp_path / "a-file" / "build")
    assert compiler.built == []


def test_a_library_damaged_after_its_build_is_built_again_not_loaded(
    compiler: FakeCompiler, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    directory = tmp_path / "build"
    loaded: list[str] = []
    monkeypatch.setattr(native, "build_directories", lambda: (directory,))
    monkeypatch.setattr(native, "pin_torch_isa", lambda: None)
    monkeypatch.setattr(native, "_register_fakes", lambda: None)
    monkeypatch.setattr(native, "prune_builds", lambda *a, **k: [])
    monkeypatch.setattr(native, "_touch", lambda d: None)
    monkeypatch.setattr(native, "_openmp_arrived", lambda d: False)
    monkeypatch.setattr(native, "_openmp_flags", lambda: ("-fopenmp",))
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    library = directory / f"{LIBRARY}.so"
    assert native.load_kernels.__wrapped__() == directory
    assert len(compiler.built) == 1
    assert native.load_kernels.__wrapped__() == directory  # intact: loaded as it is
    assert len(compiler.built) == 1 and loaded == [str(library)]
    library.write_bytes(b"x")  # truncated (loading it would end the process with SIGBUS)
    with pytest.warns(RuntimeWarning, match="not the size its build left"):
        assert native.load_kernels.__wrapped__() == directory
    assert len(compiler.built) == 2 and library.stat().st_size == compiler.size


def test_a_load_waits_out_a_build_in_progress_and_records_a_legacy_library(
    compiler: FakeCompiler, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A library present but still being linked by another process must not load until
    that build ends (the load takes the lock shared); a library from before the size record
    gets its record only once it has loaded."""
    import fcntl

    directory = tmp_path / "build"
    directory.mkdir()
    loaded: list[str] = []
    monkeypatch.setattr(native, "build_directories", lambda: (directory,))
    monkeypatch.setattr(native, "pin_torch_isa", lambda: None)
    monkeypatch.setattr(native, "_register_fakes", lambda: None)
    monkeypatch.setattr(native, "_touch", lambda d: None)
    monkeypatch.setattr(native, "_openmp_arrived", lambda d: False)

    def load(path: str) -> None:
        assert (Path(path).read_bytes() == b"linked"), "loaded a half-linked library"
        loaded.append(path)

    monkeypatch.setattr(torch.ops, "load_library", load)
    library = directory / f"{LIBRARY}.so"
    library.write_bytes(b"half")  # the other process's linker is writing it
    holder = (directory / native.BUILD_LOCK).open("a")
    fcntl.flock(holder.fileno(), fcntl.LOCK_EX)

    def finish_link() -> None:
        time.sleep(0.3)
        library.write_bytes(b"linked")
        fcntl.flock(holder.fileno(), fcntl.LOCK_UN)

    other = threading.Thread(target=finish_link)
    other.start()
    assert native.load_kernels.__wrapped__() == directory
    other.join()
    holder.close()
    assert loaded == [str(library)] and compiler.built == []
    assert (directory / native.SIZE_RECORD).read_text().strip() == "6"  # after the load
