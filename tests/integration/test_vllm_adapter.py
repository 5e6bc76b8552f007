"""The vLLM adapter under the TT plugin's argument forms: lanes, each break the plugin hit, rejects.

The call forms are the plugin's (tenstorrent/vllm-tt-plugin, see docs/vllm.md); the
single-lane replay of its whole session lives in ``test_vllm_conformance.py``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from llmrt.device.torch import TorchDevice
from llmrt.errors import ConfigError, KVCacheStateError, RequestError
from llmrt.runtime.paged_kv_cache import KVCacheState, PagedKVCacheContext
from llmrt.sampling.params import SamplingParams
from llmrt.testing import FaultyDevice
from llmrt.vllm.adapter import VLLMAdapter, VLLMDecodeOutput

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
#: The plugin's page-table width: min(cdiv(max_model_len, block_size), num_blocks).
WIDTH = min(math.ceil(512 / 16), NUM_BLOCKS)


class HF:
    """The fields of vLLM's hf_config the adapter reads."""

    _name_or_path = "llmrt/tiny-llama"
    architectures = ["TTLlamaForCausalLM"]
    vocab_size = 258


def _init(lanes: int = 2, mesh: object = None, batch: int = 8, **kw: Any) -> VLLMAdapter:
    """``initialize_vllm_model`` exactly as the plugin's loader calls it."""
    return VLLMAdapter.initialize_vllm_model(
        HF(), mesh, batch, max_seq_len=512, tt_data_parallel=lanes, optimizations=None, **kw
    )


@pytest.fixture(autouse=True)
def _recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMRT_VLLM_RECIPE", "tiny-llama")
    monkeypatch.delenv("LLMRT_VLLM_OVERRIDES", raising=False)


@pytest.fixture
def adapter() -> Iterator[VLLMAdapter]:
    model = _init()
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


def _prefill_inputs() -> dict[str, Any]:
    """``submit_prefill``'s kwargs: int32 tokens, zero-padded tables, numpy lengths."""
    tokens = torch.full((len(PROMPTS), max(map(len, PROMPTS))), 7, dtype=torch.int32)
    table = torch.zeros((len(PROMPTS), WIDTH), dtype=torch.int32)
    for row, (prompt, ids) in enumerate(zip(PROMPTS, _blocks(), strict=True)):
        tokens[row, : len(prompt)] = torch.tensor(prompt)
        table[row, : len(ids)] = torch.tensor(ids)
    return {
        "tokens": tokens,
        "page_table": table,
        "prompt_lens": np.array([len(p) for p in PROMPTS], dtype=np.int64),
        "start_pos": np.zeros(len(PROMPTS), dtype=np.int32),
        "empty_slots": SLOTS,
    }


def _decode_inputs(last: list[int], step: int) -> dict[str, Any]:
    """Lane-mode decode: row = global slot, -1 positions and zero table rows for padding."""
    tokens = torch.zeros((8, 1), dtype=torch.int32)
    positions = torch.full((8,), -1, dtype=torch.int32)
    table = torch.zeros((8, WIDTH), dtype=torch.int32)
    for row, (prompt, slot, ids) in enumerate(zip(PROMPTS, SLOTS, _blocks(), strict=True)):
        tokens[slot, 0] = last[row]
        positions[slot] = len(prompt) + step
        table[slot, : len(ids)] = torch.tensor(ids)
    return {"tokens": tokens, "start_pos": positions, "page_table": table}


def _warm(model: VLLMAdapter, dtype: torch.dtype = torch.bfloat16) -> list[PagedKVCacheContext]:
    kv = model.allocate_kv_cache(KV_SHAPE, dtype, 2)
    model.warmup_model_prefill(kv_cache=kv, enable_trace=False, can_sample_on_device=True)
    model.warmup_model_decode(
        kv_cache=kv,
        enable_trace=False,
        max_batch_size=8,
        num_blocks=WIDTH,
        can_sample_on_device=True,
    )
    return kv


