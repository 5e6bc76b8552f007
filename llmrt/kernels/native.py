"""llmrt's compiled CPU kernels: built once per machine into the cache, then loaded as torch ops.

The C++ sources (``csrc/``: block and dense linear kernels, the fused decode layer) register
``torch.ops.llmrt_kernels.*``. They are built with the system C++ compiler through
``torch.utils.cpp_extension`` (ninja) into a directory named by the digest of the sources,
flags, torch version and Python ABI: next to this
module (``_build/``, where ``scripts/setup.sh`` builds it at install time), or, when that is
not writable, under the cache dir (``$LLMRT_CACHE_DIR/kernels/``). A load that finds the
shared library skips the compiler (except, at most once a day, to ask whether a compiler that
lacked OpenMP has it now: ``WITHOUT_OPENMP``). A machine without a compiler gets a
``KernelUnavailableError`` saying why, which the container turns into a ``ConfigError``
naming ``checkpoint.weights``; float recipes never need the kernels.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from llmrt.device.cpu_features import pin_torch_isa
from llmrt.errors import ConfigError, LLMRTError
from llmrt.lifecycle.progress import progress_step
from llmrt.paths import default_cache_dir

LIBRARY = "llmrt_kernels"
_CSRC = Path(__file__).parent / "csrc"
#: Compiled into one library; the digest also covers the headers beside them.
_SOURCES = (
    _CSRC / "gguf_blocks.cpp",
    _CSRC / "kquants.cpp",
    _CSRC / "kquant_gemm.cpp",
    _CSRC / "kquant_q8_gemm.cpp",
    _CSRC / "stacked.cpp",
    _CSRC / "interleaved.cpp",
    _CSRC / "interleaved_neon.cpp",
    _CSRC / "interleaved_avxvnni.cpp",
    _CSRC / "interleaved_gemm.cpp",
    _CSRC / "interleaved_q8_gemm.cpp",
    _CSRC / "decode_layer.cpp",
    _CSRC / "activation.cpp",
    _CSRC / "prefill_attention.cpp",
    _CSRC / "rope.cpp",
    _CSRC / "rms_norm.cpp",
    _CSRC / "clock_probe.cpp",
    _CSRC / "isa.cpp",
    _CSRC / "parallel.cpp",
    _CSRC / "python_entry.cpp",
)


def _compiler() -> str:
    """The C++ compiler torch's cpp_extension builds with: ``$CXX``, else ``c++``."""
    return os.environ.get("CXX", "c++")


#: ``LLMRT_KERNELS_OPENMP=0`` builds the kernels without OpenMP even where the compiler has
#: it: the build Apple clang makes, so its path (parallel loops on torch's inter-op pool,
#: ``csrc/parallel.h``) is built and tested on Linux too (``scripts/clang_check.sh``).
OPENMP_ENV = "LLMRT_KERNELS_OPENMP"


def _openmp_wanted() -> bool:
    value = os.environ.get(OPENMP_ENV, "1")
    if value not in ("0", "1"):
        raise ConfigError(OPENMP_ENV, value, "must be 0 (build without OpenMP) or 1 (default)")
    return value == "1"


