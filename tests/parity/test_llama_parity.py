"""llmrt's Llama, Qwen2 and Mistral families vs transformers (Llama / Llama-3 RoPE / Qwen2 /
Mistral) on paged KV."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from family_checks import (  # noqa: F401 (shared parity tests, run here over CASES)
    perturb,
    test_cached_prefix_continuation_next_to_fresh_row,
    test_capture_safe_path_without_host_syncs,
    test_chunked_prefill,
    test_padding_writes_nothing_outside_owned_slots,
    test_ragged_batch_with_padding_row_and_ragged_decode_positions,
    test_shared_prefix_blocks,
    test_single_prompt,
)
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from llmrt.families.registry import family_for_model_type

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
    return perturb(model, seed=seed, is_norm=lambda name: "norm" in name)


def _case(model_cls: Any, config_cls: Any, **kwargs: Any) -> Callable[[], tuple[Any, dict]]:
    """A case: the transformers model, and the raw config.json it was made from (what the
    llmrt side reads, as the runtime would)."""

    def make() -> tuple[Any, dict[str, Any]]:
        raw = {k: v for k, v in kwargs.items() if k != "attn_implementation"}
        return model_cls(config_cls(**kwargs)), {"model_type": config_cls.model_type, **raw}

    return make


CASES: dict[str, Callable[[], tuple[Any, dict[str, Any]]]] = {
    "llama-gqa": _case(
        LlamaForCausalLM, LlamaConfig, **COMMON, num_attention_heads=4, num_key_value_heads=2
    ),
    "llama3-rope-tied-mqa": _case(
        LlamaForCausalLM,
        LlamaConfig,
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
    ),
    "llama-linear-rope-biases": _case(
        LlamaForCausalLM,
        LlamaConfig,
        **COMMON,
        num_attention_heads=2,
        num_key_value_heads=2,
        attention_bias=True,
        mlp_bias=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    "qwen2-bias": _case(
        Qwen2ForCausalLM, Qwen2Config, **COMMON, num_attention_heads=4, num_key_value_heads=2
    ),
    "mistral-head-dim": _case(
        MistralForCausalLM,
        MistralConfig,
        **COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        sliding_window=None,
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def harness(request: pytest.FixtureRequest, parity_harness: Any, torch_device: str) -> Any:
    torch.manual_seed(0)
    model, raw = CASES[request.param]()
    hf_model = _randomise(model, seed=1)
    family = family_for_model_type(raw["model_type"])  # llama, qwen2, mistral
    return parity_harness(family=family, hf_model=hf_model, hf_config=raw, device=torch_device)


def test_hf_tensor_names_are_exactly_expected(harness: Any) -> None:
    hf_model = harness.hf_model
    config = hf_model.config.to_dict()
    family = family_for_model_type(config["model_type"])
    expected = family.expected_tensors(config)
    optional = family.optional_tensors(config)
    state = {name: tuple(t.shape) for name, t in hf_model.state_dict().items()}
    assert {n: s for n, s in expected.items() if n not in optional} == {
        n: s for n, s in state.items() if n not in optional
    }