def test_a_two_lane_plugin_session_matches_the_direct_api(
    adapter: VLLMAdapter, build: Callable[..., Runtime]
) -> None:
    kv = _warm(adapter)
    adapter.warmup_model_decode(kv_cache=kv, enable_trace=True, max_batch_size=8, num_blocks=WIDTH)
    columns = SimpleColumns.greedy(len(PROMPTS))
    first = adapter.prefill_forward(**_prefill_inputs(), kv_cache=kv, sampling_params=columns)
    generated = [[int(t)] for t in first.reshape(-1)]
    for step in range(STEPS):
        out = adapter.decode_forward(
            **_decode_inputs([g[-1] for g in generated], step),
            kv_cache=kv,
            sampling_params=SimpleColumns.greedy(8),
            reset_batch=step == 0,
            enable_trace=True,
            read_from_device=False,
        )
        out, events = adapter.read_decode_output(out, async_read=True)
        assert events == []  # a torch device has no ttnn events: the read completes below
        tokens = adapter.process_decode_output_host(out, is_tokens=True)
        for row, slot in enumerate(SLOTS):
            generated[row].append(int(tokens[slot]))

    direct = build("tiny-llama", ["lanes=2"]).ready(num_blocks=NUM_BLOCKS)
    assert generated == direct.generate(PROMPTS, slots=SLOTS, steps=STEPS).tokens
    for lane in adapter.group.lanes:
        assert lane.warmup.captured and lane.kv_cache.config.num_blocks == NUM_BLOCKS
        assert lane.decode.outstanding_leases == 0


class SimpleColumns:
    """TTSamplingParams-shaped columns (lists, as the plugin sends them to the device path)."""

    def __init__(self, **columns: Any) -> None:
        self.__dict__.update(columns)

    @classmethod
    def greedy(cls, rows: int) -> SimpleColumns:
        return cls(
            temperature=[0.0] * rows,
            top_k=[1] * rows,
            top_p=[0.0] * rows,
            presence_penalty=[0.0] * rows,
            frequency_penalty=[0.0] * rows,
            repetition_penalty=[1.0] * rows,
            seed=[None] * rows,
            num_logprobs=[-2] * rows,
            enable_log_probs=[False] * rows,
        )


# -- the seven breaks ---------------------------------------------------------------------


def test_break1_positional_init_with_a_raw_mesh_and_no_recipe_argument() -> None:
    from llmrt.testing.fake_ttnn import FakeTtnn

    fake = FakeTtnn(system_mesh_shape=(1, 2))
    mesh = fake.open_mesh_device(mesh_shape=fake.MeshShape(1, 2), trace_region_size=1 << 20)
    with pytest.warns(RuntimeWarning, match="the vLLM mesh is not used"):
        model = _init(lanes=2, mesh=mesh, batch=8)
    try:
        assert model.recipe is not None and model.recipe.name == "tiny-llama"
        assert (model.config.num_lanes, model.config.lane_capacity) == (2, 4)
    finally:
        model.close()


def test_break1_max_batch_size_sets_each_lanes_decode_slots() -> None:
    model = _init(lanes=2, batch=4)  # the plugin pads each lane's decode batch to 2 rows
    try:
        assert (model.config.lane_capacity, model.config.max_batch_size) == (2, 4)
    finally:
        model.close()


def test_break2_vllm_sizes_the_pool_to_the_recipes_capacity_in_the_model_dtype() -> None:
    per_lane = 4
    tokens = VLLMAdapter.get_max_tokens_all_users(
        model_name=HF._name_or_path,
        num_devices=1,
        tt_data_parallel=2,
        max_model_len=512,
        max_num_seqs=per_lane,
    )
    num_blocks = math.ceil((tokens + 16 * per_lane) / 16)  # worker.get_num_available_blocks_tt
    assert num_blocks == 128  # tiny-llama: kv_cache.max_num_blocks

    model = _init()
    try:
        handles = model.allocate_kv_cache((num_blocks, 2, 16, 16), torch.bfloat16, 2)
        assert [h.keys[0].dtype for h in handles] == [torch.float32] * 2  # the recipe's dtype
        assert [lane.kv_cache.config.num_blocks for lane in model.group.lanes] == [128, 128]
    finally:
        model.close()


