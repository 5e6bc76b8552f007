"""The vLLM adapter: a recorded vLLM-shaped session end to end, and what it rejects."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from llmrt.device.torch import TorchDevice
from llmrt.errors import ConfigError, KVCacheStateError, RequestError
from llmrt.lane_group import LaneGroupHost, LaneGroupLease
from llmrt.paged_kv_cache import KVCacheState, PagedKVCacheContext
from llmrt.sampling_params import SamplingParams
from llmrt.testing import FaultyDevice
from llmrt.vllm_adapter import IGNORED_KWARGS, VLLMAdapter, VLLMAdapterConfig

GREEDY = SamplingParams(temperature=0.0)
Runtime = Any  # conftest's Runtime

#: Prompt lengths whose geometries tiny-llama warms up (10 and 20 batch at 32; 33, 70 alone).
PROMPTS = [
    [(3 * i + 1) % 250 + 1 for i in range(10)],
    [(5 * i + 2) % 250 + 1 for i in range(33)],
    [(7 * i + 3) % 250 + 1 for i in range(20)],
    [(11 * i + 4) % 250 + 1 for i in range(70)],
]
SLOTS = [0, 5, 1, 6]  # interleaved over two lanes of four slots
NUM_BLOCKS = 64
KV_SHAPE = (NUM_BLOCKS, 2, 16, 16)  # (num_blocks, kv_heads_per_device, block_size, head_dim)
STEPS = 3
#: vLLM's block table is wider than the lane layout (32 columns); the extra columns are -1.
VLLM_TABLE_WIDTH = 40


@pytest.fixture
def adapter() -> Iterator[VLLMAdapter]:
    model = VLLMAdapter.initialize_vllm_model(
        recipe="tiny-llama",
        tt_data_parallel=2,
        max_batch_size=8,
        max_seq_len=512,
        hf_config={"vocab_size": 258},
        optimizations="performance",  # whitelisted: the recipe decides precision
    )
    yield model
    model.close()


def _blocks(runtime_lane_capacity: int = 4) -> list[tuple[int, ...]]:
    taken = {0: 0, 1: 0}
    blocks = []
    for prompt, slot in zip(PROMPTS, SLOTS, strict=True):
        lane = slot // runtime_lane_capacity
        need = -(-(len(prompt) + STEPS) // 16)
        blocks.append(tuple(range(taken[lane], taken[lane] + need)))
        taken[lane] += need
    return blocks


def _vllm_prefill_inputs() -> dict[str, Any]:
    tokens = torch.zeros((len(PROMPTS), max(map(len, PROMPTS))), dtype=torch.int64)
    table = torch.full((len(PROMPTS), VLLM_TABLE_WIDTH), -1, dtype=torch.int32)
    for row, (prompt, ids) in enumerate(zip(PROMPTS, _blocks(), strict=True)):
        tokens[row, : len(prompt)] = torch.tensor(prompt)
        table[row, : len(ids)] = torch.tensor(ids)
    return {
        "tokens": tokens,
        "page_table": table,
        "prompt_lens": torch.tensor([len(p) for p in PROMPTS]),
        "start_pos": None,
        "empty_slots": SLOTS,
    }


def _vllm_decode_inputs(last: list[int], step: int) -> dict[str, Any]:
    """vLLM's fixed decode batch: row = global slot, -1 positions for empty slots."""
    tokens = torch.zeros((8, 1), dtype=torch.int64)
    positions = torch.full((8,), -1, dtype=torch.int64)
    table = torch.full((8, VLLM_TABLE_WIDTH), -1, dtype=torch.int32)
    for row, (prompt, slot, ids) in enumerate(zip(PROMPTS, SLOTS, _blocks(), strict=True)):
        tokens[slot, 0] = last[row]
        positions[slot] = len(prompt) + step
        table[slot, : len(ids)] = torch.tensor(ids)
    return {"tokens": tokens, "start_pos": positions, "page_table": table}


