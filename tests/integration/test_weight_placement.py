"""``device.huge_pages`` through the container: each CPU lane's model has its weights placed
on an advised mapping before its kernels borrow them, the placement is logged
(``weights.placed``), the device advises its KV pools when ``kv_cache.huge_pages`` asks
(``device.opened`` says either way), and greedy tokens and logits are the same as with the
settings off."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from llmrt.device.huge_pages import huge_pages_unavailable

TINY = ["kv_cache.num_blocks=32", "warmup.prefill_seq_lens=[32]"]
PROMPTS = [[72, 101, 108, 108, 111, 32, 119], [1, 2, 3]]


def placed_events(log: Path) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in log.read_text().splitlines()]
    return [e for e in events if e["event"] == "weights.placed"]


def root_device_opened(log: Path) -> dict[str, Any]:
    events = [json.loads(line) for line in log.read_text().splitlines()]
    return next(e for e in events if e["event"] == "device.opened" and e["device"] == "cpu:0")


def model_storages(runtime: Any, lane: int = 0) -> set[int]:
    model = runtime.container.lanes()[lane].model()
    return {
        t.untyped_storage().data_ptr()
        for t in list(model.parameters()) + list(model.buffers())
        if t.numel() > 0
    }


HUGE = pytest.mark.skipif(
    huge_pages_unavailable() is not None, reason=str(huge_pages_unavailable())
)


@HUGE
def test_each_lane_places_its_weights_and_logs_it(build: Any, lifecycle_log: Path) -> None:
    placed = build("tiny-llama", overrides=[*TINY, "lanes=2", "kv_cache.huge_pages=true"]).ready()
    events = placed_events(lifecycle_log)
    assert [e["device"] for e in events] == ["cpu:0/lane0", "cpu:0/lane1"]
    assert root_device_opened(lifecycle_log)["kv_huge_pages"] == "advised"
    assert all("MiB in" in e["weights_placed"] for e in events)
    # Each lane's model is built (its q/k/v fused) from the checkpoint on its own, so each
    # places its own copies, in one mapping. What a model reads straight from the checkpoint
    # (norms, the tied embedding) moved with lane 0's placement (the checkpoint's views
    # follow it), so lane 1 reads those there instead of placing a second copy.
    assert events[0]["weights_shared"] == 0 and events[1]["weights_shared"] > 0
    first, second = model_storages(placed, 0), model_storages(placed, 1)
    assert len(first) == 1 and len(second) == 2 and first < second


def test_switched_off_the_weights_stay_where_they_were_built(
    build: Any, lifecycle_log: Path
) -> None:
    plain = build("tiny-llama", overrides=[*TINY, "device.huge_pages=false"]).ready()
    events = placed_events(lifecycle_log)
    assert [e["weights_on_huge_pages"] for e in events] == ["off (device.huge_pages is false)"]
    opened = root_device_opened(lifecycle_log)
    assert opened["kv_huge_pages"] == "off (kv_cache.huge_pages is false)"  # the default
    assert len(model_storages(plain)) > 1


@HUGE
def test_greedy_tokens_and_logits_are_the_same_placed_or_not(build: Any) -> None:
    placed = build("tiny-llama", overrides=[*TINY, "kv_cache.huge_pages=true"]).ready()
    plain = build("tiny-llama", overrides=[*TINY, "device.huge_pages=false"]).ready()
    got = placed.generate(PROMPTS, steps=6, with_logits=True)
    want = plain.generate(PROMPTS, steps=6, with_logits=True)
    assert got.tokens == want.tokens
    assert torch.equal(got.prefill_logits, want.prefill_logits)
