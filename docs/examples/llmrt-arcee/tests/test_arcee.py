"""llmrt-arcee against transformers, with llmrt's pytest plugin (active wherever llmrt is
installed): both sides built from the same raw config.json."""

import pytest

CONFIG = {
    "model_type": "arcee",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


@pytest.mark.parametrize("options", [{}, {"hidden_act": "quick_gelu", "mlp_bias": True}])
def test_arcee_matches_transformers(parity_harness, options):
    harness = parity_harness(config={**CONFIG, **options})
    assert harness.model.config.family == "arcee"
    prompts = [harness.prompt(n, seed=n) for n in (14, 9)]
    harness.assert_parity(prompts, harness.greedy(prompts, cuts=[[5], []]))
