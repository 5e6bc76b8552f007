"""``device.gemm_dtype: auto``: bfloat16 GEMMs on AMX, else int8 (one-level 8-bit
activations) on x86 from AVX2 (Zen 4 included, where it beat bfloat16), else bfloat16 where
the CPU multiplies it faster than float32, float32 elsewhere and for float weights; under
int8, kinds without its kernel take bfloat16 only where that is faster. The CPU is read from
``/proc/cpuinfo``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmrt.device.cpu_features import CpuFeatures, bfloat16_gemm_advantage, read_cpu_features
from llmrt.errors import ConfigError
from llmrt.families.layers import int8_fallback_dtype, resolve_gemm_dtype

CPU = torch.device("cpu")
ZEN4 = CpuFeatures(
    vendor="AuthenticAMD",
    flags=frozenset({"avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16"}),
)
#: A Zen 4 forced to the AVX-512 BF16 flags alone (no int8 GEMM level): bfloat16 stays faster.
AMD_BF16_ONLY = CpuFeatures(vendor="AuthenticAMD", flags=frozenset({"avx512f", "avx512_bf16"}))
ZEN3 = CpuFeatures(vendor="AuthenticAMD", flags=frozenset({"avx2", "fma"}))
EMERALD_RAPIDS_VM = CpuFeatures(
    vendor="GenuineIntel", flags=frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"})
)
GRAVITON3 = CpuFeatures(vendor="", flags=frozenset({"asimd", "asimddp", "i8mm", "bf16"}))
SAPPHIRE_RAPIDS_AMX = CpuFeatures(
    vendor="GenuineIntel", flags=frozenset({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
)

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse avx512f avx512_bf16 avx512_vnni

processor\t: 1
vendor_id\t: AuthenticAMD
flags\t\t: amx_bf16
"""


def test_cpuinfo_is_read_from_its_first_cpu(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO)
    cpu = read_cpu_features(str(info))
    assert (cpu.vendor, cpu.family, cpu.model) == ("GenuineIntel", "6", "207")
    assert cpu.model_name == "Intel(R) Xeon(R) Processor"
    assert {"avx512_bf16", "avx512_vnni"} <= cpu.flags and "amx_bf16" not in cpu.flags


def test_an_unreadable_cpuinfo_reads_as_nothing_known(tmp_path: Path) -> None:
    cpu = read_cpu_features(str(tmp_path / "missing"))
    assert cpu == CpuFeatures()
    assert bfloat16_gemm_advantage(cpu) is None


@pytest.mark.parametrize(
    ("cpu", "expected"),
    [
        (ZEN4, "int8"),  # pp512 1.2-1.5x its bfloat16 GEMMs' on a 2-core EPYC
        (AMD_BF16_ONLY, "bfloat16"),
        (SAPPHIRE_RAPIDS_AMX, "bfloat16"),
        (EMERALD_RAPIDS_VM, "int8"),  # AVX-512 BF16 without AMX: 0.6x float32's rate
        (ZEN3, "int8"),
        (GRAVITON3, "float32"),  # no int8 GEMM on arm64
        (CpuFeatures(), "float32"),
    ],
    ids=["zen4", "amd-bf16-only", "amx", "intel-no-amx", "avx2", "arm64", "unknown"],
)
def test_auto_picks_the_fastest_gemm_dtype_this_cpu_has(cpu: CpuFeatures, expected: str) -> None:
    dtype, why = resolve_gemm_dtype("auto", device=CPU, quantized=True, cpu=cpu)
    assert dtype == expected
    assert why  # the reason is logged with the choice


@pytest.mark.parametrize(
    ("cpu", "expected"),
    [
        (ZEN4, "bfloat16"),
        (SAPPHIRE_RAPIDS_AMX, "bfloat16"),
        (EMERALD_RAPIDS_VM, "float32"),
        (ZEN3, "float32"),
        (CpuFeatures(), "float32"),
    ],
    ids=["zen4", "amx", "intel-no-amx", "avx2", "unknown"],
)
def test_int8_falls_back_to_bfloat16_only_where_it_is_faster(
    cpu: CpuFeatures, expected: str
) -> None:
    assert int8_fallback_dtype(cpu) == expected


def test_auto_is_float32_without_block_quantized_weights_or_off_the_cpu() -> None:
    assert resolve_gemm_dtype("auto", device=CPU, quantized=False, cpu=ZEN4)[0] == "float32"
    cuda = torch.device("cuda")
    assert resolve_gemm_dtype("auto", device=cuda, quantized=True, cpu=ZEN4)[0] == "float32"


@pytest.mark.parametrize("choice", ["float32", "bfloat16", "int8"])
def test_an_explicit_choice_stands_on_any_cpu(choice: str) -> None:
    for cpu in (ZEN4, EMERALD_RAPIDS_VM, GRAVITON3):
        assert resolve_gemm_dtype(choice, device=CPU, quantized=True, cpu=cpu)[0] == choice


def test_an_unknown_choice_is_refused_by_field_name() -> None:
    with pytest.raises(ConfigError, match=r"device\.gemm_dtype.*must be one of"):
        resolve_gemm_dtype("float16", device=CPU, quantized=True, cpu=ZEN4)


AMX_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: avx512f avx512_bf16 amx_tile amx_bf16 amx_int8
"""


@pytest.mark.parametrize("granted", [True, False])
def test_amx_flags_count_only_where_the_kernel_grants_the_tiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, granted: bool
) -> None:
    # A VM can list AMX and refuse its state: then bfloat16 GEMMs run on AVX-512 (slower than
    # float32 on Intel), so the usable features drop the flags and auto stays float32.
    from llmrt.device import cpu_features

    info = tmp_path / "cpuinfo"
    info.write_text(AMX_CPUINFO)
    monkeypatch.setattr(cpu_features, "amx_permitted", lambda: granted)
    usable = cpu_features.usable_cpu_features(str(info))
    assert ("amx_bf16" in usable.flags) is granted
    assert "avx512_bf16" in usable.flags
    assert bfloat16_gemm_advantage(usable) == ("AMX bfloat16 tiles" if granted else None)
    assert "amx_bf16" in read_cpu_features(str(info)).flags  # the file's word is unchanged
