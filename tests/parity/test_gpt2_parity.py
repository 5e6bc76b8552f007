"""llmrt's GPT-2 family vs transformers on paged KV."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from llmrt.families.gpt2 import FAMILY

COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 128,
    "initializer_range": 0.1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "attn_implementation": "eager",
}


def _randomise(model: torch.nn.Module, *, seed: int) -> torch.nn.Module:
    """Perturb LayerNorms and biases (HF initialises them to ones/zeros)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.eval()


CASES: dict[str, Callable[[], torch.nn.Module]] = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(**COMMON)),
    "gpt2-untied-exact-gelu": lambda: GPT2LMHeadModel(
        GPT2Config(**COMMON, tie_word_embeddings=False, activation_function="gelu", n_inner=96)
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


def test_bare_gpt2model_tensor_names_are_accepted(harness: Any) -> None:
    hf_model = harness.hf_model
    bare = {
        name.removeprefix("transformer."): t
        for name, t in hf_model.state_dict().items()
        if name != "lm_head.weight" or not hf_model.config.tie_word_embeddings
    }
    assert "h.0.attn.c_attn.weight" in bare
    model = FAMILY.build(
        hf_config=hf_model.config.to_dict(), tensors=bare, dtype=torch.float32, device="cpu"
    )
    reference = harness.model.backbone.h[0].c_attn.weight
    assert torch.equal(model.backbone.h[0].c_attn.weight, reference)