@functools.cache
def _openmp_flags() -> tuple[str, ...]:
    """``("-fopenmp",)`` where the C++ compiler takes it, else ``()`` with a warning.

    Why: ``at::parallel_for`` is an OpenMP pragma in the headers and the fused step's team
    is an OpenMP region. The library links the ``libgomp.so.1`` torch already loaded (same
    soname), so both share one thread pool. clang (with libomp-dev) links LLVM's ``libomp``
    instead, a second pool beside torch's (warned: not measured here, but both pools' idle
    threads spin on the same cores). Apple clang rejects a bare ``-fopenmp``: there (and with
    ``LLMRT_KERNELS_OPENMP=0``) the library builds without it, runs its parallel loops on
    torch's inter-op thread pool (``csrc/parallel.h``) and its fused decode step on one
    thread, which ``auto`` therefore does not pick (``kernels_openmp``).
    """
    if not _openmp_wanted():
        return ()
    compiler = _compiler()
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "omp.cpp"
        source.write_text(
            "#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n"
        )
        try:
            probe = subprocess.run(
                [compiler, "-fopenmp", str(source), "-o", str(Path(tmp) / "omp")],
                capture_output=True,
                timeout=120,
            )
        except (OSError, subprocess.TimeoutExpired):
            return ()
        llvm_runtime = probe.returncode == 0 and b"libomp." in (Path(tmp) / "omp").read_bytes()
    if llvm_runtime:
        warnings.warn(
            f"{compiler} builds llmrt's CPU kernels against LLVM's OpenMP runtime (libomp), "
            "beside the libgomp torch uses: two thread pools in one process, whose idle "
            "threads may spin on the same cores (build with g++ to share torch's pool)",
            RuntimeWarning,
            stacklevel=2,
        )
    if probe.returncode == 0:
        return ("-fopenmp",)
    warnings.warn(
        f"{compiler} does not take -fopenmp: llmrt's CPU kernels build without OpenMP, run "
        "their parallel loops on torch's inter-op thread pool and the fused decode step on "
        "one thread (device.decode_kernel=auto then takes the ops path)",
        RuntimeWarning,
        stacklevel=2,
    )
    return ()


#: The language level the sources need (``std::atomic::wait`` in the fused decode step's
#: barrier), named rather than left to torch: cpp_extension passes -std=c++17 before torch
#: 2.12 and -std=c++20 after, and the later flag wins (torch 2.11 failed to build the kernels).
CXX_STANDARD = "-std=c++20"


def _cflags() -> tuple[str, ...]:
    return (CXX_STANDARD, "-O3", "-fno-math-errno", *_openmp_flags())


def _ldflags() -> tuple[str, ...]:
    return _openmp_flags()


#: Builds kept per build root (each source, flag or torch change builds a new ~3 MB one): the
#: most recently loaded; older ones are deleted after a build.
KEPT_BUILDS = 4


class KernelUnavailableError(LLMRTError):
    """The compiled kernels cannot be built or loaded on this machine."""


