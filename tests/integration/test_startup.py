"""The one startup sequence: phase order, out-of-order calls, and every front end using it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from llmrt.containers import RuntimeContainer, close_runtime
from structlog.testing import capture_logs

from llmrt.errors import ConfigError, KVCacheStateError
from llmrt.recipe.loader import load_recipe
from llmrt.runtime.startup import StartupPhase, StartupSequence

Runtime = Any  # conftest's Runtime

#: The spec's lifecycle sections 2-4 as the events a started runtime must log, in order.
STARTUP_EVENTS = [
    ("kv.configured", None),
    ("kv.allocated", None),
    ("warmup.completed", "decode"),
    ("warmup.completed", "prefill"),
    ("compile_gate.closed", None),
    ("trace.activated", None),
]


def test_run_performs_the_phases_in_the_spec_order(build: Callable[..., Runtime]) -> None:
    runtime = build("tiny-llama")
    with capture_logs() as logs:
        group = runtime.container.startup().run(num_blocks=32)
    wanted = {name for name, _ in STARTUP_EVENTS}
    seen = [(e["event"], e.get("operation")) for e in logs if e["event"] in wanted]
    firsts = sorted(set(seen), key=seen.index)
    assert firsts == STARTUP_EVENTS
    assert runtime.container.startup().phase is StartupPhase.ACTIVE
    assert group.lanes[0].layout.num_blocks == 32
    assert group.lanes[0].warmup.captured


def test_phases_out_of_order_raise_and_finished_phases_are_no_ops(
    build: Callable[..., Runtime],
) -> None:
    runtime = build("tiny-llama")
    startup: StartupSequence = runtime.container.startup()
    with pytest.raises(KVCacheStateError, match=r"warmup_decode\(\) needs allocate_kv_cache"):
        startup.warmup_decode()
    with pytest.raises(KVCacheStateError, match=r"activate\(\) needs allocate_kv_cache"):
        startup.activate()
    startup.configure_kv_capacity(16)
    startup.configure_kv_capacity(16)  # finished: a no-op
    startup.configure_kv_capacity(None)  # None asks for what is configured: a no-op
    assert startup.phase is StartupPhase.CONFIGURED
    with pytest.raises(KVCacheStateError, match="already configured"):
        startup.configure_kv_capacity(8)
    handles = startup.allocate_kv_cache()
    assert startup.allocate_kv_cache() == handles  # idempotent: the same bound handles
    with pytest.raises(KVCacheStateError, match="cannot change to 8 blocks after allocation"):
        startup.configure_kv_capacity(8)
    startup.warmup_prefill()
    with pytest.raises(KVCacheStateError, match=r"needs warmup_decode first"):
        startup.activate()
    startup.warmup_decode()
    startup.activate()
    startup.activate()
    assert startup.active


def test_llm_and_the_vllm_adapter_start_through_the_container_sequence() -> None:
    from llmrt import LLM
    from llmrt.vllm.adapter import VLLMAdapter

    with LLM.from_recipe("tiny-llama") as llm:
        assert llm.container.startup().phase is StartupPhase.ACTIVE
    adapter = VLLMAdapter.initialize_vllm_model(recipe="tiny-llama", hf_config=None)
    try:
        assert adapter.startup is adapter._container.startup()  # type: ignore[union-attr]
        assert adapter.startup.phase is StartupPhase.BUILT
        adapter.allocate_kv_cache((16, 2, 16, 16), "float32", 2)
        adapter.warmup_model_prefill()
        assert not adapter.startup.active
        adapter.warmup_model_decode()
        assert adapter.startup.active
    finally:
        adapter.close()


def test_a_failed_start_leaves_the_container_closable() -> None:
    container = RuntimeContainer(recipe=load_recipe("tiny-llama"))
    startup = container.startup()
    with pytest.raises(ConfigError, match="may only shrink capacity"):
        startup.run(num_blocks=10_000)
    assert startup.phase is StartupPhase.BUILT
    close_runtime(container)
    assert container.root_scope().closed
