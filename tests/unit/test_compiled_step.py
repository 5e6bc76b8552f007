"""Compiled steps (``device.compile: inductor``).

Fast tests cover the options, the eager pass-through and the compile/recompile
bookkeeping over a stand-in for ``torch.compile`` that guards the way Dynamo does. The
``slow`` tests run real inductor compiles (C++ codegen, tens of seconds each on a busy
CPU): greedy parity with eager through ``LLM.from_recipe``, the on-disk cache reused by
a second process, and recompilation detection under Dynamo.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from lane_fixtures import single_torch_thread, tiny_llama  # noqa: F401  (autouse fixture)
from structlog.testing import capture_logs

from llmrt.device.torch import TorchDevice
from llmrt.errors import ConfigError, KVCacheStateError
from llmrt.recipe.schema import DeviceSpec, InductorSpec
from llmrt.runtime.compiled_step import (
    INDUCTOR_CACHE_ENV,
    CompiledDecode,
    CompileOptions,
    StepCompiler,
)
from llmrt.runtime.program_compiler import ProgramCompiler
from llmrt.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
#: Small tiny-llama coverage: one prefill length per variant and the decode batch.
SMALL_COVERAGE = [
    "prefill.max_chunk_size=64",
    "prefill.batched=false",
    "warmup.prefill_seq_lens=[32]",
    "warmup.prefill_batch_sizes=[1]",
]
PROMPTS = ["Hello world", "The quick brown fox", "x" * 40, "paged attention " * 6]


@attrs.frozen
class _KV:
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    block_size: int


class _Stub:
    """A decode "model" whose forward is a few tensor ops of every input."""

    def __init__(self) -> None:
        self.weight = torch.randn(16, 3, generator=torch.Generator().manual_seed(0))

    def decode_forward(
        self, *, tokens: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor
    ) -> torch.Tensor:
        used = page_table.clamp(min=0).sum(dim=1, keepdim=True).float()
        return self.weight[tokens] + positions[:, None].float() + used


class _Bound:
    is_bound = True


# -- options --------------------------------------------------------------------------------


def test_options_follow_the_recipe_device_section() -> None:
    spec = DeviceSpec(
        compile="inductor",
        inductor=InductorSpec(freezing=True, max_autotune=True, mode="max-autotune-no-cudagraphs"),
    )
    options = spec.compile_options()
    assert (options.mode, options.freezing, options.max_autotune) == ("inductor", True, True)
    assert options.inductor_mode == "max-autotune-no-cudagraphs"
    patches = options.inductor_options()
    assert patches["freezing"] is True and patches["max_autotune"] is True
    assert patches["coordinate_descent_tuning"] is True  # merged from the torch.compile mode
    assert DeviceSpec().compile_options().mode == "eager"
    assert CompileOptions().inductor_options() == {"freezing": False}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "jit"}, "device.compile: must be one of eager, inductor, got 'jit'"),
        ({"freezing": 1}, "device.inductor.freezing: must be a boolean, got 1"),
        ({"inductor_mode": "fast"}, "device.inductor.mode: must be one of default"),
        ({"cache_dir": "/tmp/x"}, "compile.cache_dir: must be a pathlib.Path or None"),
    ],
)
def test_options_reject_bad_values(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        CompileOptions(**kwargs)


def test_inductor_cache_lives_under_llmrt_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMRT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, "/somewhere/else")
    assert CompileOptions().resolved_cache_dir() == tmp_path / "inductor"
    StepCompiler(options=CompileOptions(mode="eager"))
    assert os.environ[INDUCTOR_CACHE_ENV] == "/somewhere/else"  # eager touches nothing
    StepCompiler(options=CompileOptions(mode="inductor"))
    assert os.environ[INDUCTOR_CACHE_ENV] == str(tmp_path / "inductor")


def test_eager_steps_are_the_model_forwards() -> None:
    model = tiny_llama()
    steps = StepCompiler(options=CompileOptions())
    assert steps.decode_step(model, block_size=16) == model.decode_forward
    assert steps.prefill_step(model, block_size=16) == model.prefill_forward
    stats = steps.stats()
    assert (stats.mode, stats.graphs, stats.recompilations, stats.geometries) == ("eager", 0, 0, ())


def test_only_the_listed_operations_are_compiled() -> None:
    model = tiny_llama()
    steps = StepCompiler(options=CompileOptions(mode="inductor", operations=("decode",)))
    assert isinstance(steps.decode_step(model, block_size=16), CompiledDecode)
    assert steps.prefill_step(model, block_size=16) == model.prefill_forward
    assert (steps.compiles("decode"), steps.compiles("prefill")) == (True, False)
    assert [s.operation for s in steps._steps] == ["decode"]
    spec = DeviceSpec(compile="inductor", inductor=InductorSpec(operations=("prefill",)))
    assert spec.compile_options().operations == ("prefill",)
    with pytest.raises(ConfigError, match=r"device\.inductor\.operations"):
        CompileOptions(mode="inductor", operations=("decode", "sample"))
    steps.close()


def test_compiled_step_rejects_a_bad_block_size() -> None:
    steps = StepCompiler(options=CompileOptions(mode="inductor"))
    with pytest.raises(ConfigError, match=r"kv_cache\.block_size"):
        steps.decode_step(_Stub(), block_size=0)  # type: ignore[arg-type]


# -- bookkeeping over a Dynamo-like stand-in --------------------------------------------------


def _fake_dynamo(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, torch.Tensor]]:
    """Replace torch.compile by a stand-in that "compiles" (calls the backend) whenever an
    input's dtype, shape or stride misses its guards, as Dynamo does; the page table's
    marked-dynamic dimension is left out of the guards. Returns the inputs it received."""
    received: list[dict[str, torch.Tensor]] = []

    def fake_compile(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
        assert kwargs["fullgraph"] is True and kwargs["dynamic"] is False
        backend = kwargs["backend"]
        guards: set[tuple[Any, ...]] = set()

        def run(model: Any, **inputs: torch.Tensor) -> Any:
            key = []
            for name, t in inputs.items():
                dynamic = getattr(t, "_dynamo_dynamic_indices", set())
                key.append(
                    (
                        name,
                        t.dtype,
                        tuple(None if i in dynamic else n for i, n in enumerate(t.shape)),
                        t.is_contiguous() if dynamic else t.stride(),
                    )
                )
            if tuple(key) not in guards:
                guards.add(tuple(key))
                backend(None, [])
            received.append(inputs)
            return fn(model, **inputs)

        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(
        "torch._inductor.compile_fx.compile_fx", lambda graph, inputs, config_patches: None
    )
    return received


def test_recompile_of_a_compiled_geometry_is_counted_and_emitted(
    monkeypatch: pytest.MonkeyPatch, inductor_cache: Path
) -> None:
    received = _fake_dynamo(monkeypatch)
    options = CompileOptions(mode="inductor", cache_dir=inductor_cache, precompiled=False)
    steps = StepCompiler(options=options)
    programs = ProgramCompiler(device=TorchDevice("cpu"), kv_cache=_Bound(), step_compiler=steps)
    stub = _Stub()
    step = steps.decode_step(stub, block_size=4)
    tokens = torch.tensor([1, 2, 3])
    table = torch.arange(18, dtype=torch.int32).reshape(3, 6)
    with capture_logs() as logs:
        for last in (0, 5, 9, 23):  # trimmed widths 2, 2, 3 and the full 6: one graph
            positions = torch.tensor([0, last, 1], dtype=torch.int32)
            out = step(tokens=tokens, positions=positions, page_table=table)
            width = max(2, last // 4 + 1)
            assert torch.equal(
                out,
                stub.decode_forward(
                    tokens=tokens, positions=positions, page_table=table[:, :width]
                ),
            )
            seen = received[-1]["page_table"]
            assert seen.shape == (3, width) and seen.is_contiguous()
            assert seen._dynamo_dynamic_indices == {1}  # type: ignore[attr-defined]
        assert steps.stats().graphs == 1
        assert not [e for e in logs if e["event"] == "program.recompiled"]
        step(tokens=torch.tensor([4, 5]), positions=positions[:2], page_table=table[:2])
        assert (steps.stats().graphs, steps.recompilations) == (2, 0)  # a new geometry
        strided = torch.arange(6)[::2]
        step(tokens=strided, positions=positions, page_table=table)
    recompiled = [e for e in logs if e["event"] == "program.recompiled"]
    assert len(recompiled) == 1 and steps.recompilations == 1
    assert recompiled[0]["signature"] == "decode(tokens[3] positions[3] page_table[3, 6])"
    diagnostics = programs.diagnostics()
    assert (diagnostics.compile_mode, diagnostics.compiled_graphs) == ("inductor", 3)
    assert diagnostics.recompilations == 1
    assert diagnostics.recompiled == ("decode(tokens[3] positions[3] page_table[3, 6])",)
    steps.close()
    with pytest.raises(KVCacheStateError, match="closed"):
        step(tokens=tokens, positions=positions, page_table=table)


# -- real inductor compiles ------------------------------------------------------------------


def _bound_tiny_llama() -> tuple[Any, int]:
    model = tiny_llama()
    meta = model.attention_metadata()
    generator = torch.Generator().manual_seed(1)
    shape = meta.kv_shape(32, 8)
    kv = _KV(
        keys=tuple(torch.randn(shape, generator=generator) for _ in range(meta.num_layers)),
        values=tuple(torch.randn(shape, generator=generator) for _ in range(meta.num_layers)),
        block_size=8,
    )
    model.set_kv_cache(kv)
    return model, 8


@pytest.mark.slow
def test_compiled_decode_matches_eager_and_detects_a_forced_recompile(
    inductor_cache: Path,
) -> None:
    model, block_size = _bound_tiny_llama()
    steps = StepCompiler(options=CompileOptions(mode="inductor", cache_dir=inductor_cache))
    step = steps.decode_step(model, block_size=block_size)
    tokens = torch.tensor([3, 17, 42, 0])
    table = torch.arange(32, dtype=torch.int32).reshape(4, 8)
    table[3] = -1  # an inert padding row
    with capture_logs() as logs:
        for last in (5, 20, 63):  # trimmed widths 2, 3 and the full 8
            positions = torch.tensor([last, 1, 9, 0], dtype=torch.int32)
            expected = model.decode_forward(tokens=tokens, positions=positions, page_table=table)
            got = step(tokens=tokens, positions=positions, page_table=table)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert (steps.stats().graphs, steps.recompilations) == (1, 0)
        assert not [e for e in logs if e["event"] == "program.recompiled"]
        strided = torch.zeros(8, dtype=torch.int64)[::2]
        strided.copy_(tokens)
        torch.testing.assert_close(
            step(tokens=strided, positions=positions, page_table=table),
            model.decode_forward(tokens=tokens, positions=positions, page_table=table),
            rtol=1e-4,
            atol=1e-4,
        )
    assert steps.recompilations == 1
    (event,) = [e for e in logs if e["event"] == "program.recompiled"]
    assert event["signature"] == "decode(tokens[4] positions[4] page_table[4, 8])"
    assert len(list((inductor_cache / "steps").iterdir())) == 1  # the recompile is not saved


def _greedy_tokens(overrides: list[str]) -> tuple[list[tuple[int, ...]], Any, list[str]]:
    from llmrt.serving.llm import LLM

    with capture_logs() as logs, LLM.from_recipe("tiny-llama", overrides=overrides) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        diagnostics = llm.container.lanes()[0].program_compiler().diagnostics()
    return [o.token_ids for o in outs], diagnostics, [e["event"] for e in logs]


@pytest.mark.slow
@pytest.mark.parametrize("trace_mode", ["none", "decode_only"])
def test_inductor_serving_matches_eager_greedy_without_recompiling(
    trace_mode: str, inductor_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMRT_CACHE_DIR", str(inductor_cache.parent))
    overrides = [*SMALL_COVERAGE, f"trace.mode={trace_mode}"]
    eager, eager_diag, _ = _greedy_tokens(overrides)
    compiled, diagnostics, events = _greedy_tokens([*overrides, "device.compile=inductor"])
    assert compiled == eager
    assert eager_diag.compile_mode == "eager" and eager_diag.compiled_graphs == 0
    assert diagnostics.compile_mode == "inductor"
    assert diagnostics.compiled_graphs >= 2  # at least one prefill and the decode geometry
    assert diagnostics.recompilations == 0 and "program.recompiled" not in events


_WARMUP_SCRIPT = textwrap.dedent(
    """
    import json, time
    import torch
    from torch._dynamo.utils import counters
    from llmrt.serving.llm import LLM

    start = time.perf_counter()
    with LLM.from_recipe("tiny-llama", overrides=OVERRIDES) as llm:
        stats = llm.container.lanes()[0].program_compiler().borrowed_step_compiler.stats()
        seconds = time.perf_counter() - start
    print(json.dumps({
        "seconds": seconds,
        "graphs": stats.graphs,
        "recompilations": stats.recompilations,
        "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
        "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "aot_miss": counters["aot_autograd"]["autograd_cache_miss"],
    }))
    """
)


@pytest.mark.slow
def test_second_process_warmup_reuses_the_inductor_cache(tmp_path: Path) -> None:
    # Without precompiled steps (tests/unit/test_step_artifacts.py covers those): Dynamo
    # re-traces, inductor's caches hit.
    overrides = [
        *SMALL_COVERAGE,
        "trace.mode=none",
        "device.compile=inductor",
        "device.inductor.precompiled=false",
    ]
    script = f"OVERRIDES = {overrides!r}\n" + _WARMUP_SCRIPT
    env = {k: v for k, v in os.environ.items() if k != INDUCTOR_CACHE_ENV}
    env["LLMRT_CACHE_DIR"] = str(tmp_path)

    def warmup() -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    cold = warmup()
    assert cold["graphs"] >= 2 and cold["recompilations"] == 0
    assert cold["fx_miss"] >= cold["graphs"] and cold["fx_hit"] == 0
    assert any((tmp_path / "inductor" / "fxgraph").iterdir())
    warm = warmup()
    assert warm["graphs"] == cold["graphs"] and warm["recompilations"] == 0
    assert warm["fx_miss"] == 0 and warm["aot_miss"] == 0
    assert warm["fx_hit"] + warm["aot_hit"] >= warm["graphs"]
    print(f"warmup wall time: cold {cold['seconds']:.1f} s, warm {warm['seconds']:.1f} s")
