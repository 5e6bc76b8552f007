"""llmrt's GPT-2 family vs transformers on paged KV."""

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
    return perturb(model, seed=seed, is_norm=lambda name: ".ln_" in name)


def _case(model_cls: Any, config_cls: Any, **kwargs: Any) -> Callable[[], tuple[Any, dict]]:
    """A case: the transformers model, and the raw config.json it was made from (what the
    llmrt side reads, as the runtime would)."""

    def make() -> tuple[Any, dict[str, Any]]:
        raw = {k: v for k, v in kwargs.items() if k != "attn_implementation"}
        return model_cls(config_cls(**kwargs)), {"model_type": config_cls.model_type, **raw}

    return make


CASES: dict[str, Callable[[], tuple[Any, dict[str, Any]]]] = {
    "gpt2": _case(GPT2LMHeadModel, GPT2Config, **COMMON),
    "gpt2-untied-exact-gelu": _case(
        GPT2LMHeadModel,
        GPT2Config,
        **COMMON,
        tie_word_embeddings=False,
        activation_function="gelu",
        n_inner=96,
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def harness(request: pytest.FixtureRequest, parity_harness: Any, torch_device: str) -> Any:
    torch.manual_seed(0)
    model, raw = CASES[request.param]()
    hf_model = _randomise(model, seed=1)
    return parity_harness(family=FAMILY, hf_model=hf_model, hf_config=raw, device=torch_device)


def test_bare_gpt2model_tensor_names_are_accepted(harness: Any) -> None:
    hf_model = harness.hf_model
    bare = {
        name.removeprefix("transformer."): t
        for name, t in hf_model.state_dict().items()
        if name != "lm_head.weight" or not hf_model.config.tie_word_embeddings
    }
    assert "h.0.attn.c_attn.weight" in bare
    model = FAMILY.build(
        hf_config=hf_model.config.to_dict(),
        tensors=bare,
        dtype=torch.float32,
        device=str(harness.device),
    )
    reference = harness.model.backbone.layers[0].attention.qkv.weight
    assert torch.equal(model.backbone.layers[0].attention.qkv.weight, reference)
