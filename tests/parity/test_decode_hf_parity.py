"""Decode through the whole eager lane vs Hugging Face, step by step, for 32 steps.

A tiny random GQA ``LlamaForCausalLM`` is handed to the llama family as ``state_dict`` +
``config.to_dict()``. Ragged prompts are prefilled on scattered blocks; one row joins the
batch late, so rows decode at different positions and the batch composition changes. Every
row's prefill logits and each of its 32 decode steps' logits must match HF's logits for the
same token sequence (<= 1e-4, float32), through the blocking path and through the async
lease path (``read_from_device=False`` -> ``read_decode_output(async_read=True)`` ->
``process_decode_output_host``). The lane runs on every torch device (``torch_device``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from lane_fixtures import (  # noqa: F401 (single_torch_thread: autouse)
    Lane,
    build_lane,
    make_rows,
    page_table,
    poisons_pending_reads,
    prompt,
    single_torch_thread,
)
from transformers import LlamaConfig, LlamaForCausalLM

from llmrt.families.registry import get_family
from llmrt.runtime.decode import DecodeOutput, DecodeOutputLease
from llmrt.sampling.params import SamplingParams

STEPS = 32
TOL = 1e-4
BS = 4
NUM_BLOCKS = 96
PROMPT_LENS = (5, 17, 1, 11)
JOIN_STEP = (0, 0, 0, 9)  # row 3 is prefilled after 9 decode steps of the others
VOCAB = 96


@pytest.fixture(scope="module")
def hf_model() -> Any:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # HF initialises norms to ones, which hides mistakes
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.eval()


@pytest.fixture
def lane(hf_model: Any, torch_device: str) -> Iterator[Lane]:
    """The lane on every torch device (``torch_device``); transformers stays on the CPU."""
    model = get_family("llama").build(
        hf_config=hf_model.config.to_dict(),
        tensors=hf_model.state_dict(),
        dtype=torch.float32,
        device=torch_device,
    )
    lane = build_lane(
        model=model,
        block_size=BS,
        num_blocks=NUM_BLOCKS,
        lane_capacity=4,
        torch_device=torch_device,
    )
    yield lane
    lane.cleanup()
    assert lane.live_tensors() == lane.baseline_live


def _blocking(lane: Lane, **kwargs: Any) -> DecodeOutput:
    out = lane.executor.decode_forward(**kwargs)
    assert isinstance(out, DecodeOutput)
    return out


def _leased(lane: Lane, **kwargs: Any) -> DecodeOutput:
    lease = lane.executor.decode_forward(read_from_device=False, **kwargs)
    assert isinstance(lease, DecodeOutputLease)
    host, events = lane.decode.read_decode_output(lease, async_read=True)
    assert len(events) == 1 and lane.reader.pending_count == 1
    if "logits" in host and poisons_pending_reads(lane):
        assert torch.isnan(host["logits"]).all(), "not valid before completion"
    out = lane.decode.process_decode_output_host(host)
    assert lane.decode.outstanding_leases == 0 and lane.reader.pending_count == 0
    return out


Reader = Callable[..., DecodeOutput]


def _generate(lane: Lane, *, reader: Reader, greedy_params: bool) -> tuple[list[Any], list[Any]]:
    """Greedy generation: per row, logits before each token ``[33, V]`` and the 33 tokens."""
    order = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(5)).tolist()
    prompts = [prompt(n, seed=40 + n, vocab_size=VOCAB) for n in PROMPT_LENS]
    blocks = []
    for n in PROMPT_LENS:
        need = -(-(n + STEPS + 1) // BS)
        blocks.append(order[:need])
        order = order[need:]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]

    def prefill(rows: list[int]) -> None:
        out = lane.executor.prefill_forward(
            rows=make_rows([prompts[r] for r in rows], [blocks[r] for r in rows])
        )
        assert out.logits is not None
        for i, r in enumerate(rows):
            logits[r].append(out.logits[i])
            tokens[r].append(int(out.logits[i].argmax()))

    step = 0
    while any(len(t) <= STEPS for t in tokens):
        joining = [r for r, s in enumerate(JOIN_STEP) if s == step]
        if joining:
            prefill(joining)
        active = [r for r in range(len(prompts)) if tokens[r] and len(tokens[r]) <= STEPS]
        positions = [PROMPT_LENS[r] + len(tokens[r]) - 1 for r in active]
        assert len(set(positions)) == len(positions)  # ragged: every row at its own position
        out = reader(
            lane,
            tokens=[tokens[r][-1] for r in active],
            start_pos=positions,
            page_table=page_table([blocks[r] for r in active], width=16),
            sampling_params=[SamplingParams(temperature=0)] * len(active)
            if greedy_params
            else None,
        )
        if greedy_params:
            assert out.logits is None and out.tokens is not None
            for i, r in enumerate(active):
                tokens[r].append(int(out.tokens[i]))
        else:
            assert out.logits is not None and out.tokens is None
            assert torch.isfinite(out.logits).all()
            for i, r in enumerate(active):
                logits[r].append(out.logits[i])
                tokens[r].append(int(out.logits[i].argmax()))
        step += 1
    return prompts, [
        (torch.stack(x) if len(x) > 1 else None, t) for x, t in zip(logits, tokens, strict=True)
    ]


def _hf_logits(hf_model: Any, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """HF logits predicting each generated token (teacher forcing, one forward): ``[33, V]``."""
    ids = torch.tensor([prompt_ids + generated[:-1]])
    with torch.no_grad():
        out = hf_model(input_ids=ids, use_cache=False).logits[0].float()
    return out[len(prompt_ids) - 1 :]


@pytest.mark.parametrize("reader", [_blocking, _leased], ids=["blocking", "async_lease"])
def test_decode_logits_match_hf_for_32_steps_with_ragged_positions(
    lane: Lane, hf_model: Any, reader: Reader
) -> None:
    prompts, runs = _generate(lane, reader=reader, greedy_params=False)
    for r, (prompt_ids, (logits, tokens)) in enumerate(zip(prompts, runs, strict=True)):
        assert len(tokens) == STEPS + 1 and logits.shape == (STEPS + 1, VOCAB)
        want = _hf_logits(hf_model, prompt_ids, tokens)
        first = (logits[0] - want[0]).abs().max().item()
        assert first <= TOL, f"row {r}: prefill logits differ by {first:.3g}"
        per_step = (logits[1:] - want[1:]).abs().amax(dim=-1)
        worst = int(per_step.argmax())
        assert per_step.max() <= TOL, (
            f"row {r}: decode step {worst + 1} logits differ by {per_step.max().item():.3g}"
        )
        assert tokens == want.argmax(dim=-1).tolist(), f"row {r}: greedy tokens diverge from HF"


def test_async_tokens_equal_blocking_tokens(lane: Lane) -> None:
    saved = lane.snapshot()
    _, blocking = _generate(lane, reader=_blocking, greedy_params=True)
    lane.restore(saved)
    _, leased = _generate(lane, reader=_leased, greedy_params=True)
    assert [t for _, t in blocking] == [t for _, t in leased]
    lane.restore(saved)
    _, from_logits = _generate(lane, reader=_blocking, greedy_params=False)
    assert [t for _, t in blocking] == [t for _, t in from_logits]
