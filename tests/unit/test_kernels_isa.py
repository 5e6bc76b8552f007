"""The instruction-set level: detected from the CPU, forced with ``LLMRT_KERNELS_ISA``, read
alike by the kernels (``csrc/cpu.h``) and the Python policies (``cpu_features.isa_level``).

Forcing a level makes a process behave like a CPU of that level end to end: the kernels take
only that level's code, the policies see only its flags, torch's own kernels are capped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmrt.device import cpu_features
from llmrt.device.cpu_features import (
    ISA_VARIABLE,
    TORCH_ISA_VARIABLES,
    CpuFeatures,
    detected_isa_level,
    forceable_levels,
    isa_at_least,
    isa_level,
    isa_levels,
    read_cpu_features,
)
from llmrt.errors import ConfigError

AVX2_ONLY = CpuFeatures(vendor="AuthenticAMD", flags=frozenset({"avx", "avx2", "fma", "f16c"}))
SKYLAKE_X = CpuFeatures(
    vendor="GenuineIntel",
    flags=frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}),
)
#: Intel Alder Lake / AMD Zen 5 class: AVX2 with AVX-VNNI, no AVX-512.
ALDER_LAKE = CpuFeatures(vendor="GenuineIntel", flags=AVX2_ONLY.flags | {"avx_vnni"})
#: Intel Sapphire Rapids class: AVX-512 VNNI and AVX-VNNI.
SAPPHIRE_RAPIDS = CpuFeatures(
    vendor="GenuineIntel", flags=SKYLAKE_X.flags | {"avx512_vnni", "avx_vnni", "avx512_bf16"}
)
#: The levels this machine can be forced to (each test that runs code at a level runs it at
#: each of these), its own last.
LEVELS = forceable_levels(read_cpu_features())


@pytest.mark.parametrize(
    ("flags", "machine", "level"),
    [
        (set(), "x86_64", "scalar"),
        ({"avx2", "fma"}, "x86_64", "scalar"),  # no F16C: not the avx2 level
        ({"avx2", "fma", "f16c"}, "x86_64", "avx2"),
        ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}, "x86_64", "avx2"),  # no DQ
        (set(SKYLAKE_X.flags), "x86_64", "avx512"),
        (set(SKYLAKE_X.flags) | {"avx512_vnni"}, "x86_64", "avx512_vnni"),
        ({"avx512_vnni"}, "x86_64", "scalar"),  # a level needs every level below it
        ({"avx2", "fma", "f16c", "avx_vnni"}, "x86_64", "avx_vnni"),
        ({"avx2", "fma", "avx_vnni"}, "x86_64", "scalar"),  # avx_vnni extends avx2
        (set(SKYLAKE_X.flags) | {"avx_vnni"}, "x86_64", "avx512"),  # named by the order
        (set(SAPPHIRE_RAPIDS.flags), "x86_64", "avx512_vnni"),
        ({"fp", "asimd", "avx_vnni"}, "aarch64", "neon"),  # an x86 level only on x86
        ({"fp", "asimd"}, "aarch64", "neon"),
        ({"fp", "asimd", "asimddp"}, "aarch64", "dotprod"),
        ({"fp", "asimd", "asimddp", "i8mm"}, "aarch64", "i8mm"),
        ({"fp", "asimd", "i8mm"}, "aarch64", "neon"),
        (set(), "arm64", "neon"),  # macOS: no flags line, every AArch64 CPU has NEON
        ({"anything"}, "riscv64", "scalar"),
    ],
)
def test_the_level_is_the_highest_whose_flags_the_cpu_lists(
    flags: set[str], machine: str, level: str
) -> None:
    assert detected_isa_level(CpuFeatures(flags=frozenset(flags)), machine) == level


def test_a_forced_level_at_or_below_the_cpu_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ISA_VARIABLE, raising=False)
    assert isa_level(SKYLAKE_X, machine="x86_64") == "avx512"
    for forced in ("scalar", "avx2", "avx512"):
        monkeypatch.setenv(ISA_VARIABLE, forced)
        assert isa_level(SKYLAKE_X, machine="x86_64") == forced


@pytest.mark.parametrize(
    ("cpu", "levels"),
    [
        (AVX2_ONLY, ("scalar", "avx2")),
        (ALDER_LAKE, ("scalar", "avx2", "avx_vnni")),
        (SKYLAKE_X, ("scalar", "avx2", "avx512")),
        (SAPPHIRE_RAPIDS, ("scalar", "avx2", "avx_vnni", "avx512", "avx512_vnni")),
    ],
    ids=["avx2", "alder_lake", "skylake_x", "sapphire_rapids"],
)
def test_avx_vnni_is_forceable_beside_the_order_wherever_the_cpu_has_it(
    monkeypatch: pytest.MonkeyPatch, cpu: CpuFeatures, levels: tuple[str, ...]
) -> None:
    assert forceable_levels(cpu, "x86_64") == levels
    monkeypatch.delenv(ISA_VARIABLE, raising=False)
    assert isa_level(cpu, machine="x86_64") == levels[-1]
    for forced in levels:
        monkeypatch.setenv(ISA_VARIABLE, forced)
        assert isa_level(cpu, machine="x86_64") == forced


def test_avx_vnni_includes_avx2_and_only_its_own_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    """avx_vnni runs the avx2 paths plus AVX-VNNI's, never AVX-512's; a forced level of the
    order below the CPU's own stands for a CPU without AVX-VNNI; the CPU's own level keeps it."""
    monkeypatch.setattr(cpu_features, "isa_levels", lambda machine=None: cpu_features.X86_LEVELS)
    expected = {  # forced level -> (avx2, avx_vnni, avx512, avx512_vnni) included
        "avx2": (True, False, False, False),
        "avx_vnni": (True, True, False, False),
        "avx512": (True, False, True, False),
        "avx512_vnni": (True, True, True, True),  # the CPU's own level: every bit it has
        "scalar": (False, False, False, False),
    }
    for forced, included in expected.items():
        monkeypatch.setenv(ISA_VARIABLE, forced)
        got = tuple(
            isa_at_least(lv, SAPPHIRE_RAPIDS)
            for lv in ("avx2", "avx_vnni", "avx512", "avx512_vnni")
        )
        assert got == included, forced
    monkeypatch.setenv(ISA_VARIABLE, "avx2")  # an Alder Lake forced to plain AVX2
    assert not isa_at_least("avx_vnni", ALDER_LAKE)
    monkeypatch.delenv(ISA_VARIABLE)
    assert isa_at_least("avx_vnni", ALDER_LAKE) and isa_at_least("avx2", ALDER_LAKE)
    assert not isa_at_least("avx512", ALDER_LAKE)


def test_avx_vnni_on_a_cpu_without_it_names_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ISA_VARIABLE, "avx_vnni")
    with pytest.raises(ConfigError, match=r"needs \['avx_vnni'\], which this CPU does not list"):
        isa_level(SKYLAKE_X, machine="x86_64")
    with pytest.raises(ConfigError, match="is not a level"):
        isa_level(CpuFeatures(flags=frozenset({"asimd", "avx_vnni"})), machine="aarch64")


@pytest.mark.parametrize(
    ("forced", "why"),
    [("avx512_vnni", "is above this CPU"), ("portable", "is not a level"), ("AVX2", "not a level")],
)
def test_an_unknown_or_too_high_level_names_the_variable_and_the_choices(
    monkeypatch: pytest.MonkeyPatch, forced: str, why: str
) -> None:
    monkeypatch.setenv(ISA_VARIABLE, forced)
    with pytest.raises(ConfigError, match=why) as info:
        isa_level(SKYLAKE_X, machine="x86_64")
    assert info.value.field == ISA_VARIABLE and info.value.value == forced
    assert "['scalar', 'avx2', 'avx512']" in str(info.value)


@pytest.mark.parametrize(
    ("features", "level"),
    [(set(), "neon"), ({"FEAT_DotProd"}, "dotprod"), ({"FEAT_DotProd", "FEAT_I8MM"}, "i8mm")],
)
def test_macos_arm64_reads_its_levels_from_sysctl(
    monkeypatch: pytest.MonkeyPatch, features: set[str], level: str
) -> None:
    """macOS has no /proc/cpuinfo: the flags come from the sysctl names csrc/cpu.h reads, so
    the policies and LLMRT_KERNELS_ISA see the level the kernels run at (an M2: i8mm)."""
    asked: list[str] = []

    def sysctl(name: str) -> int:
        asked.append(name)
        return int(name.removeprefix("hw.optional.arm.") in features)

    flags = cpu_features.macos_arm_flags(sysctl)
    assert set(asked) == {"hw.optional.arm.FEAT_DotProd", "hw.optional.arm.FEAT_I8MM"}
    assert detected_isa_level(CpuFeatures(flags=flags), machine="arm64") == level
    monkeypatch.setattr(cpu_features.sys, "platform", "darwin")
    monkeypatch.setattr(cpu_features.platform, "machine", lambda: "arm64")
    monkeypatch.setattr(cpu_features, "macos_arm_flags", lambda: flags)
    assert read_cpu_features("/nonexistent").flags == flags
    monkeypatch.setenv(ISA_VARIABLE, "neon")
    assert isa_level(read_cpu_features("/nonexistent"), machine="arm64") == "neon"


def test_the_policies_see_only_the_forced_levels_flags(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    info = tmp_path / "cpuinfo"
    flags = " ".join(sorted(SAPPHIRE_RAPIDS.flags | {"amx_bf16", "sse2"}))
    info.write_text(f"vendor_id\t: GenuineIntel\nflags\t\t: {flags}\n\n")
    monkeypatch.setattr(cpu_features, "amx_permitted", lambda: True)
    monkeypatch.setattr(cpu_features, "isa_levels", lambda machine=None: cpu_features.X86_LEVELS)
    monkeypatch.delenv(ISA_VARIABLE, raising=False)
    assert "amx_bf16" in cpu_features.usable_cpu_features(str(info)).flags
    monkeypatch.setenv(ISA_VARIABLE, "avx512")
    seen = cpu_features.usable_cpu_features(str(info)).flags
    assert {"avx512f", "avx512bw", "sse2"} <= seen
    assert not seen & {"avx512_vnni", "avx512_bf16", "amx_bf16"}
    assert (
        cpu_features.bfloat16_gemm_advantage(cpu_features.usable_cpu_features(str(info))) is None
    )  # the gemm_dtype policy no longer sees AMX
    monkeypatch.setenv(ISA_VARIABLE, "avx2")
    avx2_flags = cpu_features.usable_cpu_features(str(info)).flags
    assert not any(f.startswith("avx512") for f in avx2_flags)
    assert "avx_vnni" not in avx2_flags
    monkeypatch.setenv(ISA_VARIABLE, "avx_vnni")
    vnni_flags = cpu_features.usable_cpu_features(str(info)).flags
    assert {"avx2", "avx_vnni", "sse2"} <= vnni_flags
    assert not vnni_flags & {"avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"}
    monkeypatch.setenv(ISA_VARIABLE, "scalar")
    assert cpu_features.usable_cpu_features(str(info)).flags == {"sse2"}


PROBE = """
import torch
from llmrt.device.cpu_features import isa_level
from llmrt.kernels.native import integer_gemm_supported, int8_dot_supported, kernels_isa
from llmrt.kernels.native import load_kernels, vector_kernels
load_kernels()
from llmrt.device.cpu_features import isa_at_least
run, cpu, bf16, avx_vnni = kernels_isa()
print(run, cpu, bf16, avx_vnni, isa_at_least("avx_vnni"), isa_level(), int8_dot_supported(),
      integer_gemm_supported(), vector_kernels(), torch.backends.cpu.get_cpu_capability())
