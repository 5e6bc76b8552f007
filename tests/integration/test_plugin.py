"""The pytest plugin's fixtures (``llmrt.testing.plugin``, entry point ``pytest11: llmrt``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from llmrt.containers import start_runtime

from llmrt.testing.faulty_device import FaultyDevice, InjectedFault


def test_runtime_with_an_overridden_device_and_an_audited_log(
    llmrt_runtime: Any, faulty_device: Any, lifecycle_log: Path
) -> None:
    device = faulty_device()
    container = llmrt_runtime(
        "tiny-llama",
        overrides=["kv_cache.num_blocks=32", "warmup.prefill_seq_lens=[32]"],
        providers={"device.device": device},
    )
    start_runtime(container)
    assert container.device.device() is device
    assert any(call.op == "allocate" for call in device.calls)
    events = [json.loads(line)["event"] for line in lifecycle_log.read_text().splitlines()]
    assert "kv.allocated" in events and "warmup.completed" in events
    # closing (and auditing the whole log, kv.released included) happens at teardown


def test_faulty_device_fails_the_chosen_call(faulty_device: Any) -> None:
    import torch

    device: FaultyDevice = faulty_device(fail={"allocate": 2})
    device.allocate(shape=(2,), dtype=torch.float32)
    with pytest.raises(InjectedFault):
        device.allocate(shape=(2,), dtype=torch.float32)


def test_lifecycle_log_fails_a_test_that_breaks_the_contract(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from llmrt.lifecycle.events import component_logger, emit

        def test_releases_what_it_never_allocated(lifecycle_log):
            emit(component_logger("kv_cache", object_id="KV@0x1"), "kv.released")
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        ["*lifecycle contract broken (1 violation(s))*", "*[[]kv-once[]]*never allocated*"]
    )


def test_torch_device_runs_on_cpu_and_marks_the_cuda_variant(pytester: pytest.Pytester) -> None:
    """``-m cuda`` (scripts/gpu_check.sh) selects exactly the CUDA variants, which skip with
    the reason where torch sees no GPU."""
    import torch

    from llmrt.testing.devices import NO_CUDA

    pytester.makepyfile(
        """
        import torch

        def test_on(torch_device):
            assert torch.zeros(1, device=torch_device).device.type in torch_device
        """
    )
    every = pytester.runpytest("-p", "no:cacheprovider", "-rs", "-v")
    every.stdout.fnmatch_lines(["*test_on[[]cpu[]] PASSED*"])
    if torch.cuda.is_available():
        every.assert_outcomes(passed=2)
    else:
        every.assert_outcomes(passed=1, skipped=1)
        every.stdout.fnmatch_lines([f"*SKIPPED*{NO_CUDA}*"])
    cuda = pytester.runpytest("-p", "no:cacheprovider", "-m", "cuda", "-v")
    cuda.stdout.fnmatch_lines(["*test_on[[]cuda[]]*"])
    assert "test_on[cpu]" not in cuda.stdout.str()
    assert cuda.parseoutcomes().get("deselected") == 1
