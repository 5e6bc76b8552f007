"""Seeded random checkpoints."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from llmrt.errors import CheckpointError, ConfigError
from llmrt.weights import BYTE_VOCAB_SIZE, Checkpoint, load_checkpoint

LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}


def llama_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """A stand-in for the llama family's expected_tensors."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (hidden, hidden),
            f"{p}.self_attn.k_proj.weight": (kv, hidden),
            f"{p}.self_attn.k_proj.bias": (kv,),
            f"{p}.self_attn.v_proj.weight": (kv, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, hidden),
            f"{p}.mlp.up_proj.weight": (config["intermediate_size"], hidden),
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
        }
    return shapes


def tied(config: dict[str, Any]) -> list[str]:
    return ["lm_head.weight"] if config["tie_word_embeddings"] else []


def random_llama(seed: int = 0, **overrides: Any) -> Checkpoint:
    return load_checkpoint(
        format="random",
        model={**LLAMA, **overrides},
        seed=seed,
        expected_tensors=llama_shapes,
        optional_tensors=tied,
    )


def test_shapes_config_and_tokenizer() -> None:
    checkpoint = random_llama()
    config = checkpoint.hf_config
    assert config["vocab_size"] == BYTE_VOCAB_SIZE
    assert (config["bos_token_id"], config["eos_token_id"]) == (256, 257)
    expected = llama_shapes(config)
    del expected["lm_head.weight"]  # optional (tied): not invented
    assert {k: tuple(v.shape) for k, v in checkpoint.tensors.items()} == expected
    assert all(t.dtype == torch.float32 for t in checkpoint.tensors.values())
    assert checkpoint.tokenizer is not None and checkpoint.tokenizer.vocab_size == BYTE_VOCAB_SIZE
    assert "seed=0" in checkpoint.source


def test_initialisation_by_kind() -> None:
    tensors = random_llama().tensors
    assert torch.equal(tensors["model.norm.weight"], torch.ones(32))
    assert torch.equal(tensors["model.layers.0.input_layernorm.weight"], torch.ones(32))
    assert torch.equal(tensors["model.layers.1.self_attn.k_proj.bias"], torch.zeros(16))
    embed = tensors["model.embed_tokens.weight"]
    assert abs(embed.mean().item()) < 0.005
    assert embed.std().item() == pytest.approx(0.02, rel=0.1)


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    a, b, c = random_llama(seed=3), random_llama(seed=3), random_llama(seed=4)
    name = "model.layers.1.mlp.up_proj.weight"
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    assert not torch.equal(a.tensors[name], c.tensors[name])


def test_larger_vocab_is_allowed_smaller_is_not() -> None:
    assert random_llama(vocab_size=300).tensors["model.embed_tokens.weight"].shape == (300, 32)
    with pytest.raises(CheckpointError, match=r"model\.vocab_size"):
        random_llama(vocab_size=100)


def test_config_errors() -> None:
    with pytest.raises(CheckpointError, match=r"model\.model_type"):
        load_checkpoint(format="random", model={"hidden_size": 8}, expected_tensors=llama_shapes)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(
            format="random",
            model={"model_type": "llama", "hidden_size": 8},
            expected_tensors=llama_shapes,
        )
    assert info.value.item == "config.num_attention_heads"
    with pytest.raises(CheckpointError, match="unknown model_type 'llama'"):
        load_checkpoint(
            format="random", model=LLAMA, expected_tensors=llama_shapes, model_types=("gpt2",)
        )
    with pytest.raises(ConfigError, match=r"checkpoint\.model"):
        load_checkpoint(format="random", expected_tensors=llama_shapes)
    with pytest.raises(ConfigError, match=r"checkpoint\.expected_tensors"):
        load_checkpoint(format="random", model=LLAMA)
    with pytest.raises(ConfigError, match=r"checkpoint\.path"):
        load_checkpoint(format="random", model=LLAMA, expected_tensors=llama_shapes, path="x")
    with pytest.raises(ConfigError, match=r"checkpoint\.format"):
        load_checkpoint(format="pickle", model=LLAMA)  # type: ignore[arg-type]


def test_gpt2_norm_names_get_ones() -> None:
    def shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        n = config["n_embd"]
        return {
            "transformer.wte.weight": (config["vocab_size"], n),
            "transformer.h.0.ln_1.weight": (n,),
            "transformer.h.0.ln_1.bias": (n,),
            "transformer.h.0.ln_2.weight": (n,),
            "transformer.ln_f.weight": (n,),
            "transformer.h.0.attn.c_attn.weight": (n, 3 * n),
        }

    checkpoint = load_checkpoint(
        format="random", model={"model_type": "gpt2", "n_embd": 8}, expected_tensors=shapes
    )
    t = checkpoint.tensors
    for name in ("ln_1.weight", "ln_2.weight"):
        assert torch.equal(t[f"transformer.h.0.{name}"], torch.ones(8))
    assert torch.equal(t["transformer.ln_f.weight"], torch.ones(8))
    assert torch.equal(t["transformer.h.0.ln_1.bias"], torch.zeros(8))
    assert t["transformer.h.0.attn.c_attn.weight"].std().item() > 0.01


def test_checkpoint_validates_its_fields() -> None:
    with pytest.raises(CheckpointError, match="float32"):
        Checkpoint(
            source="t",
            hf_config={"model_type": "x"},
            tensors={"w": torch.zeros(2, dtype=torch.float16)},
            tokenizer=None,
        )
    with pytest.raises(CheckpointError, match=r"config\.model_type"):
        Checkpoint(source="t", hf_config={}, tensors={}, tokenizer=None)