def test_break3_decode_warmup_takes_blocks_per_request_and_the_dev_flag(
    adapter: VLLMAdapter,
) -> None:
    kv = adapter.allocate_kv_cache(KV_SHAPE, torch.bfloat16, 2)
    adapter.warmup_model_prefill(
        kv_cache=kv,
        enable_trace=False,
        can_sample_on_device=True,
        non_greedy_decoding_on_device=True,
    )
    adapter.warmup_model_decode(
        kv_cache=kv,
        enable_trace=False,
        max_batch_size=8,
        num_blocks=WIDTH,  # 32, not the 64 physical blocks
        can_sample_on_device=True,
        non_greedy_decoding_on_device=True,
    )
    assert all(lane.warmup.captured for lane in adapter.group.lanes)
    with pytest.raises(RequestError, match=r"^num_blocks: blocks per request must be in \[1, 32\]"):
        adapter.warmup_model_decode(kv_cache=kv, num_blocks=33)


def test_break4_prefill_logits_are_what_the_host_sampler_indexes(adapter: VLLMAdapter) -> None:
    kv = _warm(adapter)
    inputs = _prefill_inputs()

    logits = adapter.prefill_forward(**inputs, kv_cache=kv, enable_trace=False)
    tokens = adapter.prefill_forward(**inputs, kv_cache=kv, sampling_params=SimpleColumns.greedy(4))

    assert isinstance(logits, torch.Tensor) and logits.shape == (4, 1, 258)
    rows = torch.arange(4)
    assert torch.equal(logits[rows, -1, :].argmax(-1), tokens)


@pytest.mark.parametrize("path", ["sync", "async", "host"])
def test_break5_every_decode_output_path_the_plugin_takes(adapter: VLLMAdapter, path: str) -> None:
    kv = _warm(adapter)
    first = adapter.prefill_forward(**_prefill_inputs(), kv_cache=kv, sampling_params=GREEDY)
    inputs = _decode_inputs([int(t) for t in first], 0)
    reference = adapter.decode_forward(**inputs, kv_cache=kv)  # logits, read from device
    assert isinstance(reference, torch.Tensor) and reference.shape == (8, 1, 258)

    read = path == "host"  # the dev branch passes read_from_device=True outputs through too
    out = adapter.decode_forward(**inputs, kv_cache=kv, read_from_device=read)
    if path == "async":
        out, events = adapter.read_decode_output(out, async_read=True)
        assert events == []
    if path != "host":
        assert isinstance(out, VLLMDecodeOutput)
    logits = adapter.process_decode_output_host(out, is_tokens=False)

    torch.testing.assert_close(logits, reference)
    assert all(lane.decode.outstanding_leases == 0 for lane in adapter.group.lanes)


