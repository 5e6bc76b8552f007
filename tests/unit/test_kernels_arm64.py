"""The kernels built for arm64 and run under qemu-user, at every arm64 level.

``scripts/arm_check.sh --run`` cross-compiles the kernel sources with the aarch64 libtorch
into ``op_runner`` (``tests/arm64/op_runner.cpp``: calls the registered ops through the
dispatcher, no Python) and runs this module. Each case here writes its op calls, runs the
driver under ``qemu-aarch64`` for one emulated CPU model and ``LLMRT_KERNELS_ISA`` level,
and checks the results on this (x86) host against independent references: gguf-py's
dequantization in float64 and numpy. The emulated CPUs: Cortex-A72 (NEON only),
Neoverse-N1 (+dotprod) and qemu's ``max`` (+i8mm), each at its detected level, and ``max``
forced down to every lower level. qemu's timings say nothing about speed.

Skipped (with the reason) where qemu-aarch64 or the driver is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from test_kernels_gguf_blocks import random_weight, reference
from test_kernels_interleaved import expected_layout, two_level_bound

from llmrt.kernels.formats import GGML_TYPE, QuantizedWeight
from llmrt.paths import default_cache_dir
from llmrt.testing.gguf_blocks import random_blocks

ARM_DIR = Path(os.environ.get("LLMRT_ARM64_DIR") or default_cache_dir() / "arm64")
QEMU = shutil.which("qemu-aarch64")
SYSROOT = Path("/usr/aarch64-linux-gnu")

CSRC = Path(__file__).resolve().parents[2] / "llmrt" / "kernels" / "csrc"

#: The drivers scripts/arm_check.sh builds: g++ with OpenMP, clang without it (as Apple clang
#: builds on macOS: the parallel loops then run on torch's thread pool, csrc/parallel.h).
RUNNERS = {"gcc": ARM_DIR / "op_runner", "clang": ARM_DIR / "op_runner-clang"}


def _stale(runner: Path) -> bool:
    """Whether a kernel source changed after the driver was built (it would test old code)."""
    built = runner.stat().st_mtime
    return any(p.stat().st_mtime > built for p in CSRC.iterdir() if p.suffix in (".cpp", ".h"))


def _runner_param(name: str, runner: Path) -> object:
    missing = QEMU is None or not runner.is_file() or not SYSROOT.is_dir()
    stale = runner.is_file() and _stale(runner)
    build = "scripts/arm_check.sh --run" + (
        "" if name == "gcc" else ' with CXX="clang++ --target=aarch64-linux-gnu"'
    )
    return pytest.param(
        runner,
        id=name,
        marks=[
            pytest.mark.skipif(
                missing,
                reason="needs qemu-aarch64, the aarch64 libc (g++-aarch64-linux-gnu) and the "
                f"arm64 op runner at {runner} ({build} builds it and runs this module)",
            ),
            pytest.mark.skipif(
                stale, reason=f"{runner} is older than the kernel sources: {build} rebuilds it"
            ),
        ],
    )


RUNNER_PARAMS = [_runner_param(name, runner) for name, runner in RUNNERS.items()]

#: (qemu CPU model, LLMRT_KERNELS_ISA or "" for the detected level, the level that must run)
LEVELS = [
    ("cortex-a72", "", "neon"),
    ("neoverse-n1", "", "dotprod"),
    ("max", "", "i8mm"),
    ("max", "dotprod", "dotprod"),
    ("max", "neon", "neon"),
    ("max", "scalar", "scalar"),
]
LEVEL_IDS = [f"{cpu}-{forced or 'detected'}" for cpu, forced, _ in LEVELS]

OP = "llmrt_kernels::"
INTERLEAVED = 256


def run_arm(
    calls: list[tuple[str, list[object]]], *, runner: Path, cpu: str, forced: str, tmp_path: Path
) -> list[object]:
    """The results of ``calls`` (``(op, args)``, ``("$", i)`` for call i's result) run by the
    arm64 driver under qemu on ``cpu`` with ``LLMRT_KERNELS_ISA=forced``."""
    calls_file, out_file = tmp_path / "calls.pt", tmp_path / "out.pt"
    torch.save(calls, calls_file)
    libs = (ARM_DIR / "op_runner.libs").read_text().strip()
    env = {k: v for k, v in os.environ.items() if k != "LLMRT_KERNELS_ISA"}
    if forced:
        env["LLMRT_KERNELS_ISA"] = forced
    run = subprocess.run(
        [str(QEMU), "-cpu", cpu, "-L", str(SYSROOT), "-E", f"LD_LIBRARY_PATH={libs}",
         "-E", f"OMP_NUM_THREADS={2}", *(["-E", f"LLMRT_KERNELS_ISA={forced}"] if forced else []),
         str(runner), str(calls_file), str(out_file)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results: list[object] = torch.load(out_file, weights_only=False)
    return results


def ref(i: int) -> tuple[str, int]:
    return ("$", i)


@pytest.mark.parametrize("runner", RUNNER_PARAMS)
@pytest.mark.parametrize(("cpu", "forced", "level"), LEVELS, ids=LEVEL_IDS)
def test_the_arm64_kernels_match_the_references(
    runner: Path, cpu: str, forced: str, level: str, tmp_path: Path
) -> None:
    """One driver run per level (qemu startup dominates): the level it ran at, the
    interleaved layout, and every Q4_0/Q4_1/Q8_0 product (both layouts, 1-11 activation rows,
    widths whose last group is partial), the K-quant, Q5 and 16-bit float products (fixed and
    random shapes), RMSNorm and SiLU * up (float32 and bfloat16 out); whether the build has
    OpenMP, that its parallel loops run on two threads either way, and the policy answers
    (int8 dots at every vector level, none of the x86 integer GEMMs)."""
    calls: list[tuple[str, list[object]]] = [(OP + "kernels_isa", [])]
    checks = []
    rng = np.random.default_rng(7)
    for kind in ("q4_0", "q4_1", "q8_0"):
        for cols, rows_m in ((96, 1), (160, 3), (576, 8), (1056, 11), (128, 2), (64, 5)):
            w = random_weight(kind, rows=19, cols=cols, seed=cols + rows_m)
            x = torch.from_numpy(rng.standard_normal((rows_m, cols)).astype(np.float32))
            x[0, :32] *= 30.0  # one block far larger than the rest
            tid = GGML_TYPE[kind]
            calls.append((OP + "gguf_interleave", [w.blocks, tid, cols]))
            inter = len(calls) - 1
            checks.append(("layout", inter, w))
            calls.append((OP + "gguf_linear", [x, ref(inter), tid | INTERLEAVED, cols, None]))
            checks.append(("int8", len(calls) - 1, (w, x)))
            calls.append((OP + "gguf_linear", [x, w.blocks, tid, cols, None]))
            checks.append(("float", len(calls) - 1, (w, x)))
    kquant_cases = [("q4_k", 13, 512, 3), ("q5_k", 13, 256, 5), ("q6_k", 13, 768, 1),
                    ("q5_0", 13, 96, 6), ("q5_1", 13, 160, 2), ("f16", 13, 40, 3),
                    ("bf16", 13, 200, 5)]  # fmt: skip
    # Random shapes per block type: odd and even weight rows and activation rows, so i8mm's
    # pairs (two weight rows x two activation rows) meet every remainder.
    for kind in ("q4_k", "q5_k", "q6_k", "q5_0", "q5_1"):
        qk = 256 if kind.endswith("_k") else 32
        for _ in range(2):
            out_rows = int(rng.integers(5, 25))
            cols, rows_m = qk * int(rng.integers(1, 4)), int(rng.choice([2, 4, 6, 7, 9]))
            kquant_cases.append((kind, out_rows, cols, rows_m))
    for kind, out_rows, cols, rows_m in kquant_cases:
        blocks = torch.from_numpy(random_blocks(kind, out_rows, cols, seed=cols + out_rows,
                                                scale=10.0))  # fmt: skip
        kw = QuantizedWeight(kind=kind, shape=(out_rows, cols), blocks=blocks)  # type: ignore[arg-type]
        x = torch.from_numpy(rng.standard_normal((rows_m, cols)).astype(np.float32))
        calls.append((OP + "gguf_linear", [x, kw.blocks, kw.kernel_type, cols, None]))
        checks.append(("kquant", len(calls) - 1, (kw, x)))
    xn = torch.from_numpy(rng.standard_normal((5, 200)).astype(np.float32))
    wn = torch.from_numpy(rng.uniform(0.5, 1.5, 200).astype(np.float32))
    calls.append((OP + "rms_norm", [xn, wn, 1e-5]))
    checks.append(("rms", len(calls) - 1, (xn, wn)))
    gate_up = torch.from_numpy((3 * rng.standard_normal((4, 2 * 37))).astype(np.float32))
    for dtype, code in ((torch.float32, 6), (torch.bfloat16, 15)):  # c10::ScalarType codes
        calls.append((OP + "mlp_activation", [gate_up, 0, True, code]))  # 0: SiLU
        checks.append(("silu", len(calls) - 1, (gate_up, dtype)))

    # The build's threads and the policies' questions (what arm64 runs natively).
    calls.append((OP + "kernels_openmp", []))
    checks.append(("openmp", len(calls) - 1, runner == RUNNERS["gcc"]))
    calls.append((OP + "parallel_threads", [4]))
    checks.append(("threads", len(calls) - 1, 2))  # OMP_NUM_THREADS=2 below
    calls.append((OP + "int8_dot_supported", []))
    checks.append(("policy", len(calls) - 1, level != "scalar"))
    calls.append((OP + "integer_gemm_supported", []))
    checks.append(("policy", len(calls) - 1, False))
    for kind in ("q4_k", "q5_k", "q6_k"):  # the x86-only GEMMs are never asked for
        calls.append((OP + "kquant_gemm_max_rows", [GGML_TYPE[kind]]))
        checks.append(("policy", len(calls) - 1, 0))
    for kind in ("q4_0", "q4_1"):
        calls.append((OP + "kquant_gemm_max_rows", [GGML_TYPE[kind] | INTERLEAVED]))
        checks.append(("policy", len(calls) - 1, 0))

    results = run_arm(calls, runner=runner, cpu=cpu, forced=forced, tmp_path=tmp_path)

    run_level, cpu_level, _, _ = results[0]  # type: ignore[misc]
    assert run_level == level
    assert cpu_level == {"cortex-a72": "neon", "neoverse-n1": "dotprod", "max": "i8mm"}[cpu]
    for what, i, data in checks:
        got = results[i]
        if what in ("openmp", "threads", "policy"):
            assert got == data, (what, calls[i], got)
            continue
        assert isinstance(got, torch.Tensor), (what, i, got)
        if what == "layout":
            assert np.array_equal(got.numpy(), expected_layout(data)), i
        elif what in ("int8", "float"):
            w, x = data
            w64 = reference(w)
            expected = x.double() @ w64.T
            if what == "int8" and level != "scalar":
                bound = two_level_bound(x, w64)
            else:
                bound = 1e-5 * (x.double().abs() @ w64.abs().T) + 1e-6
            err = (got.double() - expected).abs()
            assert bool((err <= bound).all()), (what, w.kind, tuple(x.shape), float(err.max()))
        elif what == "kquant":
            kw, x = data
            qtype = gguf.GGMLQuantizationType(GGML_TYPE[kw.kind])
            values = gguf.quants.dequantize(kw.blocks.numpy(), qtype)
            dense = torch.from_numpy(np.asarray(values, dtype=np.float64).reshape(kw.shape))
            expected = x.double() @ dense.T
            bound = 1e-5 * (x.double().abs() @ dense.abs().T) + 1e-6
            if kw.kind not in ("f16", "bf16"):  # two-level activations (test_kernels_kquants)
                x64 = x.double().abs().reshape(x.shape[0], -1, 32)
                groups = x64.amax(-1).repeat_interleave(32, -1)
                bound = bound + 2e-5 * (groups @ dense.abs().T)
            err = (got.double() - expected).abs()
            assert bool((err <= bound).all()), (kw.kind, float(err.max()))
        elif what == "silu":
            gate_up, dtype = data
            g, u = gate_up.double()[:, :37], gate_up.double()[:, 37:]
            expected = g / (1 + torch.exp(-g)) * u
            assert got.dtype == dtype
            rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (2**-8, 1e-6)
            assert torch.allclose(got.double(), expected, rtol=rtol, atol=atol)
        else:
            xn, wn = data
            x64 = xn.double()
            expected = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-5) * wn.double()
            assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-6)