def build_directories() -> tuple[Path, ...]:
    """Where this source, torch version and Python ABI build to, in order of preference."""
    digest = hashlib.sha256()
    for path in sorted(_CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    # The flags as asked for (whether the compiler takes -fopenmp is asked when building, so a
    # load does not run the compiler; a build it refused is marked instead: WITHOUT_OPENMP).
    asked = (CXX_STANDARD, "-O3", "-fno-math-errno", "-fopenmp", "-fopenmp")
    digest.update(" ".join(asked).encode())
    if not _openmp_wanted():  # a build without OpenMP is another library
        digest.update(f"{OPENMP_ENV}=0".encode())
    # The compiler as named (torch's cpp_extension builds with $CXX): a gcc and a clang build
    # of the same sources are different libraries (scripts/clang_check.sh builds both).
    digest.update(_compiler().encode())
    digest.update(f"{torch.__version__}|{sys.implementation.cache_tag}".encode())
    name = digest.hexdigest()[:16]
    return (Path(__file__).parent / "_build" / name, default_cache_dir() / "kernels" / name)


@functools.cache
def load_kernels() -> Path:
    """Make ``torch.ops.llmrt_kernels`` available, building the library if needed (once);
    returns the directory it was loaded from. A bad ``LLMRT_KERNELS_ISA`` is a
    ``ConfigError`` here, before the library reads it."""
    pin_torch_isa()
    candidates = build_directories()
    for directory in candidates:
        library = directory / f"{LIBRARY}.so"
        if not library.is_file():
            continue
        # Shared: waits out a build in progress here (its half-linked library must not load).
        with _build_lock(directory, exclusive=False):
            if _openmp_arrived(directory):
                # Built without OpenMP when the compiler lacked it, which it now has
                # (libomp-dev installed since): the directory's name does not say, so build
                # again below.
                _discard(library)
                break
            if _damaged(library):
                warnings.warn(
                    f"{library} is not the size its build left (damaged or truncated); "
                    "building it again",
                    RuntimeWarning,
                    stacklevel=2,
                )
                _discard(library)
                break
            if not library.is_file():  # discarded by a process that held the lock before
                break
            _load(library)
            if not (directory / SIZE_RECORD).exists():  # built before the record was kept
                _record_size(library)
            _touch(directory)
            _register_fakes()
            return directory
    directory = next((d for d in candidates if _writable(d)), candidates[-1])
    _build(directory)
    _register_fakes()
    prune_builds(directory.parent, keep=directory)
    return directory


#: Marks a build made without OpenMP because the compiler did not take ``-fopenmp`` (not by
#: ``LLMRT_KERNELS_OPENMP=0``, which names its own directory): a build directory is named
#: before the compiler is asked (so loading does not run it), so this is how a later load
#: learns to ask again (clang before and after ``libomp-dev``).
WITHOUT_OPENMP = "built-without-openmp"

#: How often a load asks the compiler again about a marked build (the marker's age): once a
#: day, not every process, where the answer stays no (Apple clang) — a probe runs the compiler.
REPROBE_OPENMP_S = 24 * 3600


def _openmp_arrived(directory: Path) -> bool:
    """Whether ``directory`` holds a fallback build without OpenMP that the compiler could now
    build with it. Asked only where such a build is found and its marker is older than
    ``REPROBE_OPENMP_S``; a no renews the marker, silently (the build warned already)."""
    marker = directory / WITHOUT_OPENMP
    try:
        age = time.time() - marker.stat().st_mtime
    except OSError:
        return False
    if age < REPROBE_OPENMP_S or not _openmp_wanted() or not _writable(directory):
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        arrived = bool(_openmp_flags())
    if not arrived:
        with contextlib.suppress(OSError):
            marker.touch()
    return arrived


def _touch(directory: Path) -> None:
    """Mark a build used (the last to be pruned); a read-only install stays as it is."""
    with contextlib.suppress(OSError):
        os.utime(directory)


def prune_builds(root: Path, *, keep: Path, kept: int = KEPT_BUILDS) -> list[Path]:
    """Delete the builds under ``root`` beyond the ``kept`` most recently used (never
    ``keep``); returns what was deleted. A process that already loaded a deleted build
    keeps running it (the mapping outlives the file); one about to load it rebuilds."""
    builds = []
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            with contextlib.suppress(OSError):
                if entry.is_dir() and (entry / f"{LIBRARY}.so").is_file():
                    builds.append((entry.stat().st_mtime, entry))
    builds.sort(key=lambda b: b[0], reverse=True)
    removed = []
    for _, entry in builds[kept:]:
        if entry == keep:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            removed.append(entry)
    return removed


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK)


def require_kernels(*, field: str, value: object) -> None:
    """Load the kernels, or raise a ``ConfigError`` naming the recipe ``field`` that needs them."""
    try:
        load_kernels()
    except KernelUnavailableError as exc:
        raise ConfigError(field, value, f"needs llmrt's CPU kernels: {exc}") from exc


def kernels_available() -> tuple[bool, str]:
    """``(True, "")`` when the kernels load, else ``(False, why)``."""
    try:
        load_kernels()
    except KernelUnavailableError as exc:
        return False, str(exc)
    return True, ""


@functools.cache
def kernels_loaded() -> bool:
    """``kernels_available()[0]``, asked once per process (for checks on hot paths)."""
    return kernels_available()[0]