def test_break6_steady_serving_arguments_are_taken(adapter: VLLMAdapter) -> None:
    kv = _warm(adapter)
    first = adapter.prefill_forward(**_prefill_inputs(), kv_cache=kv, sampling_params=GREEDY)
    inputs = _decode_inputs([int(t) for t in first], 0)
    plain = adapter.decode_forward(**inputs, kv_cache=kv, sampling_params=SimpleColumns.greedy(8))

    same = adapter.decode_forward(
        **inputs,
        kv_cache=kv,
        sampling_params=SimpleColumns.greedy(8),
        slot_remap=torch.tensor([1, 0, 2, 3, 4, 5, 7, 6], dtype=torch.int32),
        page_tables_per_layer=[inputs["page_table"]] * 2,
        rope_deltas_all_users=[0] * 8,
    )

    assert torch.equal(plain, same)
    with pytest.raises(RequestError, match=r"^row 3: slot_remap: moves slot 4 to row 3 across"):
        adapter.decode_forward(**inputs, kv_cache=kv, slot_remap=[0, 1, 2, 4, 3, 5, 6, 7])
    with pytest.raises(RequestError, match=r"^row 1: page_tables_per_layer: differs"):
        adapter.decode_forward(
            **inputs,
            kv_cache=kv,
            page_tables_per_layer=[inputs["page_table"], inputs["page_table"] + 1],
        )
    with pytest.raises(RequestError, match=r"^rope_deltas_all_users: llmrt families have no mRoPE"):
        adapter.decode_forward(
            **inputs, kv_cache=kv, rope_deltas_all_users=[0, 3, 0, 0, 0, 0, 0, 0]
        )


def test_break7_capabilities_let_the_plugin_sample_on_device_and_overlap() -> None:
    caps = VLLMAdapter.model_capabilities  # read from the class, before the model loads
    assert caps["supports_sample_on_device"] is True
    assert caps["supports_async_decode"] is True
    assert caps["supports_prefix_caching"] is True


def test_a_cached_prefix_given_as_start_pos_continues_from_the_kv(adapter: VLLMAdapter) -> None:
    kv = _warm(adapter)
    prompt = torch.tensor([PROMPTS[3][:48]], dtype=torch.int32)
    table = torch.zeros((1, WIDTH), dtype=torch.int32)
    table[0, :3] = torch.tensor([0, 1, 2])
    full = adapter.prefill_forward(tokens=prompt, page_table=table, kv_cache=kv)
    # Blocks 0 and 1 now hold the first 32 tokens' KV. A request that starts at position 32
    # reads them instead of its own (here deliberately wrong) prefix tokens.
    stale = prompt.clone()
    stale[0, :32] = 0
    cached_table = table.clone()
    cached_table[0, 2] = 7
    cached = adapter.prefill_forward(
        tokens=stale,
        page_table=cached_table,
        kv_cache=kv,
        prompt_lens=np.array([48]),
        start_pos=np.array([32], dtype=np.int32),
        empty_slots=[1],
    )
    other = torch.zeros((1, WIDTH), dtype=torch.int32)
    other[0, :3] = torch.tensor([3, 4, 5])
    uncached = adapter.prefill_forward(tokens=stale, page_table=other, kv_cache=kv)

    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(uncached, full, atol=1e-3)


# -- what is rejected, naming the field ---------------------------------------------------


BAD_KV_SPECS = [
    (KV_SHAPE, torch.float32, 3, "num_layers"),
    ((NUM_BLOCKS, 2, 16, 32), torch.float32, 2, "kv_cache_shape[3] (head_dim)"),
    ((NUM_BLOCKS, 4, 16, 16), torch.float32, 2, "kv_cache_shape[1] (kv_heads_per_device)"),
    ((NUM_BLOCKS, 2, 32, 16), torch.float32, 2, "kv_cache_shape[2] (block_size)"),
    (KV_SHAPE, torch.int32, 2, "dtype"),
    (KV_SHAPE, "int8", 2, "dtype"),
    ((4096, 2, 16, 16), torch.bfloat16, 2, "kv_cache_shape[0] (num_blocks)"),
    ((NUM_BLOCKS, 2, 16), torch.float32, 2, "kv_cache_shape"),
]


def test_a_bad_kv_spec_is_rejected_naming_the_mismatch(adapter: VLLMAdapter) -> None:
    for shape, dtype, layers, field in BAD_KV_SPECS:
        with pytest.raises(ConfigError) as info:
            adapter.allocate_kv_cache(shape, dtype, layers)

        assert info.value.field == field
        assert str(info.value).startswith(f"{field}: ")
        # Nothing was configured or allocated.
        assert all(lane.kv_cache.state is KVCacheState.UNRESOLVED for lane in adapter.group.lanes)
    handles = adapter.allocate_kv_cache(KV_SHAPE, torch.bfloat16, 2)  # the right spec goes through
    assert len(handles) == 2 and all(isinstance(h, PagedKVCacheContext) for h in handles)


