"""``model.parts``: a recipe declares the decoder part by part, validated with field paths.

The declared parts are checked against the family modules, which map the same
architectures from their Hugging Face configs independently: declaring Llama's or
Gemma-2's parts must give exactly the decoder those families build.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import yaml

from llmrt.errors import RecipeError
from llmrt.families import gemma2, llama
from llmrt.families.declared import parse_parts
from llmrt.families.decoder import TensorNames
from llmrt.families.hfconfig import HFConfig
from llmrt.recipe.loader import load_recipe

LLAMA_PARTS: dict[str, Any] = {
    "norm": {"kind": "rms"},
    "attention": {"qkv_bias": False, "o_bias": False},
    "mlp": {"kind": "gated", "activation": "silu"},
}
SIZES: dict[str, Any] = {
    "vocab_size": 258,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def _read(parts: dict[str, Any], config: dict[str, Any]) -> tuple[Any, TensorNames]:
    return parse_parts(parts).read(HFConfig(raw=config), torch.float32)


def _same_decoder(declared: Any, family: Any) -> None:
    """Equal specs; only the family name in the runtime config differs."""
    assert declared.model.family == "parts"
    assert attrs.evolve(declared, model=family.model) == family


def test_declared_llama_parts_are_the_llama_family_decoder() -> None:
    config = {"model_type": "llama", **SIZES, "rms_norm_eps": 1e-5, "rope_theta": 5e5}
    spec, names = _read(LLAMA_PARTS, config)
    expected, expected_names = llama.read(HFConfig(raw=config), torch.float32)
    _same_decoder(spec, expected)
    assert names == expected_names


def test_declared_gemma2_parts_are_the_gemma2_family_decoder() -> None:
    config = {
        "model_type": "gemma2",
        **SIZES,
        "head_dim": 16,
        "sliding_window": 6,
        "query_pre_attn_scalar": 12,
        "attn_logit_softcapping": 20.0,
        "final_logit_softcapping": 15.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    }
    parts = {
        "norm": {"kind": "rms_one_plus"},
        "attention": {
            "scale": 12**-0.5,
            "softcap": 20.0,
            "sliding_window": 6,
            "sliding_layers": "even",
        },
        "mlp": {"kind": "gated", "activation": "gelu_tanh"},
        "post_attn_norm": True,
        "post_mlp_norm": True,
        "embedding_scale": "sqrt_hidden",
        "final_softcap": 15.0,
        "tensor_names": {"mlp_norm": "pre_feedforward_layernorm"},
    }
    spec, names = _read(parts, config)
    expected, expected_names = gemma2.read(HFConfig(raw=config), torch.float32)
    _same_decoder(spec, expected)
    assert names == expected_names
    assert [layer.window for layer in spec.layers] == [6, None, 6, None]


def test_declared_moe_nope_and_learned_positions() -> None:
    config = {**SIZES, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    parts = {
        **LLAMA_PARTS,
        "moe": {"routing": "softmax_topk", "layers": [1, 3]},
        "nope_layers": [3],
    }
    spec, _ = _read(parts, config)
    assert [layer.moe for layer in spec.layers] == [False, True, False, True]
    assert [layer.rope for layer in spec.layers] == [0, 0, 0, None]
    assert spec.moe is not None and spec.moe.intermediate_size == 32
    assert spec.moe.routing == "softmax_topk" and spec.moe.top_k == 2
    learned, _ = _read({**LLAMA_PARTS, "positions": "learned"}, SIZES)
    assert learned.positions == "learned" and learned.ropes == ()


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["model.parts.attention.qk_norm=bogus"], "model.parts.attention.qk_norm"),
        (["model.parts.attention.qknorm=head"], "model.parts.attention.qknorm"),
        (["model.parts.mlp.activation=swiglu"], "model.parts.mlp.activation"),
        (["model.parts.norm.bias=true"], "model.parts.norm.bias"),
        (["model.parts.norm.eps=-1"], "model.parts.norm.eps"),
        (
            ["model.parts.attention.qk_norm_per_head_weights=true"],
            "model.parts.attention.qk_norm_per_head_weights",
        ),
        (
            ["model.parts.attention.sliding_window=4", "model.parts.attention.sliding_layers=[5]"],
            "model.parts.attention.sliding_layers[0]",
        ),
        (["model.parts.attention.sliding_layers=odd"], "model.parts.attention.sliding_layers"),
        (["model.parts.mlp=null"], "model.parts.mlp"),
        (
            ["model.parts.residual=parallel", "model.parts.post_attn_norm=true"],
            "model.parts.residual",
        ),
        (["model.parts.embedding_scale=-2"], "model.parts.embedding_scale"),
        (["model.parts.tensor_names.layer=blocks."], "model.parts.tensor_names.layer"),
        (["model.parts.tensor_names.wq=attn.wq"], "model.parts.tensor_names.wq"),
        (["model.parts.nope_layers=[0]", "model.parts.positions=none"], "model.parts.nope_layers"),
        (["model.parts=[]"], "model.parts"),
        (["family=llama"], "family"),
    ],
)
def test_bad_parts_are_recipe_errors_naming_the_field(overrides: list[str], field: str) -> None:
    with pytest.raises(RecipeError) as caught:
        load_recipe("tiny-parts", overrides=overrides)
    assert caught.value.field == field


def _safetensors_recipe(tmp_path: Path, model: dict[str, Any], fmt: str = "safetensors") -> Path:
    path = tmp_path / "recipe.yaml"
    checkpoint = {"format": fmt, "path": "/nonexistent" + (".gguf" if fmt == "gguf" else "")}
    recipe = {
        "name": "declared",
        "checkpoint": checkpoint,
        "tokenizer": {"source": "checkpoint"},
        "model": model,
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_parts_stay_with_a_safetensors_checkpoint_but_other_model_keys_do_not(
    tmp_path: Path,
) -> None:
    recipe = load_recipe(str(_safetensors_recipe(tmp_path, {"parts": LLAMA_PARTS})))
    assert recipe.declared_parts is not None
    assert recipe.family_for("mistral").model_types == ("mistral",)
    with pytest.raises(RecipeError) as caught:
        load_recipe(str(_safetensors_recipe(tmp_path, {"parts": LLAMA_PARTS, **SIZES})))
    assert caught.value.field == "model"
    with pytest.raises(RecipeError) as caught:
        load_recipe(str(_safetensors_recipe(tmp_path, {"parts": LLAMA_PARTS}, fmt="gguf")))
    assert caught.value.field == "model.parts"


def test_parts_say_how_many_layers_their_indices_need() -> None:
    """``llmrt check`` shrinks a recipe's layers but keeps every layer the parts list."""
    assert parse_parts(LLAMA_PARTS).layers_named() == 0
    listed = {**LLAMA_PARTS, "nope_layers": [3], "moe": {"layers": [1, 5]}}
    assert parse_parts(listed).layers_named() == 6
