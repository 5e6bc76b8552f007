"""What the host CPU is, read once from Linux ``/proc/cpuinfo`` (its first CPU's lines), and
the instruction-set level the kernels and the policies run at (``isa_level``).

Why: some choices depend on the CPU's arithmetic rather than on its instruction set alone.
bfloat16 GEMMs are the example: AVX-512 BF16 is on AMD Zen 4 and on Intel Cooper Lake and
later, but only some of those multiply bfloat16 faster than float32 (see
``bfloat16_gemm_advantage``).

``LLMRT_KERNELS_ISA=<level>`` makes this process behave like a CPU of a lower level end to
end: the kernels (``csrc/cpu.h`` reads the same variable), the policies here
(``usable_cpu_features`` drops the flags above the level) and torch's own kernels
(``pin_torch_isa``: ATen's vector dispatch, oneDNN and MKL are capped too).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
import warnings
from collections.abc import Callable

import attrs

from llmrt.errors import ConfigError

CPUINFO = "/proc/cpuinfo"
#: The flags of Intel's AMX tiles, usable only once Linux grants the process their state.
AMX_FLAGS = frozenset({"amx_tile", "amx_bf16", "amx_int8", "amx_fp16"})


@attrs.frozen(kw_only=True)
class CpuFeatures:
    """The first CPU's ``vendor_id``, ``model name``, ``cpu family``, ``model`` and
    ``flags`` (empty where the file does not say)."""

    vendor: str = ""
    model_name: str = ""
    family: str = ""
    model: str = ""
    flags: frozenset[str] = frozenset()


#: macOS arm64's ``sysctl`` feature names and the /proc/cpuinfo flags Linux spells them as
#: (``csrc/cpu.h`` reads the same names with ``sysctlbyname``); Advanced SIMD (``asimd``) is
#: in every AArch64 CPU, as cpu.h assumes.
MACOS_ARM_FLAGS: dict[str, str] = {
    "hw.optional.arm.FEAT_DotProd": "asimddp",
    "hw.optional.arm.FEAT_I8MM": "i8mm",
}


def _sysctl_int(name: str) -> int:
    """macOS ``sysctlbyname(name)`` as an int; 0 where it is missing (or off macOS)."""
    try:
        libc = ctypes.CDLL(None)
        value, size = ctypes.c_int(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_int))
        found = libc.sysctlbyname(
            name.encode(), ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)
        )
    except (OSError, AttributeError):
        return 0
    return value.value if found == 0 else 0


def macos_arm_flags(sysctl: Callable[[str], int] = _sysctl_int) -> frozenset[str]:
    """The Linux-style flags of a macOS arm64 CPU (``sysctl(name) -> int``): there is no
    /proc/cpuinfo, and without them the policies would count an M2 as ``neon`` while the
    kernels run it at ``i8mm``."""
    return frozenset({"asimd"}) | {flag for name, flag in MACOS_ARM_FLAGS.items() if sysctl(name)}


def read_cpu_features(cpuinfo: str = CPUINFO) -> CpuFeatures:
    """``cpuinfo``'s first CPU; an unreadable file gives empty fields (not Linux, or a
    sandbox without ``/proc``), except on macOS arm64, whose flags come from ``sysctl``."""
    if sys.platform == "darwin" and platform.machine().lower() in ("arm64", "aarch64"):
        return CpuFeatures(flags=macos_arm_flags())
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                key, sep, value = line.partition(":")
                key = key.strip()
                if not sep:
                    continue
                if key == "processor" and fields:
                    break  # the first CPU's lines are enough
                if value.strip():
                    fields[key] = value.strip()
    except OSError:
        pass
    return CpuFeatures(
        vendor=fields.get("vendor_id", ""),
        model_name=fields.get("model name", ""),
        family=fields.get("cpu family", ""),
        model=fields.get("model", ""),
        flags=frozenset((fields.get("flags") or fields.get("Features", "")).split()),
    )


@functools.cache
def amx_permitted() -> bool:
    """Whether Linux grants this process AMX tile data (``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``, the request oneDNN makes too). Why: a kernel, VM or sandbox may
    list the AMX flags and still refuse, and then oneDNN's bfloat16 GEMMs fall back to
    AVX-512, slower than float32 on Intel (llama.cpp's own AMX build faulted on such a VM).
    False off Linux x86-64."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        sys_arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
        return int(libc.syscall(sys_arch_prctl, req_xcomp_perm, xfeature_xtiledata)) == 0
    except (OSError, AttributeError):
        return False


def usable_cpu_features(cpuinfo: str = CPUINFO) -> CpuFeatures:
    """``read_cpu_features`` less the AMX flags where the kernel does not grant AMX state
    (``amx_permitted``), and less every flag above the forced level (``isa_level``): what
    this process can actually run, or is told to run as."""
    features = read_cpu_features(cpuinfo)
    flags = features.flags
    if flags & AMX_FLAGS and not amx_permitted():
        flags = flags - AMX_FLAGS
    level = _running_level(features)
    if level != detected_isa_level(features):
        flags = frozenset(f for f in flags if not _above_level(f, level))
    return features if flags == features.flags else attrs.evolve(features, flags=flags)


#: The kernels' instruction-set levels in order (``csrc/cpu.h``), per architecture.
X86_LEVELS: tuple[str, ...] = ("scalar", "avx2", "avx512", "avx512_vnni")
#: Levels beside the order (``csrc/cpu.h``): each is the level it extends plus its flags.
#: ``avx_vnni`` is avx2 plus AVX-VNNI (the 256-bit ``vpdpbusd``: Intel Alder Lake and later
#: clients, AMD Zen 5; Intel Sapphire Rapids and later beside AVX-512). A CPU of the avx2
#: level with it is detected as ``avx_vnni``; it can be forced on any CPU with AVX2 and
#: AVX-VNNI (one with AVX-512 then runs as an AVX2 CPU with AVX-VNNI); forcing a level of
#: the order below the CPU's own drops it, as it drops AVX-512 BF16 and AMX.
BESIDE_LEVELS: dict[str, str] = {"avx_vnni": "avx2"}
ARM64_LEVELS: tuple[str, ...] = ("scalar", "neon", "dotprod", "i8mm")
#: The /proc/cpuinfo flags each level needs (x86: AVX2 + FMA + F16C; AVX-512 F/BW/VL/DQ;
#: AVX-512 VNNI. arm64: Advanced SIMD, its dot product, the int8 matrix multiply).
LEVEL_FLAGS: dict[str, frozenset[str]] = {
    "scalar": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "avx512_vnni": frozenset({"avx512_vnni"}),
    "avx_vnni": frozenset({"avx_vnni"}),
    "neon": frozenset({"asimd"}),
    "dotprod": frozenset({"asimddp"}),
    "i8mm": frozenset({"i8mm"}),
}
ISA_VARIABLE = "LLMRT_KERNELS_ISA"


def isa_levels(machine: str | None = None) -> tuple[str, ...]:
    """The levels of ``machine`` (``platform.machine()`` when not given); ``("scalar",)``
    on an architecture without vector kernels."""
    machine = (machine or platform.machine()).lower()
    if machine in ("x86_64", "amd64", "i686", "i386"):
        return X86_LEVELS
    if machine in ("aarch64", "arm64"):
        return ARM64_LEVELS
    return ("scalar",)


def detected_isa_level(features: CpuFeatures, machine: str | None = None) -> str:
    """The highest level whose flags (and every lower level's) ``features`` lists, named
    ``avx_vnni`` where that is avx2 and the CPU has AVX-VNNI. arm64 without a flags line
    (macOS) counts as ``neon``, which every AArch64 CPU has."""
    best = _chain_level(features, machine)
    for beside, base in BESIDE_LEVELS.items():
        if best == base and LEVEL_FLAGS[beside] <= features.flags:
            return beside
    return best


def _chain_level(features: CpuFeatures, machine: str | None = None) -> str:
    """The highest level of the order whose flags (and every lower level's) are listed."""
    levels = isa_levels(machine)
    best = "scalar"
    for level in levels[1:]:
        needed = LEVEL_FLAGS[level]
        if level == "neon" and not features.flags:
            needed = frozenset()
        if not needed <= features.flags:
            break
        best = level
    return best


def forceable_levels(features: CpuFeatures, machine: str | None = None) -> tuple[str, ...]:
    """The values ``LLMRT_KERNELS_ISA`` may take on this CPU, lowest first: the order up to
    the CPU's level, with each level beside it after the level it extends where the CPU has
    its flags (x86 with AVX-VNNI: ``avx_vnni`` after ``avx2``)."""
    levels = isa_levels(machine)
    chain = levels[: levels.index(_chain_level(features, machine)) + 1]
    allowed: list[str] = []
    for level in chain:
        allowed.append(level)
        allowed += [
            beside
            for beside, base in BESIDE_LEVELS.items()
            if base == level and levels is X86_LEVELS and LEVEL_FLAGS[beside] <= features.flags
        ]
    return tuple(allowed)


def isa_level(features: CpuFeatures | None = None, *, machine: str | None = None) -> str:
    """The level this process runs at: ``LLMRT_KERNELS_ISA`` when set (any level at or below
    the CPU's), else the CPU's own. A value that is not a level, or one above the CPU, is a
    ``ConfigError`` naming the variable and the allowed values."""
    cpu = features if features is not None else read_cpu_features()
    detected = detected_isa_level(cpu, machine)
    forced = os.environ.get(ISA_VARIABLE, "")
    if not forced:
        return detected
    levels = isa_levels(machine)
    allowed = list(forceable_levels(cpu, machine))
    if forced not in allowed:
        if forced in levels:
            why = "is above this CPU"
        elif levels is X86_LEVELS and forced in BESIDE_LEVELS:
            why = f"needs {sorted(LEVEL_FLAGS[forced])}, which this CPU does not list"
        else:
            why = "is not a level"
        raise ConfigError(
            ISA_VARIABLE, forced, f"{why}; this CPU ({detected}) runs one of {allowed}"
        )
    return forced


def isa_at_least(level: str, features: CpuFeatures | None = None) -> bool:
    """Whether the running level (``isa_level``) includes ``level`` (same architecture).
    A level beside the order (``avx_vnni``) is included where it runs by name, or where the
    CPU runs at its own level and has its flags (an AVX-512 CPU with AVX-VNNI)."""
    levels = isa_levels()
    cpu = features if features is not None else read_cpu_features()
    running = _running_level(cpu)
    if level in BESIDE_LEVELS and levels is X86_LEVELS:
        if running == level:
            return True
        own = running == detected_isa_level(cpu) and LEVEL_FLAGS[level] <= cpu.flags
        return own and levels.index(running) >= levels.index(BESIDE_LEVELS[level])
    running = BESIDE_LEVELS.get(running, running)
    return level in levels and levels.index(running) >= levels.index(level)


def _running_level(features: CpuFeatures) -> str:
    """``isa_level(features)``, or the CPU's own level where the forced one is not among its
    levels (a described CPU, not this one: the error is for this CPU's loads)."""
    try:
        return isa_level(features)
    except ConfigError:
        return detected_isa_level(features)


def _above_level(flag: str, level: str) -> bool:
    """Whether a CPU of x86 ``level`` lacks ``flag`` (the vector extensions past it)."""
    if level == "avx512_vnni" or level not in (*X86_LEVELS, *BESIDE_LEVELS):
        return flag in AMX_FLAGS or flag in ("avx512_bf16", "avx512_fp16")
    wide = flag.startswith(("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne", "avx10"))
    if level == "avx_vnni":
        return wide and flag != "avx_vnni"
    if level == "avx512":
        return wide and flag not in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd")
    if level == "avx2":
        return wide
    return wide or flag in ("avx", "avx2", "fma", "f16c")


#: The variables ``pin_torch_isa`` sets (a child process forced to another level drops them).
TORCH_ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
#: What ``pin_torch_isa`` caps torch's own kernels at, per level below the CPU's:
#: (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS).
_TORCH_CAPS: dict[str, tuple[str, str, str]] = {
    "scalar": ("default", "SSE41", "SSE4_2"),
    "avx2": ("avx2", "AVX2", "AVX2"),
    "avx_vnni": ("avx2", "AVX2_VNNI", "AVX2"),
    "avx512": ("avx512", "AVX512_CORE", "AVX512"),
    "avx512_vnni": ("avx512", "AVX512_CORE_VNNI", "AVX512"),
}


def pin_torch_isa() -> str:
    """Cap torch's ATen vector kernels, oneDNN and MKL at the forced level (environment
    variables each reads at its first use; one the user set is left alone); returns the
    level. A process whose ATen already chose a higher capability gets a warning naming the
    cost: its torch ops keep running at the CPU's level."""
    level = isa_level()
    if level == detected_isa_level(read_cpu_features()) or level not in _TORCH_CAPS:
        return level
    aten, onednn, mkl = _TORCH_CAPS[level]
    os.environ.setdefault("ATEN_CPU_CAPABILITY", aten)
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)
    os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", mkl)
    import torch

    running = torch.backends.cpu.get_cpu_capability().lower()
    if running not in (os.environ["ATEN_CPU_CAPABILITY"].lower(), "default"):
        warnings.warn(
            f"{ISA_VARIABLE}={level}: torch's own kernels had already chosen {running} in "
            f"this process and keep it; set the variable before torch runs an op",
            RuntimeWarning,
            stacklevel=2,
        )
    return level


