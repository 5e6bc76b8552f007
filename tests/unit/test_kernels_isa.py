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
#: The levels this machine has (each test that runs code at a level runs it at each of these).
LEVELS = isa_levels()[: isa_levels().index(detected_isa_level(read_cpu_features())) + 1]


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


def test_the_policies_see_only_the_forced_levels_flags(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    info = tmp_path / "cpuinfo"
    flags = " ".join(sorted(SKYLAKE_X.flags | {"avx512_vnni", "avx512_bf16", "amx_bf16", "sse2"}))
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
    monkeypatch.setenv(ISA_VARIABLE, "scalar")
    assert cpu_features.usable_cpu_features(str(info)).flags == {"sse2"}


PROBE = """
import torch
from llmrt.device.cpu_features import isa_level
from llmrt.kernels.native import integer_gemm_supported, int8_dot_supported, kernels_isa
from llmrt.kernels.native import load_kernels, vector_kernels
load_kernels()
run, cpu, bf16 = kernels_isa()
print(run, cpu, bf16, isa_level(), int8_dot_supported(), integer_gemm_supported(),
      vector_kernels(), torch.backends.cpu.get_cpu_capability())
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
    run, cpu, bf16, python, int8, gemm, vector, aten = _probe(level)
    assert (run, python, cpu) == (level, level, LEVELS[-1])
    x86 = "avx2" in isa_levels()
    assert int8 == str(x86 and level != "scalar")
    assert gemm == str(level == "avx512_vnni")
    assert vector == str(x86 and level != "scalar")
    if level != LEVELS[-1]:
        assert bf16 == "False"  # a lower level stands for a CPU without the extras
        assert aten.lower() == {"scalar": "default", "avx2": "avx2"}.get(level, "avx512")


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
