"""The CUDA path: per-device generators, and a decode/prefill lane on every torch device.

Without a GPU the placement test still runs: runtimes built for a ``cuda:0`` lane must ask
for their generator on ``cuda:0`` (torch rejects a CPU generator for a CUDA tensor, so the
old CPU decode generator failed every unseeded sampled step there). The lane tests run over
the plugin's ``torch_device``: ``cpu`` here, and ``cuda:0`` where one exists
(``scripts/gpu_check.sh``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch
from lane_fixtures import (  # noqa: F401 (single_torch_thread: autouse)
    Lane,
    build_lane,
    make_rows,
    page_table,
    prompt,
    single_torch_thread,
)
from llmrt.containers.factories import build_decode

import llmrt.runtime.decode
import llmrt.runtime.prefill.runtime
from llmrt.errors import DeviceError
from llmrt.recipe.loader import load_recipe
from llmrt.runtime.config import PageTableLayout
from llmrt.runtime.decode import DecodeOutput, DecodeRuntime
from llmrt.runtime.output_reader import OutputReader
from llmrt.runtime.prefill.runtime import PrefillRuntime
from llmrt.sampling.params import SamplingParams
from llmrt.sampling.sampler import SamplingTensors, device_generator, sample

BS = 4
LENS = (9, 5)
BLOCKS = ((3, 17, 5, 30, 31), (8, 1, 22, 40))


class _PlacedOn:
    """A torch generator stand-in recording the device it was asked for."""

    def __init__(self, device: Any = None) -> None:
        self.device = torch.device(device if device is not None else "cpu")

    def manual_seed(self, seed: int) -> _PlacedOn:
        return self


@attrs.define
class _CudaView:
    """A lane device that reports ``cuda:0`` (construction only: nothing runs on it)."""

    inner: Any

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_runtimes_draw_unseeded_noise_from_a_generator_on_their_lane_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lane = build_lane(block_size=BS, num_blocks=16, lane_capacity=2)
    try:
        assert lane.decode.generator.device == torch.device("cpu")
        assert lane.prefill.generator.device == torch.device("cpu")
        monkeypatch.setattr(torch, "Generator", _PlacedOn)
        cuda = _CudaView(lane.device)
        decode = DecodeRuntime(attrs.evolve(lane.decode.config, device=cuda))
        prefill = PrefillRuntime(attrs.evolve(lane.prefill.config, device=cuda))
        assert decode.generator.device == torch.device("cuda", 0)
        assert prefill.generator.device == torch.device("cuda", 0)
        assert device_generator("cuda:1").device == torch.device("cuda", 1)
    finally:
        monkeypatch.undo()
        lane.cleanup()


@pytest.mark.parametrize("mode", ["decode_only", "all", "none"])
def test_the_container_gives_cuda_decode_a_width_ladder(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """``build_decode`` (the container's factory) pads CUDA steps, traced or eager, to a
    width ladder (they attend over their whole table: trimming it would read the positions
    back on the host): 256 tokens of 16-token blocks first, doubled up to the layout's 128.
    The CPU keeps the layout's width (its step trims the table to the blocks in use)."""
    lane = build_lane(block_size=BS, num_blocks=16, lane_capacity=2)
    # 2048 positions in 16-token blocks (the lane's own layout is too narrow for a ladder).
    layout = PageTableLayout.resolve(
        block_size=16,
        model_max_sequence_length=2048,
        physical_num_blocks=128,
        max_prefill_chunk_size=64,
    )
    try:
        recipe = load_recipe("tiny-llama", overrides=[f"trace.mode={mode}"])
        monkeypatch.setattr(torch, "Generator", _PlacedOn)
        widths = {}
        for name, device in (("cuda", _CudaView(lane.device)), ("cpu", lane.device)):
            decode = build_decode(
                recipe=recipe,
                model=lane.model,
                device=device,
                reader=OutputReader(device=device),
                layout=layout,
                lane=0,
            )
            widths[name] = decode.config.widths
        assert layout.width == 128
        assert widths == {"cuda": (16, 32, 64, 128), "cpu": (128,)}
    finally:
        monkeypatch.undo()
        lane.cleanup()


def test_sampling_refuses_a_generator_on_another_device() -> None:
    params = [SamplingParams(temperature=1.0)]
    tensors = SamplingTensors.from_params(params, batch_size=1, vocab_size=8, device="cpu")
    elsewhere: Any = _PlacedOn("cuda:0")
    with pytest.raises(DeviceError, match=r"generator is on cuda:0 but the noise is drawn on cpu"):
        sample(torch.zeros(1, 8), tensors, generator=elsewhere)
    result = sample(torch.zeros(1, 8), tensors, generator=device_generator("cpu", seed=3))
    assert 0 <= int(result.tokens[0]) < 8


def test_sampled_steps_refuse_a_generator_off_the_lane_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The failure the old decode runtime hit on CUDA (its generator on another device than
    the logits), reproduced on the CPU: both runtimes get a generator "on cuda:0" for a cpu
    lane. Every sampled step (unseeded or seeded) through the lane is refused with both
    devices named, before any noise is drawn; greedy steps never touch the generator."""

    def misplaced(device: Any, *, seed: int = 0) -> Any:
        return _PlacedOn("cuda:0")

    monkeypatch.setattr(llmrt.runtime.decode, "device_generator", misplaced)
    monkeypatch.setattr(llmrt.runtime.prefill.runtime, "device_generator", misplaced)
    lane = build_lane(block_size=BS, num_blocks=48, max_chunk=16, lane_capacity=4)
    try:
        match = r"generator is on cuda:0 but the noise is drawn on cpu"
        unseeded, seeded = SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, seed=4)
        for params in ([unseeded], [seeded]):
            rows = make_rows([prompt(LENS[0], seed=1)], BLOCKS[:1])
            with pytest.raises(DeviceError, match=match):
                lane.executor.prefill_forward(rows=rows, sampling_params=params)
            with pytest.raises(DeviceError, match=match):
                lane.executor.decode_forward(
                    tokens=torch.tensor([3]),
                    start_pos=torch.tensor([LENS[0]], dtype=torch.int32),
                    page_table=page_table(BLOCKS[:1], width=8),
                    sampling_params=params,
                    step_offsets=[1],
                )
        greedy = lane.executor.decode_forward(
            tokens=torch.tensor([3]),
            start_pos=torch.tensor([LENS[0]], dtype=torch.int32),
            page_table=page_table(BLOCKS[:1], width=8),
            sampling_params=[SamplingParams(temperature=0.0)],
        )
        assert isinstance(greedy, DecodeOutput) and greedy.tokens is not None
    finally:
        lane.cleanup()


@pytest.fixture
def lane(torch_device: str) -> Iterator[Lane]:
    lane = build_lane(
        torch_device=torch_device,
        block_size=BS,
        num_blocks=48,
        max_chunk=16,
        lane_capacity=4,
    )
    yield lane
    lane.cleanup()


def _decode_steps(lane: Lane, params: list[SamplingParams], steps: int) -> list[list[int]]:
    rows = make_rows([prompt(n, seed=n) for n in LENS], BLOCKS)
    first = lane.executor.prefill_forward(rows=rows, sampling_params=params)
    assert first.tokens is not None
    tokens = first.tokens.to("cpu")
    out = [[int(t)] for t in tokens]
    positions = torch.tensor(LENS, dtype=torch.int32)
    for step in range(steps):
        decoded = lane.executor.decode_forward(
            tokens=tokens,
            start_pos=positions,
            page_table=page_table(BLOCKS, width=8),
            sampling_params=params,
            step_offsets=[step + 1] * len(params),
        )
        assert isinstance(decoded, DecodeOutput) and decoded.tokens is not None
        tokens = decoded.tokens.to("cpu")
        for row, token in enumerate(tokens):
            out[row].append(int(token))
        positions = positions + 1
    return out


def test_greedy_decode_matches_a_prefill_of_the_whole_history_on_the_same_device(
    lane: Lane,
) -> None:
    """Each decoded token is the argmax of the logits a fresh prefill of the row's history
    gives (a wrong KV write, position or page table on the device changes one of them)."""
    greedy = [SamplingParams(temperature=0.0)] * len(LENS)
    tokens = _decode_steps(lane, greedy, steps=3)
    histories = [prompt(n, seed=n) + row[:-1] for n, row in zip(LENS, tokens, strict=True)]
    fresh = ((32, 33, 34, 35), (36, 37, 38, 39))
    out = lane.executor.prefill_forward(rows=make_rows(histories, fresh))
    assert out.logits is not None
    assert out.logits.device.type == "cpu"  # outputs are read back to the host
    assert out.logits.argmax(dim=-1).tolist() == [row[-1] for row in tokens]


def test_seeded_sampled_decode_on_the_lane_device_is_reproducible(lane: Lane) -> None:
    params = [
        SamplingParams(temperature=0.9, seed=11),
        SamplingParams(temperature=1.1, top_k=20, seed=12),
    ]
    saved = lane.snapshot()
    first = _decode_steps(lane, params, steps=4)
    lane.restore(saved)
    assert _decode_steps(lane, params, steps=4) == first


def test_unseeded_sampled_decode_draws_on_the_lane_device(lane: Lane) -> None:
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)]
    tokens = _decode_steps(lane, params, steps=3)
    vocab = lane.model.config.vocab_size
    assert all(0 <= t < vocab for row in tokens for t in row)
    assert lane.decode.generator.device.type == torch.device(lane.device.torch_device).type


def test_llama_family_on_the_device_matches_transformers(torch_device: str) -> None:
    """Family parity on the lane's device: the prefill logits and greedy decode tokens of a
    Llama built on ``device`` equal transformers' (float32, on the CPU) on the same weights."""
    transformers = pytest.importorskip("transformers")
    from llmrt.families.registry import get_family

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    model = get_family("llama").build(
        hf_config=hf.config.to_dict(),
        tensors=hf.state_dict(),
        dtype=torch.float32,
        device=torch_device,
    )
    lane = build_lane(model=model, torch_device=torch_device, block_size=BS, num_blocks=16)
    try:
        ids = prompt(11, seed=5)
        out = lane.executor.prefill_forward(rows=make_rows([ids], [(0, 1, 2, 3)]))
        assert out.logits is not None
        with torch.no_grad():
            expected = hf(input_ids=torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(out.logits[0], expected, atol=1e-4, rtol=1e-4)
    finally:
        lane.cleanup()