def test_a_keyword_the_plugin_never_sends_is_a_type_error(adapter: VLLMAdapter) -> None:
    kv = adapter.allocate_kv_cache(KV_SHAPE, torch.bfloat16, 2)
    with pytest.raises(TypeError, match="cross_page_table"):
        adapter.prefill_forward(**_prefill_inputs(), kv_cache=kv, cross_page_table=None)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match=r"^optimizations: must be None or one of"):
        VLLMAdapter.initialize_vllm_model(HF(), None, 8, optimizations="fastest")


BAD_PREFILLS = [
    ({"prompt_lens": [10, 33, 20, 80]}, r"^row 3: prompt_lens: must be in \[1, 70\], got 80"),
    ({"empty_slots": [0, 5, 0, 6]}, r"^row 2: empty_slots: slot is already used by row 0"),
    ({"empty_slots": [0, 5, 1, 8]}, r"^row 3: empty_slots: must be a slot in \[0, 8\)"),
    ({"start_pos": [0, 5, 0, 0]}, r"^row 1: start_pos: cached prefix must be a multiple"),
    ({"page_table": torch.zeros((4, 2), dtype=torch.int32)}, r"^row 1: page_table: has 2"),
    ({"page_table": torch.full((4, 8), -1)}, r"^row 0: page_table: block id at column 0"),
    ({"prompt_lens": [10, 33]}, r"^prompt_lens: has 2 entries for 4 rows"),
    ({"tokens": torch.zeros((4, 70))}, r"^tokens: must hold integers"),
]


def test_prefill_arguments_are_validated_naming_row_and_field(adapter: VLLMAdapter) -> None:
    kv = adapter.allocate_kv_cache(KV_SHAPE, torch.bfloat16, 2)
    before = [t.clone() for t in kv[0].keys]
    for change, message in BAD_PREFILLS:
        with pytest.raises(RequestError, match=message):
            adapter.prefill_forward(
                **{**_prefill_inputs(), **change}, kv_cache=kv, sampling_params=GREEDY
            )

    assert all(torch.equal(a, b) for a, b in zip(before, kv[0].keys, strict=True))


def test_decode_rejects_a_position_past_the_page_table(adapter: VLLMAdapter) -> None:
    kv = adapter.allocate_kv_cache(KV_SHAPE, torch.bfloat16, 2)
    inputs = _decode_inputs([1, 1, 1, 1], 0)
    inputs["start_pos"][5] = 512

    with pytest.raises(RequestError, match=r"^row 5: start_pos: position needs block column 32"):
        adapter.decode_forward(**inputs, kv_cache=kv, sampling_params=GREEDY)


def test_kv_handles_must_be_the_ones_this_adapter_allocated(adapter: VLLMAdapter) -> None:
    kv = adapter.allocate_kv_cache(KV_SHAPE, torch.bfloat16, 2)
    other = _init()
    try:
        foreign = other.allocate_kv_cache(KV_SHAPE, torch.bfloat16, 2)
        with pytest.raises(RequestError, match=r"^kv_cache: has 1 handle\(s\) for 2 lane\(s\)"):
            adapter.warmup_model_decode(kv_cache=kv[0])
        with pytest.raises(KVCacheStateError, match="foreign KV cache handle"):
            adapter.warmup_model_decode(kv_cache=[kv[0], foreign[1]])
    finally:
        other.close()


