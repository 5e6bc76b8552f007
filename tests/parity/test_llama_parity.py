"""llmrt's Llama family vs transformers (Llama / Llama-3 RoPE / Qwen2 / Mistral) on paged KV."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from llmrt.families.llama import FAMILY

COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.1,
    "attn_implementation": "eager",
}


def _randomise(model: torch.nn.Module, *, seed: int) -> torch.nn.Module:
    """Perturb norms and biases (HF initialises them to ones/zeros, which hides mistakes)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.eval()


CASES: dict[str, Callable[[], torch.nn.Module]] = {
    "llama-gqa": lambda: LlamaForCausalLM(
        LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2)
    ),
    "llama3-rope-tied-mqa": lambda: LlamaForCausalLM(
        LlamaConfig(
            **COMMON,
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    ),
    "llama-linear-rope-biases": lambda: LlamaForCausalLM(
        LlamaConfig(
            **COMMON,
            num_attention_heads=2,
            num_key_value_heads=2,
            attention_bias=True,
            mlp_bias=True,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        )
    ),
    "qwen2-bias": lambda: Qwen2ForCausalLM(
        Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2)
    ),
    "mistral-head-dim": lambda: MistralForCausalLM(
        MistralConfig(
            **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=24, sliding_window=None
        )
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def harness(request: pytest.FixtureRequest, make_harness: Any) -> Any:
    torch.manual_seed(0)
    hf_model = _randomise(CASES[request.param](), seed=1)
    return make_harness(family=FAMILY, hf_model=hf_model)


def test_single_prompt(harness: Any) -> None:
    harness.check_single_prompt()


def test_ragged_batch_with_padding_row_and_ragged_decode_positions(harness: Any) -> None:
    harness.check_ragged_batch()


def test_chunked_prefill(harness: Any) -> None:
    harness.check_chunked_prefill()


def test_cached_prefix_continuation_next_to_fresh_row(
    harness: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness.check_cached_prefix(monkeypatch)


def test_shared_prefix_blocks(harness: Any) -> None:
    harness.check_shared_prefix_blocks()


def test_padding_writes_nothing_outside_owned_slots(harness: Any) -> None:
    harness.check_padding_writes_nothing()


def test_capture_safe_path_without_host_syncs(
    harness: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness.check_capture_safe(monkeypatch)


def test_hf_tensor_names_are_exactly_expected(harness: Any) -> None:
    hf_model = harness.hf_model
    config = hf_model.config.to_dict()
    expected = FAMILY.expected_tensors(config)
    optional = FAMILY.optional_tensors(config)
    state = {name: tuple(t.shape) for name, t in hf_model.state_dict().items()}
    assert {n: s for n, s in expected.items() if n not in optional} == {
        n: s for n, s in state.items() if n not in optional
    }