@functools.cache
def python_entry() -> ModuleType | None:
    """The library imported as a Python extension module (``python_entry.cpp``: entries
    that skip the TorchScript call path), or None when it does not import."""
    library = load_kernels() / f"{LIBRARY}.so"
    spec = importlib.util.spec_from_file_location(LIBRARY, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError:
        return None
    return module


def kernels_isa() -> tuple[str, str, bool, bool]:
    """(the level the loaded kernels run at, the CPU's level, whether their AVX-512 BF16
    paths run, whether their AVX-VNNI paths may run): ``csrc/cpu.h``'s reading, which
    ``llmrt.device.cpu_features.isa_level`` and ``isa_at_least("avx_vnni")`` must agree
    with."""
    run, cpu, bf16, avx_vnni = torch.ops.llmrt_kernels.kernels_isa()
    return str(run), str(cpu), bf16 == "bf16", avx_vnni == "avx_vnni"


@functools.cache
def int8_dot_supported() -> bool:
    """Whether the running level has the interleaved layout's integer-dot decode kernels
    (AVX2 ``maddubs``, AVX-VNNI and AVX-512 VNNI ``dpbusd``, arm64 NEON
    ``smull``/``sdot``/``smmla``); False too when the kernels do not load (asked once per
    process)."""
    if not kernels_loaded():
        return False
    return bool(torch.ops.llmrt_kernels.int8_dot_supported())


@functools.cache
def integer_gemm_supported() -> bool:
    """Whether the running level's integer GEMM over the interleaved layout beats dequantize +
    float GEMM at every row count (AVX-512 VNNI). At AVX2 the kernels run their own integer
    GEMM from 16 rows, but it loses to MKL's sgemm from ~128 rows
    (``INTERLEAVED_FLOAT32_GEMM_MIN_ROWS``), so there prefill-sized calls dequantize and run a
    float GEMM. At avx_vnni too: its micro tile (vpdpwssd) took 0.86-0.89x AVX2's time on
    SmolLM2's 1536x576 Q4_1 but 0.94-1.00x on the 576x1536 down projection, which still lost
    to sgemm by 1.08-1.14x at 128-256 rows (one thread)."""
    if not kernels_loaded():
        return False
    return bool(torch.ops.llmrt_kernels.integer_gemm_supported())


@functools.cache
def q8_gemm_supported(kernel_type: int) -> bool:
    """Whether the running level multiplies GEMMs over blocks of ``kernel_type`` (a kernel
    type code) with activations quantized in one 8-bit level, llama.cpp's scheme
    (``device.gemm_dtype: int8``): the interleaved Q4_0 / Q4_1 / Q8_0
    (``csrc/interleaved_q8_gemm.cpp``) and Q4_K / Q5_K / Q6_K in the file's order
    (``csrc/kquant_q8_gemm.cpp``), on x86 from AVX2; False for other kinds, elsewhere, or
    where the kernels do not load."""
    if not kernels_loaded():
        return False
    return interleaved_gemm_q8_supported(kernel_type) or kquant_gemm_q8_supported(kernel_type)


@functools.cache
def kquant_gemm_q8_supported(kernel_type: int) -> bool:
    """Whether ``kquant_gemm_q8`` (``csrc/kquant_q8_gemm.cpp``) multiplies blocks of
    ``kernel_type`` at the running level (Q4_K / Q5_K / Q6_K from AVX2)."""
    if not kernels_loaded():
        return False
    return bool(torch.ops.llmrt_kernels.kquant_gemm_q8_supported(kernel_type))


def q8_gemm(
    x: torch.Tensor,
    blocks: torch.Tensor,
    *,
    kernel_type: int,
    in_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x W^T + b`` over ``W``'s blocks with ``x`` quantized in one 8-bit level (float32
    in and out); only where ``q8_gemm_supported(kernel_type)``."""
    ops = torch.ops.llmrt_kernels
    interleaved = interleaved_gemm_q8_supported(kernel_type)
    op = ops.interleaved_gemm_q8 if interleaved else ops.kquant_gemm_q8
    out: torch.Tensor = op(x, blocks, kernel_type, in_features, bias)
    return out


@functools.cache
def kquant_gemm_max_rows(kernel_type: int) -> int:
    """Activation rows up to which a linear over blocks of ``kernel_type`` (a kernel type code)
    runs the kernels' panel GEMM (``csrc/kquant_gemm.cpp``) rather than dequantize + float
    GEMM, where the running level's GEMM measured faster: the K-quants Q4_K, Q5_K, Q6_K at
    every row count at AVX2 and up to 256 at AVX-512 VNNI, interleaved Q4_0 / Q4_1 at AVX2
    below VNNI; 0 for the rest, or where the kernels do not load."""
    if not kernels_loaded():
        return 0
    return int(torch.ops.llmrt_kernels.kquant_gemm_max_rows(kernel_type))


@functools.cache
def interleaved_gemm_q8_supported(kernel_type: int) -> bool:
    """Whether ``interleaved_gemm_q8`` (``csrc/interleaved_q8_gemm.cpp``: activations in one
    8-bit level per 32 values) runs blocks of ``kernel_type`` at the running level: interleaved
    Q4_0 / Q4_1 / Q8_0 at x86 AVX2 and above; false elsewhere or where the kernels do not
    load. Measured at AVX2 against what runs there today it wins from 16 rows (the smallest
    tried) on Llama-3.2-1B's shapes: 1.8-2.2x (4-bit), 1.1-1.35x (Q8_0, against dequantize +
    sgemm), one thread."""
    if not kernels_loaded():
        return False
    return bool(torch.ops.llmrt_kernels.interleaved_gemm_q8_supported(kernel_type))


@functools.cache
def kernels_openmp() -> bool:
    """Whether the loaded kernels were built with OpenMP (``csrc/parallel.h``): without it
    their parallel loops run on torch's inter-op pool, but the fused decode step's team runs
    on one thread. False too when the kernels do not load."""
    if not kernels_loaded():
        return False
    return bool(torch.ops.llmrt_kernels.kernels_openmp())


@functools.cache
def vector_kernels() -> bool:
    """Whether the running level has the vector loops of the kernels' norm, activation and
    fused-step arithmetic (x86 AVX2 and up); at ``scalar`` torch's own ops are faster and the
    policies take them.

    arm64 (every level) takes torch's ops too, by policy rather than by measurement: the
    fused step's attention and activation loops are x86-only, and the NEON RMSNorm and
    SiLU * up (tested under qemu) were never timed on arm64 hardware, while torch's own ops
    are vectorised there (ATen's NEON ``Vectorized``); so the default never risks being
    slower than the ops. What arm64 does run natively: every quantized linear (NEON,
    sdot, smmla; ``int8_dot_supported``) up to the row counts x86 measured, without the x86
    integer GEMMs (``integer_gemm_supported`` and ``kquant_gemm_max_rows`` are False / 0
    there), so prefill-sized calls dequantize and run torch's float GEMM (its arm64 BLAS)."""
    if not kernels_loaded():
        return False
    return kernels_isa()[0] in ("avx2", "avx_vnni", "avx512", "avx512_vnni")


def _build(directory: Path) -> None:
    from torch.utils import cpp_extension

    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / BUILD_LOCK).touch()
    except OSError as exc:
        raise KernelUnavailableError(f"cannot build the CPU kernels in {directory}: {exc}") from exc
    with _build_lock(directory, exclusive=True) as held:
        library = directory / f"{LIBRARY}.so"
        if library.is_file():  # built by the process this one waited for
            _load(library)
            return
        if held:
            # torch's own build lock (a file it waits on without limit): left by a build
            # that was killed, since no live build holds ours.
            (directory / "lock").unlink(missing_ok=True)
        (directory / SIZE_RECORD).unlink(missing_ok=True)
        try:
            with progress_step("building llmrt's CPU kernels (once per machine, a minute or more)"):
                cpp_extension.load(
                    name=LIBRARY,
                    sources=[str(path) for path in _SOURCES],
                    build_directory=str(directory),
                    extra_cflags=list(_cflags()),
                    extra_ldflags=list(_ldflags()),
                    is_python_module=False,
                    verbose=bool(os.environ.get("LLMRT_KERNELS_VERBOSE")),
                )
        except (OSError, RuntimeError, ImportError) as exc:
            raise KernelUnavailableError(
                f"building the CPU kernels in {directory} failed: {_build_cause(exc)} (needs a "
                f"C++ compiler and ninja; scripts/setup.sh builds them): {exc}"
            ) from exc
        _record_size(library)
    marker = directory / WITHOUT_OPENMP
    if _openmp_wanted() and not _openmp_flags():
        marker.write_text(f"{_compiler()} did not take -fopenmp\n")
    else:
        marker.unlink(missing_ok=True)