def _replay(model: VLLMAdapter, record: list[str]) -> list[list[int]]:
    """The calls a vLLM TT model runner makes, in its order, logged in ``record``."""

    def call(method: str, *args: Any, **kwargs: Any) -> Any:
        record.append(method)
        return getattr(model, method)(*args, **kwargs)

    kv = call("allocate_kv_cache", KV_SHAPE, torch.float32, 2)
    for trace in (False, True):  # the runner warms up eagerly, then with traces enabled
        call("warmup_model_prefill", kv_cache=kv, enable_trace=trace, can_sample_on_device=True)
        call(
            "warmup_model_decode",
            kv_cache=kv,
            enable_trace=trace,
            max_batch_size=8,
            num_blocks=NUM_BLOCKS,
            can_sample_on_device=True,
            greedy_only=True,
        )
    first = call(
        "prefill_forward",
        kv_cache=kv,
        enable_trace=True,
        sampling_params=GREEDY,
        **_vllm_prefill_inputs(),
    )
    generated = [[int(t)] for t in first]
    for step in range(STEPS):
        lease = call(
            "decode_forward",
            kv_cache=kv,
            sampling_params=GREEDY,
            reset_batch=step == 0,
            enable_trace=True,
            read_from_device=False,
            **_vllm_decode_inputs([g[-1] for g in generated], step),
        )
        host, events = call("read_decode_output", lease, async_read=True)
        assert isinstance(lease, LaneGroupLease) and isinstance(host, LaneGroupHost)
        assert len(events) == 2  # both lanes' reads in flight together
        tokens = call("process_decode_output_host", host, is_tokens=True)
        for row, slot in enumerate(SLOTS):
            generated[row].append(int(tokens[slot]))
    return generated


def test_a_recorded_vllm_session_matches_the_direct_api(
    adapter: VLLMAdapter, build: Callable[..., Runtime]
) -> None:
    record: list[str] = []
    via_vllm = _replay(adapter, record)

    direct = build("tiny-llama", ["lanes=2"]).ready(num_blocks=NUM_BLOCKS)
    expected = direct.generate(PROMPTS, slots=SLOTS, steps=STEPS)

    assert via_vllm == expected.tokens
    assert record == [
        "allocate_kv_cache",
        *["warmup_model_prefill", "warmup_model_decode"] * 2,
        "prefill_forward",
        *["decode_forward", "read_decode_output", "process_decode_output_host"] * STEPS,
    ]
    for lane in adapter.group.lanes:
        assert lane.warmup.captured and lane.kv_cache.config.num_blocks == NUM_BLOCKS
        assert lane.decode.outstanding_leases == 0


def test_config_resolves_the_legacy_kv_geometry(adapter: VLLMAdapter) -> None:
    config = adapter.config

    assert config == VLLMAdapterConfig.resolve(group=adapter.group, max_model_len=512)
    assert config.legacy_kv_shape(NUM_BLOCKS) == KV_SHAPE
    assert (config.num_layers, config.kv_dtype, config.vocab_size) == (2, torch.float32, 258)
    assert (config.num_lanes, config.lane_capacity, config.max_batch_size) == (2, 4, 8)
    assert config.max_num_blocks == 128 and config.page_table_width == 32
    assert config.ignored_kwargs == frozenset(IGNORED_KWARGS)
    assert adapter.tokenizer is not None and adapter.tokenizer.decode([104, 105]) == "hi"


def test_prefill_without_sampling_returns_logits_in_row_order(adapter: VLLMAdapter) -> None:
    kv = adapter.allocate_kv_cache(KV_SHAPE, "float32", 2)
    adapter.warmup_model_decode(kv_cache=kv)
    adapter.warmup_model_prefill(kv_cache=kv)
    inputs = _vllm_prefill_inputs()

    logits = adapter.prefill_forward(kv_cache=kv, **inputs)
    tokens = adapter.prefill_forward(kv_cache=kv, sampling_params=[GREEDY] * 4, **inputs)

    assert logits.shape == (4, 258) and logits.dtype == torch.float32
    assert torch.equal(logits.argmax(-1), tokens)


