"""bf16 end to end on SmolLM2-135M: llmrt in bfloat16 against llmrt in float32 and against
transformers in bfloat16, on the same GGUF weights.

A short prompt, one prefill and a few greedy decode steps through ``LLM`` in each
configuration. Relative L2 error of the last-position logits, measured on this machine:

| prompt | llmrt bf16 vs f32 | transformers bf16 vs f32 | llmrt bf16 vs transformers bf16 |
| --- | --- | --- | --- |
| "The capital of France is" (5 tokens, EPYC) | 0.058 | 0.048 | 0.017 |
| a 34-token chat prompt | 0.005 | 0.005 | 0.006 |

Greedy tokens were identical in all three. bf16 rounding alone moves the logits by up to ~6%
of their norm on a short prompt, so the float32 bound is relative to what transformers' own
bf16 shows; against transformers in bf16 (the same arithmetic, in another order) the bound is
absolute, or transformers' own bf16 error where that is larger: on a 2-core Emerald Rapids
the short prompt measured llmrt bf16 vs f32 0.017, transformers bf16 vs f32 0.071 and llmrt
vs transformers bf16 0.063 (two bf16 computations differ by as much as one differs from
float32; the table's numbers are from a 2-core EPYC). A wrong kernel (a missing norm, a
transposed or mis-strided weight, RoPE on the wrong half) moves logits by tens of percent:
the LM head's rows shifted by one gives 1.21.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import attrs
import pytest
import torch
from conftest import NEEDS_SMOLLM2

from llmrt.benchmarks.hf import cache_argument
from llmrt.runtime.prefill.plan import PrefillRow
from llmrt.sampling.params import SamplingParams
from llmrt.serving.llm import LLM
from llmrt.weights.checkpoint import Checkpoint

pytestmark = NEEDS_SMOLLM2
transformers = pytest.importorskip("transformers")

STEPS = 3
PROMPT = "The capital of France is"
#: Small cache, one warmed 32-token wave, no traces: a few seconds per configuration.
OVERRIDES = {
    "kv_cache.num_blocks": 16,
    "decode.lane_capacity": 1,
    "prefill.max_chunk_size": 32,
    "warmup.prefill_seq_lens": [32],
    "warmup.prefill_batch_sizes": [1],
    "trace.mode": "none",
}
#: llmrt bf16 vs transformers bf16 (measured 0.006-0.017 on the EPYC, 0.063 where
#: transformers' own bf16 error is 0.071; the bound is the larger of this and that error).
MAX_ERROR_VS_TRANSFORMERS_BF16 = 0.04
#: llmrt bf16's error vs float32 may exceed transformers' bf16 error vs float32 by this factor.
MAX_ERROR_FACTOR_VS_FLOAT32 = 1.5


@attrs.frozen
class Run:
    """Last-position prefill logits (float32, cpu) and greedy tokens of one configuration."""

    logits: torch.Tensor
    tokens: tuple[int, ...]


def llmrt_run(dtype: str, prompt: Sequence[int] | None = None) -> tuple[Run, Checkpoint, Any]:
    overrides = {
        **OVERRIDES,
        "checkpoint.dtype": dtype,
        "checkpoint.weights": dtype,
        "kv_cache.dtype": dtype,
    }
    # The float reference recipe: the default one keeps the GGUF's quantized blocks.
    with LLM.from_recipe("smollm2-135m-f32", overrides=overrides) as llm:
        ids = list(prompt) if prompt is not None else list(llm.tokenizer.encode(PROMPT))
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


def _no_init_weights() -> contextlib.AbstractContextManager[Any]:
    """transformers' ``no_init_weights`` (its module moved in 5.x), or nothing."""
    for module in ("transformers.initialization", "transformers.modeling_utils"):
        if importlib.util.find_spec(module) is not None:
            no_init = getattr(importlib.import_module(module), "no_init_weights", None)
            if no_init is not None:
                return cast(contextlib.AbstractContextManager[Any], no_init())
    return contextlib.nullcontext()


def transformers_run(checkpoint: Checkpoint, ids: Sequence[int]) -> Run:
    """transformers' Llama in bfloat16 on llmrt's own (dequantized) tensors."""
    config = transformers.LlamaConfig(**dict(checkpoint.hf_config))
    with _no_init_weights():  # skip the random init: every weight comes from the checkpoint
        model = transformers.LlamaForCausalLM(config).eval()
    missing = model.load_state_dict(dict(checkpoint.tensors), strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}, missing
    if missing:
        model.tie_weights()
    model = model.to(torch.bfloat16)
    tokens: list[int] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(ids)]), use_cache=True)
        first = out.logits[0, -1].float()
        logits = first
        for _ in range(STEPS):
            tokens.append(int(logits.argmax()))
            name = cache_argument(model)  # "cache" in transformers 5, on input and output
            cache = {name: out[name]}
            out = model(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True, **cache)
            logits = out.logits[0, -1].float()
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
    ours = relative_error(runs["bf16"].logits, runs["f32"].logits)
    rounding = relative_error(runs["hf_bf16"].logits, runs["f32"].logits)
    assert ours <= MAX_ERROR_FACTOR_VS_FLOAT32 * rounding + 0.005, (
        f"llmrt bf16 vs float32 {ours:.4f}; transformers bf16 vs float32 {rounding:.4f}"
    )
    assert int(runs["bf16"].logits.argmax()) == int(runs["f32"].logits.argmax())


def test_bf16_greedy_tokens_agree_with_float32(runs: Mapping[str, Run]) -> None:
    assert runs["bf16"].tokens == runs["f32"].tokens


def test_bf16_matches_transformers_in_bf16(runs: Mapping[str, Run]) -> None:
    error = relative_error(runs["bf16"].logits, runs["hf_bf16"].logits)
    rounding = relative_error(runs["hf_bf16"].logits, runs["f32"].logits)
    bound = max(MAX_ERROR_VS_TRANSFORMERS_BF16, rounding)
    assert error < bound, (
        f"llmrt vs transformers bf16 {error:.4f}; transformers bf16 vs float32 {rounding:.4f}"
    )
    assert runs["bf16"].tokens == runs["hf_bf16"].tokens


def test_the_bounds_catch_a_wrong_kernel(runs: Mapping[str, Run]) -> None:
    """The tolerances are tight enough: logits from a broken kernel (the LM head's rows
    shifted, as a transposed or mis-strided weight would) lie far outside both."""
    broken = runs["bf16"].logits.roll(1)
    rounding = relative_error(runs["hf_bf16"].logits, runs["f32"].logits)
    assert relative_error(broken, runs["hf_bf16"].logits) > 4 * max(
        MAX_ERROR_VS_TRANSFORMERS_BF16, rounding
    )
    assert relative_error(broken, runs["f32"].logits) > 4 * (
        MAX_ERROR_FACTOR_VS_FLOAT32 * rounding + 0.005
    )
