"""Mixture-of-experts directories as transformers saves them (one tensor per expert:
Mixtral's ``block_sparse_moe.experts.N.w1``, Qwen3-MoE's ``mlp.experts.N.gate_proj``)
load by ``family: auto`` and match transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from llmrt.families.registry import family_for_model_type
from llmrt.testing.parity import Harness, perturb
from llmrt.weights.checkpoint import load_checkpoint

COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
CASES = {
    "mixtral": {"num_local_experts": 3, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 3, "num_experts_per_tok": 2, "moe_intermediate_size": 24},
}


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_per_expert_directory_loads_and_matches(model_type: str, tmp_path: Path) -> None:
    config = transformers.AutoConfig.for_model(model_type, **COMMON, **CASES[model_type])
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf_model = perturb(transformers.AutoModelForCausalLM.from_config(config), seed=1)
    hf_model.save_pretrained(tmp_path)
    family = family_for_model_type(model_type)
    checkpoint = load_checkpoint(
        format="safetensors",
        path=tmp_path,
        expected_tensors=family.expected_tensors,
        optional_tensors=family.optional_tensors,
        model_types=family.model_types,
        rename=getattr(family, "rename_tensors", None) or getattr(family, "rename", None),
    )
    assert any(".experts.0." in name for name in _saved_names(tmp_path))  # per expert on disk
    model = family.build(
        hf_config=checkpoint.hf_config, tensors=checkpoint.tensors, dtype=torch.float32,
        device="cpu",
    )  # fmt: skip
    harness = Harness(hf_model=hf_model, model=model, vocab_size=128, seed=0)
    prompts = [harness.prompt(11, seed=1), harness.prompt(6, seed=2)]
    harness.assert_parity(prompts, harness.greedy(prompts, cuts=[[4], []], steps=8))


def _saved_names(directory: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), "pt") as fh:
            names.extend(fh.keys())
    return names