def test_initialize_checks_vllm_sizes_against_the_recipe() -> None:
    with pytest.raises(ConfigError, match=r"^max_seq_len: exceeds .*max_model_len=512"):
        VLLMAdapter.initialize_vllm_model(HF(), None, 8, max_seq_len=1024, tt_data_parallel=2)
    with pytest.raises(ConfigError, match=r"^max_batch_size: must split evenly over"):
        VLLMAdapter.initialize_vllm_model(HF(), None, 7, max_seq_len=512, tt_data_parallel=2)
    with pytest.raises(ConfigError, match=r"^lanes: vLLM's value disagrees .*lanes=1"):
        _init(overrides={"lanes": 1})

    class Other(HF):
        vocab_size = 32000

    with pytest.raises(ConfigError, match=r"^hf_config.vocab_size: the recipe's model has 258"):
        VLLMAdapter.initialize_vllm_model(Other(), None, 8, max_seq_len=512, tt_data_parallel=2)


def test_an_llmrt_device_given_as_the_mesh_replaces_the_recipes_device() -> None:
    mesh = FaultyDevice(TorchDevice("cpu"), fail={})
    model = VLLMAdapter.initialize_vllm_model(
        HF(), mesh, 8, max_seq_len=512, tt_data_parallel=2, recipe="tiny-gpt2"
    )
    try:
        lanes = [lane.kv_cache.borrowed_device for lane in model.group.lanes]
        assert all(isinstance(d, FaultyDevice) and d.parent is mesh for d in lanes)
        model.allocate_kv_cache((32, 4, 16, 16), torch.bfloat16, 2)
        assert len(mesh.calls_of("allocate")) == 2 * 2 * 2  # lanes * layers * (K, V)
    finally:
        model.close()
    assert len(mesh.calls_of("deallocate")) >= 8


def test_a_steady_step_continues_the_last_on_the_device_whatever_the_host_lags(
    adapter: VLLMAdapter,
) -> None:
    """vLLM's async scheduling submits step k+1 before reading step k: the plugin's host
    tokens and positions then repeat step k's. Without ``reset_batch`` a device-sampled step
    continues the last one (its sampled tokens, its positions + 1) over both lanes."""
    kv = _warm(adapter)
    first = [
        int(t)
        for t in adapter.prefill_forward(**_prefill_inputs(), kv_cache=kv, sampling_params=GREEDY)
    ]
    greedy = SimpleColumns.greedy(8)
    fresh, last = [], first
    for step in range(STEPS):  # host inputs current every step (drained), reset once
        out = adapter.decode_forward(
            **_decode_inputs(last, step),
            kv_cache=kv,
            sampling_params=greedy,
            reset_batch=step == 0,
        )
        last = [int(out[s]) for s in SLOTS]
        fresh.append(last)

    adapter.prefill_forward(**_prefill_inputs(), kv_cache=kv, sampling_params=GREEDY)
    lagging = []
    for step in range(STEPS):  # every step sends step 0's inputs: the host never caught up
        out = adapter.decode_forward(
            **_decode_inputs(first, 0),
            kv_cache=kv,
            sampling_params=greedy,
            reset_batch=step == 0,
        )
        lagging.append([int(out[s]) for s in SLOTS])

    assert lagging == fresh
    ahead = _decode_inputs(first, 0)
    ahead["start_pos"][SLOTS[1]] += 5
    with pytest.raises(RequestError, match=r"^row 5: start_pos: is ahead of the device's"):
        adapter.decode_forward(**ahead, kv_cache=kv, sampling_params=greedy)
    gone = _decode_inputs(first, 0)
    gone["start_pos"][SLOTS[3]] = -1
    with pytest.raises(RequestError, match=r"^reset_batch: the decode batch's live slots changed"):
        adapter.decode_forward(**gone, kv_cache=kv, sampling_params=greedy)