#: The file whose ``flock`` one build of a directory holds (released by the OS however the
#: process ends, unlike torch's ``lock`` file, which a killed build leaves for every later
#: build to wait on forever).
BUILD_LOCK = "llmrt-build.lock"

#: Beside the library: its size when its build finished (a later mismatch means the file was
#: damaged, e.g. truncated, and loading it would crash the process with SIGBUS).
SIZE_RECORD = f"{LIBRARY}.so.size"


@contextlib.contextmanager
def _build_lock(directory: Path, *, exclusive: bool) -> Iterator[bool]:
    """Hold the directory's build lock: exclusive to build, shared to load (so a load waits
    out a build, saying so). Yields whether it is held: not without ``fcntl`` (torch's own
    lock guards the build then), on a directory where the lock file cannot be opened (a
    read-only install nobody builds in), or on a file system refusing locks."""
    try:
        import fcntl

        handle = (directory / BUILD_LOCK).open("a")
    except (ImportError, OSError):
        yield False
        return
    with handle:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(handle.fileno(), mode | fcntl.LOCK_NB)
        except BlockingIOError:
            with progress_step(
                f"waiting for another process building the CPU kernels in {directory}"
            ):
                fcntl.flock(handle.fileno(), mode)
        except OSError:  # ENOLCK / EOPNOTSUPP: some network file systems
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _load(library: Path) -> None:
    try:
        torch.ops.load_library(str(library))
    except OSError as exc:
        raise KernelUnavailableError(f"cannot load {library}: {exc}") from exc


