"""``device.gemm_dtype: auto`` through the container: the quantized model's GEMMs run
bfloat16 on a CPU that multiplies it faster and float32 on one that does not, and the
``weights.placed`` event says which and why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from llmrt.device.cpu_features import CpuFeatures
from llmrt.families.layers import QuantizedLinear

TINY = ["kv_cache.num_blocks=32", "warmup.prefill_seq_lens=[32]"]
ZEN4 = CpuFeatures(vendor="AuthenticAMD", flags=frozenset({"avx512_bf16"}))
INTEL_NO_AMX = CpuFeatures(vendor="GenuineIntel", flags=frozenset({"avx512_bf16"}))


def quantized_linears(runtime: Any) -> list[QuantizedLinear]:
    model = runtime.container.lanes()[0].model()
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


def placed_gemm_dtypes(log: Path) -> list[str]:
    events = [json.loads(line) for line in log.read_text().splitlines()]
    return [e["gemm_dtype"] for e in events if e["event"] == "weights.placed"]


@pytest.mark.parametrize(
    ("cpu", "dtype"), [(ZEN4, "bfloat16"), (INTEL_NO_AMX, "float32")], ids=["amd", "intel"]
)
def test_auto_follows_the_cpu(
    build: Any, lifecycle_log: Path, monkeypatch: pytest.MonkeyPatch, cpu: CpuFeatures, dtype: str
) -> None:
    monkeypatch.setattr("llmrt.families.layers.usable_cpu_features", lambda: cpu)
    runtime = build(
        "tiny-llama", overrides=[*TINY, "checkpoint.weights=int4", "device.gemm_dtype=auto"]
    ).ready()
    linears = quantized_linears(runtime)
    assert linears and {m.gemm_dtype for m in linears} == {getattr(torch, dtype)}
    (logged,) = placed_gemm_dtypes(lifecycle_log)
    assert logged.startswith(f"{dtype} (") and logged != f"{dtype} ()"


def test_auto_on_float_weights_is_float32_not_an_error(build: Any, lifecycle_log: Path) -> None:
    runtime = build("tiny-llama", overrides=[*TINY, "device.gemm_dtype=auto"]).ready()
    assert quantized_linears(runtime) == []
    (logged,) = placed_gemm_dtypes(lifecycle_log)
    assert logged.startswith("float32 (no block-quantized weights")