"""


def _probe(level: str) -> list[str]:
    run = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**_clean_env(), ISA_VARIABLE: level},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.split()


@pytest.mark.parametrize("level", LEVELS)
def test_the_kernels_and_the_policies_run_the_same_forced_level(level: str) -> None:
    run, cpu, bf16, avx_vnni, python_avx_vnni, python, int8, gemm, vector, aten = _probe(level)
    assert (run, python, cpu) == (level, level, LEVELS[-1])
    assert avx_vnni == python_avx_vnni  # the kernels and the policies agree on AVX-VNNI
    assert avx_vnni == str(level == "avx_vnni" or (level == cpu and "avx_vnni" in LEVELS))
    x86 = "avx2" in isa_levels()
    assert int8 == str(x86 and level != "scalar")
    assert gemm == str(level == "avx512_vnni")
    assert vector == str(x86 and level != "scalar")
    if level != LEVELS[-1]:
        assert bf16 == "False"  # a lower level stands for a CPU without the extras
        aten_level = {"scalar": "default", "avx2": "avx2", "avx_vnni": "avx2"}
        assert aten.lower() == aten_level.get(level, "avx512")


def test_an_unknown_level_stops_the_kernels_from_loading() -> None:
    run = subprocess.run(
        [sys.executable, "-c", "from llmrt.kernels.native import load_kernels; load_kernels()"],
        env={**_clean_env(), ISA_VARIABLE: "sse9"},
        capture_output=True,
        text=True,
    )
    assert run.returncode != 0
    assert "ConfigError: LLMRT_KERNELS_ISA: is not a level" in run.stderr


def _clean_env() -> dict[str, str]:
    """This process's environment less the torch caps a forced level here may have set
    (``pin_torch_isa``), so the child caps its own."""
    return {k: v for k, v in os.environ.items() if k not in TORCH_ISA_VARIABLES}
