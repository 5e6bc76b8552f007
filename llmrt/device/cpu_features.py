"""What the host CPU is, read once from Linux ``/proc/cpuinfo`` (its first CPU's lines).

Why: some choices depend on the CPU's arithmetic rather than on its instruction set alone.
bfloat16 GEMMs are the example: AVX-512 BF16 is on AMD Zen 4 and on Intel Cooper Lake and
later, but only some of those multiply bfloat16 faster than float32 (see
``bfloat16_gemm_advantage``).
"""

from __future__ import annotations

import ctypes
import functools
import platform
import sys

import attrs

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


def read_cpu_features(cpuinfo: str = CPUINFO) -> CpuFeatures:
    """``cpuinfo``'s first CPU; an unreadable file gives empty fields (not Linux, or a
    sandbox without ``/proc``)."""
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
        flags=frozenset(fields.get("flags", "").split()),
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
    (``amx_permitted``): what this process can actually run."""
    features = read_cpu_features(cpuinfo)
    if features.flags & AMX_FLAGS and not amx_permitted():
        return attrs.evolve(features, flags=features.flags - AMX_FLAGS)
    return features


def bfloat16_gemm_advantage(features: CpuFeatures) -> str | None:
    """Why bfloat16 GEMMs (oneDNN, float32 accumulation) run faster than float32 ones on
    this CPU, or None where they do not.

    - AMX with bfloat16 tiles (Intel Sapphire Rapids and later, where the OS exposes them):
      tile multiplies many times the AVX-512 float32 rate.
    - AMD with AVX-512 BF16 (Zen 4 and later): ``vdpbf16ps`` retires twice the float32 FMA's
      products; SmolLM2's prefill GEMMs measured ~400 against ~200 GFLOPS on a 2-core EPYC.
    - Elsewhere, no: on Intel without AMX, ``vdpbf16ps`` has the float32 FMA's rate and the
      conversions cost extra; a 2-core Emerald Rapids VM (AVX-512 BF16, AMX not exposed)
      measured 120-164 GFLOPS in bfloat16 against 144-251 in float32 on SmolLM2's shapes.
    """
    if "amx_bf16" in features.flags:
        return "AMX bfloat16 tiles"
    if features.vendor == "AuthenticAMD" and "avx512_bf16" in features.flags:
        return "AMD AVX-512 BF16 (twice the float32 FMA rate)"
    return None