def bfloat16_gemm_advantage(features: CpuFeatures) -> str | None:
    """Why bfloat16 GEMMs (oneDNN, float32 accumulation) run faster than float32 ones on
    this CPU, or None where they do not.

    - AMX with bfloat16 tiles (Intel Sapphire Rapids and later, where the OS exposes them):
      tile multiplies many times the AVX-512 float32 rate.
    - AMD with AVX-512 BF16 (Zen 4 and later): ``vdpbf16ps`` retires twice the float32 FMA's
      products; SmolLM2's prefill GEMMs measured ~400 against ~200 GFLOPS on a 2-core EPYC.
      The int8 GEMMs are faster still there (``int8_gemm_advantage``); bfloat16 is what
      kinds without one take.
    - Elsewhere, no: on Intel without AMX, ``vdpbf16ps`` has the float32 FMA's rate and the
      conversions cost extra; a 2-core Emerald Rapids VM (AVX-512 BF16, AMX not exposed)
      measured 120-164 GFLOPS in bfloat16 against 144-251 in float32 on SmolLM2's shapes.
    """
    if "amx_bf16" in features.flags:
        return "AMX bfloat16 tiles"
    if features.vendor == "AuthenticAMD" and "avx512_bf16" in features.flags:
        return "AMD AVX-512 BF16 (twice the float32 FMA rate)"
    return None


def int8_gemm_advantage(features: CpuFeatures) -> str | None:
    """Why GEMMs over one-level 8-bit activations (``device.gemm_dtype: int8``) beat the
    float32 and two-level integer GEMMs on this CPU, or None where llmrt has no such kernel
    (before AVX2, arm64). Asked after AMX, which multiplies bfloat16 tiles at many times the
    rate; on Zen 4 it beats the bfloat16 GEMMs (2-core EPYC 9004-class, pp512 of a
    Llama-3.2-1B-shaped Q4_0 / Q4_K_M 235 / 212 tokens/s against 170 / 142, SmolLM2 Q4_1
    1.19x). ``csrc/interleaved_q8_gemm.cpp`` and ``csrc/kquant_q8_gemm.cpp`` state the
    measured rates."""
    if "avx2" not in features.flags:
        return None
    if "avx512_vnni" in features.flags or "avx_vnni" in features.flags:
        return "one 8-bit activation level: one vpdpbusd per 4 products, not two"
    return "one 8-bit activation level: one vpmaddubsw per 2 products, not two (AVX2)"