def _discard(library: Path) -> None:
    """Remove a library that must be built again, and its size record with it."""
    library.unlink(missing_ok=True)
    (library.parent / SIZE_RECORD).unlink(missing_ok=True)


def _build_cause(exc: BaseException) -> str:
    """The lines of a failed build that say why (torch's message starts with its own
    preamble and the ninja command lines; the compiler's or linker's words come later)."""
    words = ("error", "not found", "no space left", "cannot", "undefined reference", "fatal")
    lines = [
        line.strip()
        for line in str(exc).splitlines()
        if any(w in line.lower() for w in words)
        and not re.search(r"\[\d+/\d+\]|^\s*(Error building extension|FAILED:)", line)
    ]
    return "; ".join(dict.fromkeys(lines[:3])) or type(exc).__name__


def _record_size(library: Path) -> None:
    with contextlib.suppress(OSError):
        (library.parent / SIZE_RECORD).write_text(f"{library.stat().st_size}\n")


def _damaged(library: Path) -> bool:
    """Whether the library's size differs from the one its build recorded (a library with
    no record, built before it was kept, gets one once it has loaded)."""
    record = library.parent / SIZE_RECORD
    try:
        size = library.stat().st_size
        expected = int(record.read_text().strip())
    except (OSError, ValueError):
        return False
    return size != expected


def _register_fakes() -> None:
    """Shape functions, so ``torch.compile`` traces through the ops."""

    @torch.library.register_fake(f"{LIBRARY}::gguf_linear")
    def _linear_fake(
        x: torch.Tensor,
        blocks: torch.Tensor,
        kind: int,
        in_features: int,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], blocks.shape[0]))

    def _gemm_q8_fake(
        x: torch.Tensor, blocks: torch.Tensor, kind: int, k: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], blocks.shape[0]))

    for name in ("interleaved_gemm_q8", "kquant_gemm_q8"):
        torch.library.register_fake(f"{LIBRARY}::{name}")(_gemm_q8_fake)

    @torch.library.register_fake(f"{LIBRARY}::gguf_dequantize")
    def _dequantize_fake(blocks: torch.Tensor, kind: int, in_features: int) -> torch.Tensor:
        return blocks.new_empty((blocks.shape[0], in_features), dtype=torch.float32)

    @torch.library.register_fake(f"{LIBRARY}::gguf_dequantize_bf16")
    def _dequantize_bf16_fake(blocks: torch.Tensor, kind: int, in_features: int) -> torch.Tensor:
        return blocks.new_empty((blocks.shape[0], in_features), dtype=torch.bfloat16)

    @torch.library.register_fake(f"{LIBRARY}::rms_norm")
    def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(f"{LIBRARY}::gguf_interleave")
    def _interleave_fake(blocks: torch.Tensor, kind: int, in_features: int) -> torch.Tensor:
        return torch.empty_like(blocks)


def main() -> None:
    """``python -m llmrt.kernels.native``: build the kernels next to the package (install time;
    the cache dir when that is not writable) and say where they load from."""
    preferred = build_directories()[0]
    if not (preferred / f"{LIBRARY}.so").is_file() and _writable(preferred):
        _build(preferred)
    print(f"llmrt kernels ready in {load_kernels()}")


if __name__ == "__main__":
    main()