@pytest.mark.parametrize(
    ("mesh_shape", "lanes", "heads"),
    [((1, 2), 2, 2), ((1, 2), 1, 1), ((1, 8), 2, 1), ((1, 8), 8, 2), ((4, 8), 4, 1)],
)
def test_data_parallel_meshes_take_the_plugins_per_device_kv_heads(
    mesh_shape: tuple[int, int], lanes: int, heads: int
) -> None:
    """The plugin's ``_kv_cache_shape``: 2 KV heads // min(devices per lane, 2)."""
    from llmrt.testing.fake_ttnn import FakeTtnn

    fake = FakeTtnn(system_mesh_shape=mesh_shape)
    mesh = fake.open_mesh_device(fake.MeshShape(*mesh_shape))
    with pytest.warns(RuntimeWarning, match="the vLLM mesh is not used"):
        model = _init(lanes=lanes, mesh=mesh, batch=4 * lanes)
    try:
        devices = mesh_shape[0] * mesh_shape[1] // lanes
        assert model.config.devices_per_lane == devices
        with pytest.raises(ConfigError, match=rf"over {devices} device\(s\) per lane are {heads}"):
            model.allocate_kv_cache((NUM_BLOCKS, 2 if heads == 1 else 1, 16, 16), torch.float32, 2)
        handles = model.allocate_kv_cache((NUM_BLOCKS, heads, 16, 16), torch.bfloat16, 2)
        assert len(handles) == lanes
    finally:
        model.close()
        fake.close_mesh_device(mesh)


def test_a_mesh_the_lanes_cannot_split_evenly_is_refused() -> None:
    from llmrt.testing.fake_ttnn import FakeTtnn

    fake = FakeTtnn(system_mesh_shape=(1, 8))
    mesh = fake.open_mesh_device(fake.MeshShape(1, 8))
    with (
        pytest.warns(RuntimeWarning, match="the vLLM mesh is not used"),
        pytest.raises(ConfigError, match=r"^tt_data_parallel: .*divide the vLLM mesh's 8 devices"),
    ):
        _init(lanes=3, mesh=mesh, batch=12)
    fake.close_mesh_device(mesh)


def test_a_t3k_lane_with_fewer_kv_heads_than_chips_takes_the_plugins_one_head_per_chip(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two KV heads on a T3K: the plugin's ``2 // min(8, 2)`` = 1 head per chip is what the
    decoder family's tensor-parallel lane holds (each KV head replicated on 4 chips); two
    heads per chip are refused naming the split. tests/integration/test_vllm_conformance.py
    generates through it (slow)."""
    from llmrt.testing.fake_ttnn import FakeTtnn

    monkeypatch.setenv(
        "LLMRT_VLLM_OVERRIDES",
        "device.backend=ttnn model.hidden_size=256 model.num_attention_heads=8",
    )
    fake = FakeTtnn(system_mesh_shape=(1, 8))
    monkeypatch.setitem(sys.modules, "ttnn", fake)  # what ``import ttnn`` gives the plugin
    fake.set_fabric_config(fake.FabricConfig.FABRIC_1D)
    mesh = fake.open_mesh_device(fake.MeshShape(1, 8), trace_region_size=1 << 20)
    model = _init(lanes=1, mesh=mesh, batch=4)
    try:
        assert model.config.kv_heads_per_device == 1
        with pytest.raises(ConfigError, match=r"2 KV heads over 8 device\(s\) per lane are 1"):
            model.allocate_kv_cache((NUM_BLOCKS, 2, 16, 32), torch.bfloat16, 2)
        (handle,) = model.allocate_kv_cache((NUM_BLOCKS, 1, 16, 32), torch.bfloat16, 2)
        meta = model.group.lanes[0].kv_cache.borrowed_model.attention_metadata()
        assert (meta.tensor_parallel, meta.kv_heads_per_device) == (8, 1)
        assert tuple(handle.keys[0].shape) == (NUM_BLOCKS, 1, 16, 32)  # per chip
    finally:
        model.close()
        fake.close_mesh_device(mesh)
        fake.set_fabric_config(fake.FabricConfig.DISABLED)
