"""``device.gemm_dtype: auto`` through the container: the quantized model's GEMMs run
bfloat16 on AMX, int8 on an x86 CPU from AVX2 (with bfloat16 for uncovered kinds where the
CPU multiplies it faster: Zen 4), and float32 elsewhere, and the ``weights.placed`` event
says which and why; ``int8`` asked for really runs the one-level 8-bit GEMM on a long
prompt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from llmrt.device.cpu_features import CpuFeatures
from llmrt.families.layers import QuantizedLinear
from llmrt.kernels.native import q8_gemm_supported

TINY = ["kv_cache.num_blocks=32", "warmup.prefill_seq_lens=[32]"]
ZEN4 = CpuFeatures(
    vendor="AuthenticAMD", flags=frozenset({"avx", "avx2", "fma", "f16c", "avx512_bf16"})
)
AMX = CpuFeatures(vendor="GenuineIntel", flags=frozenset({"avx2", "avx512_bf16", "amx_bf16"}))
INTEL_NO_AMX = CpuFeatures(vendor="GenuineIntel", flags=frozenset({"avx512_bf16"}))
ZEN3 = CpuFeatures(vendor="AuthenticAMD", flags=frozenset({"avx", "avx2", "fma", "f16c"}))


def quantized_linears(runtime: Any) -> list[QuantizedLinear]:
    model = runtime.container.lanes()[0].model()
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


def placed_gemm_dtypes(log: Path) -> list[str]:
    events = [json.loads(line) for line in log.read_text().splitlines()]
    return [e["gemm_dtype"] for e in events if e["event"] == "weights.placed"]


@pytest.mark.parametrize(
    ("cpu", "dtype", "fallback"),
    [
        (AMX, "bfloat16", "float32"),
        (ZEN4, "int8", "bfloat16"),
        (ZEN3, "int8", "float32"),
        (INTEL_NO_AMX, "float32", "float32"),
    ],
    ids=["amx", "zen4", "avx2", "no-avx2"],
)
def test_auto_follows_the_cpu(
    build: Any,
    lifecycle_log: Path,
    monkeypatch: pytest.MonkeyPatch,
    cpu: CpuFeatures,
    dtype: str,
    fallback: str,
) -> None:
    monkeypatch.setattr("llmrt.families.layers.usable_cpu_features", lambda: cpu)
    runtime = build(
        "tiny-llama", overrides=[*TINY, "checkpoint.weights=int4", "device.gemm_dtype=auto"]
    ).ready()
    linears = quantized_linears(runtime)
    assert linears and {m.gemm_dtype for m in linears} == {getattr(torch, dtype)}
    assert {m.int8_fallback_dtype for m in linears} == {getattr(torch, fallback)}
    (logged,) = placed_gemm_dtypes(lifecycle_log)
    assert logged.startswith(f"{dtype} (") and logged != f"{dtype} ()"
    covered = sum(q8_gemm_supported(m.ggml_type) for m in linears)
    if dtype == "int8" and covered < len(linears):
        assert f"the other {len(linears) - covered} multiply in {fallback}" in logged


def test_auto_on_float_weights_is_float32_not_an_error(build: Any, lifecycle_log: Path) -> None:
    runtime = build("tiny-llama", overrides=[*TINY, "device.gemm_dtype=auto"]).ready()
    assert quantized_linears(runtime) == []
    (logged,) = placed_gemm_dtypes(lifecycle_log)
    assert logged.startswith("float32 (no block-quantized weights")


def test_int8_runs_the_one_level_gemm_on_a_long_prompt(
    build: Any, lifecycle_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import llmrt.families.layers as layers

    runtime = build(
        "tiny-llama",
        overrides=[
            "kv_cache.num_blocks=64",
            "warmup.prefill_seq_lens=[32]",
            "checkpoint.weights=int4",
            "device.gemm_dtype=int8",
        ],
    ).ready()
    covered, total = layers.int8_gemm_coverage(runtime.container.lanes()[0].model())
    (logged,) = placed_gemm_dtypes(lifecycle_log)
    assert logged.startswith("int8 (asked for") and f"{covered} of {total}" in logged
    if covered == 0:
        pytest.skip("no int8 GEMM at this instruction-set level")
    calls: list[int] = []
    original = layers.q8_gemm
    monkeypatch.setattr(
        layers,
        "q8_gemm",
        lambda x, *a, **kw: calls.append(x.numel() // x.shape[-1]) or original(x, *a, **kw),
    )
    long, short = list(range(3, 3 + 140)), [5, 6, 7]
    out = runtime.generate([long, short], steps=2)
    assert len(out.tokens[0]) == len(out.tokens[1]) > 0
    # Every covered linear but the LM head (it sees the last rows only) took it, on the long
    # prompt's rows (>= 128) only; the 3-token prompt and the decode steps kept the decode
    # kernels.
    assert len(calls) >= covered - 1 and min(calls) >= 128


def test_int8_says_what_kinds_without_its_gemm_multiply_in(
    build: Any, lifecycle_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Q4 blocks in the file's order have no int8 GEMM (it multiplies interleaved blocks):
    # on Zen 4 they multiply in bfloat16, and the warning and weights.placed say so.
    monkeypatch.setattr("llmrt.families.layers.usable_cpu_features", lambda: ZEN4)
    overrides = [*TINY, "checkpoint.weights=int4", "device.weight_layout=ggml"]
    with pytest.warns(RuntimeWarning, match="its GEMMs multiply in bfloat16"):
        runtime = build("tiny-llama", overrides=[*overrides, "device.gemm_dtype=auto"]).ready()
    linears = quantized_linears(runtime)
    assert linears and not any(q8_gemm_supported(m.ggml_type) for m in linears)
    assert {m.float_gemm_dtype() for m in linears} == {torch.bfloat16}
    (logged,) = placed_gemm_dtypes(lifecycle_log)
    n = len(linears)
    assert logged.startswith("int8 (")
    assert logged.endswith(
        f"0 of {n} block-quantized linears have the int8 GEMM, the other {n} multiply in bfloat16)"
    )