def test_a_cached_prefix_given_as_start_pos_continues_from_the_kv(adapter: VLLMAdapter) -> None:
    kv = adapter.allocate_kv_cache(KV_SHAPE, torch.float32, 2)
    adapter.warmup_model_decode(kv_cache=kv)
    adapter.warmup_model_prefill(kv_cache=kv)
    prompt = torch.tensor([PROMPTS[3][:48]])
    full = adapter.prefill_forward(kv_cache=kv, tokens=prompt, page_table=[[0, 1, 2]])
    # Blocks 0 and 1 now hold the first 32 tokens' KV. A request that starts at position 32
    # reads them instead of its own (here deliberately wrong) prefix tokens.
    stale = prompt.clone()
    stale[0, :32] = 0
    cached = adapter.prefill_forward(
        kv_cache=kv, tokens=stale, page_table=[[0, 1, 7]], start_pos=[32], empty_slots=[1]
    )
    uncached = adapter.prefill_forward(kv_cache=kv, tokens=stale, page_table=[[3, 4, 5]])

    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(uncached, full, atol=1e-3)


@pytest.mark.parametrize(
    ("shape", "dtype", "layers", "field"),
    [
        (KV_SHAPE, torch.float32, 3, "num_layers"),
        ((NUM_BLOCKS, 2, 16, 32), torch.float32, 2, "kv_cache_shape[3] (head_dim)"),
        ((NUM_BLOCKS, 4, 16, 16), torch.float32, 2, "kv_cache_shape[1] (kv_heads_per_device)"),
        ((NUM_BLOCKS, 2, 32, 16), torch.float32, 2, "kv_cache_shape[2] (block_size)"),
        (KV_SHAPE, torch.bfloat16, 2, "dtype"),
        (KV_SHAPE, "float64", 2, "dtype"),
        ((4096, 2, 16, 16), torch.float32, 2, "kv_cache_shape[0] (num_blocks)"),
        ((NUM_BLOCKS, 2, 16), torch.float32, 2, "kv_cache_shape"),
    ],
)
def test_a_bad_legacy_kv_spec_is_rejected_naming_the_mismatch(
    adapter: VLLMAdapter, shape: tuple[int, ...], dtype: object, layers: int, field: str
) -> None:
    with pytest.raises(ConfigError) as info:
        adapter.allocate_kv_cache(shape, dtype, layers)

    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    # Nothing was configured or allocated: the right spec still goes through.
    assert all(lane.kv_cache.state is KVCacheState.UNRESOLVED for lane in adapter.group.lanes)
    handles = adapter.allocate_kv_cache(KV_SHAPE, torch.float32, 2)
    assert len(handles) == 2 and all(isinstance(h, PagedKVCacheContext) for h in handles)


def test_unknown_keyword_arguments_are_rejected_by_name(adapter: VLLMAdapter) -> None:
    kv = adapter.allocate_kv_cache(KV_SHAPE, torch.float32, 2)
    inputs = _vllm_prefill_inputs()

    with pytest.raises(RequestError, match=r"^cross_page_table: is not a keyword argument"):
        adapter.prefill_forward(kv_cache=kv, cross_page_table=None, **inputs)
    with pytest.raises(RequestError, match=r"^max_tokens: .*VLLMAdapter\.decode_forward"):
        adapter.decode_forward(kv_cache=kv, max_tokens=3, **_vllm_decode_inputs([1, 1, 1, 1], 0))
    with pytest.raises(RequestError, match=r"^bogus: .*initialize_vllm_model"):
        VLLMAdapter.initialize_vllm_model(recipe="tiny-llama", bogus=1)
    adapter.warmup_model_decode(kv_cache=kv, greedy_only=False)  # whitelisted: accepted


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prompt_lens": [10, 33, 20, 80]}, r"^row 3: prompt_lens: must be in \[1, 70\], got 80"),
        ({"empty_slots": [0, 5, 0, 6]}, r"^row 2: empty_slots: slot is already used by row 0"),
        ({"empty_slots": [0, 5, 1, 8]}, r"^row 3: empty_slots: must be a slot in \[0, 8\)"),
        ({"start_pos": [0, 5, 0, 0]}, r"^row 1: start_pos: cached prefix must be a multiple"),
        ({"page_table": torch.zeros((4, 2), dtype=torch.int32)}, r"^row 1: page_table: has 2"),
        ({"page_table": torch.full((4, 8), -1)}, r"^row 0: page_table: block id at column 0"),
        ({"prompt_lens": [10, 33]}, r"^prompt_lens: has 2 entries for 4 rows"),
        ({"tokens": torch.zeros((4, 70))}, r"^tokens: must hold integers"),
    ],
)
def test_prefill_arguments_are_validated_naming_row_and_field(
    adapter: VLLMAdapter, change: dict[str, Any], message: str
) -> None:
    kv = adapter.allocate_kv_cache(KV_SHAPE, torch.float32, 2)
    inputs = {**_vllm_prefill_inputs(), **change}
    before = [t.clone() for t in kv[0].keys]

    with pytest.raises(RequestError, match=message):
        adapter.prefill_forward(kv_cache=kv, sampling_params=GREEDY, **inputs)

    assert all(torch.equal(a, b) for a, b in zip(before, kv[0].keys, strict=True))


def test_an_out_of_vocabulary_token_names_its_row(adapter: VLLMAdapter) -> None:
    kv = adapter.allocate_kv_cache(KV_SHAPE, torch.float32, 2)
    inputs = _vllm_prefill_inputs()
    inputs["tokens"][2, 4] = 300

    with pytest.raises(RequestError, match=r"^row 2: tokens: token id at position 4 .*got 300"):
        adapter.prefill_forward(kv_cache=kv, **inputs)


def test_decode_rejects_a_block_past_the_lane_layout(adapter: VLLMAdapter) -> None:
    kv = adapter.allocate_kv_cache(KV_SHAPE, torch.float32, 2)
    inputs = _vllm_decode_inputs([1, 1, 1, 1], 0)
    inputs["page_table"][5, 35] = 3

    with pytest.raises(RequestError, match=r"^row 5: page_table: maps a block past column 31"):
        adapter.decode_forward(kv_cache=kv, sampling_params=GREEDY, **inputs)


def test_kv_handles_must_be_the_ones_this_adapter_allocated(adapter: VLLMAdapter) -> None:
    kv = adapter.allocate_kv_cache(KV_SHAPE, torch.float32, 2)
    other = VLLMAdapter.initialize_vllm_model(recipe="tiny-llama", tt_data_parallel=2)
    try:
        foreign = other.allocate_kv_cache(KV_SHAPE, torch.float32, 2)
        with pytest.raises(RequestError, match=r"^kv_cache: has 1 handle\(s\) for 2 lane\(s\)"):
            adapter.warmup_model_decode(kv_cache=kv[0])
        with pytest.raises(KVCacheStateError, match="foreign KV cache handle"):
            adapter.warmup_model_decode(kv_cache=[kv[0], foreign[1]])
    finally:
        other.close()


def test_initialize_checks_vllm_sizes_against_the_recipe() -> None:
    with pytest.raises(ConfigError, match=r"^max_batch_size: exceeds the recipe's decode slots"):
        VLLMAdapter.initialize_vllm_model(recipe="tiny-llama", max_batch_size=16)
    with pytest.raises(ConfigError, match=r"^max_seq_len: exceeds .*max_model_len=512"):
        VLLMAdapter.initialize_vllm_model(recipe="tiny-llama", max_seq_len=1024)
    with pytest.raises(ConfigError, match=r"^tt_data_parallel: disagrees with .*lanes=1"):
        VLLMAdapter.initialize_vllm_model(
            recipe="tiny-llama", overrides={"lanes": 1}, tt_data_parallel=2
        )
    with pytest.raises(ConfigError, match=r"^hf_config.vocab_size: the recipe's model has 258"):
        VLLMAdapter.initialize_vllm_model(recipe="tiny-llama", hf_config={"vocab_size": 32000})


def test_a_mesh_device_overrides_the_recipes_device() -> None:
    mesh = FaultyDevice(TorchDevice("cpu"), fail={})
    model = VLLMAdapter.initialize_vllm_model(
        recipe="tiny-gpt2", mesh_device=mesh, tt_data_parallel=2
    )
    try:
        lanes = [lane.kv_cache.borrowed_device for lane in model.group.lanes]
        assert all(isinstance(d, FaultyDevice) and d.parent is mesh for d in lanes)
        model.allocate_kv_cache((32, 4, 16, 16), torch.float32, 2)
        assert len(mesh.calls_of("allocate")) == 2 * 2 * 2  # lanes * layers * (K, V)
    finally:
        model.close()
    assert len(mesh.calls_of("deallocate")) >= 8
