"""``model.parts`` recipes end to end: through the containers, from random weights and
from a safetensors directory (default names or a declared tensor-name mapping), and under
``llmrt check`` against transformers."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from llmrt.cli.check import reference_model
from llmrt.cli.main import main

transformers = pytest.importorskip("transformers")

#: Small containers: 32 blocks of 16 tokens, 4 slots, warmup at 32 tokens.
SMALL = {
    "kv_cache.block_size": 16,
    "kv_cache.max_num_blocks": 64,
    "kv_cache.num_blocks": 32,
    "prefill.max_chunk_size": 128,
    "prefill.max_batch_size": 4,
    "prefill.seq_len_buckets": "fine",
    "decode.lane_capacity": 4,
    "warmup.prefill_seq_lens": [32],
    "warmup.prefill_batch_sizes": [1, 2],
    "serving.max_num_batched_tokens": 256,
    "serving.max_model_len": 256,
}
PROMPTS = [[5, 9, 77, 3, 120, 41, 8], [60, 2, 19, 33]]

#: GPT-NeoX declared by parts: LayerNorm with bias, per-head interleaved fused q/k/v,
#: partial rotary (from config.json), plain GELU MLP with biases, parallel residual,
#: and the checkpoint's own tensor names.
NEOX_PARTS: dict[str, Any] = {
    "norm": {"kind": "layer", "bias": True},
    "attention": {"qkv_bias": True, "o_bias": True},
    "mlp": {"kind": "plain", "activation": "gelu", "bias": True},
    "residual": "parallel",
    "tensor_names": {
        "embed": "gpt_neox.embed_in.weight",
        "final_norm": "gpt_neox.final_layer_norm",
        "lm_head": "embed_out.weight",
        "layer": "gpt_neox.layers.{i}.",
        "attn_norm": "input_layernorm",
        "mlp_norm": "post_attention_layernorm",
        "qkv": "attention.query_key_value",
        "qkv_interleaved": True,
        "o": "attention.dense",
        "up": "mlp.dense_h_to_4h",
        "down": "mlp.dense_4h_to_h",
    },
}


def _write(path: Path, recipe: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def _safetensors_recipe(tmp_path: Path, directory: Path, parts: dict[str, Any]) -> str:
    return _write(
        tmp_path / "declared.yaml",
        {
            "name": "declared",
            "checkpoint": {"format": "safetensors", "path": str(directory)},
            "tokenizer": {"source": "checkpoint"},
            "model": {"parts": parts},
        },
    )


def _tokens(runtime: Any) -> list[list[int]]:
    runtime.ready()
    return runtime.generate(PROMPTS, steps=6).tokens


def test_random_parts_recipe_runs_like_the_family_it_redeclares(
    build: Callable[..., Any],
) -> None:
    """tiny-parts re-declares tiny-llama: same random weights, same tokens through the
    containers (traced decode, batched prefill)."""
    declared = build("tiny-parts", SMALL)
    family = build("tiny-llama", SMALL)
    assert _tokens(declared) == _tokens(family)
    assert declared.container.model.family().name == "parts"
    assert family.container.model.family().name == "llama"


def test_check_passes_on_declared_parts_and_fails_on_a_changed_part(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check", "tiny-parts", "--steps", "4"]) == 0
    assert "(family parts)" in capsys.readouterr().out
    broken = ["--set", "model.parts.mlp.activation=gelu", "--steps", "4"]
    assert main(["check", "tiny-parts", *broken]) == 1
    assert capsys.readouterr().out.rstrip().endswith("FAILED")


def test_check_declared_olmo2_parts_against_transformers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """OLMo-2's post-norm residual (norms on the attention and MLP outputs only) and q/k
    RMSNorm over the whole projection, declared in a recipe, against Olmo2ForCausalLM.
    (Gemma-2's parts are checked against the gemma2 family in tests/unit.)"""
    recipe = yaml.safe_load(Path("recipes/tiny-parts.yaml").read_text())
    recipe["model"] = {
        "model_type": "olmo2",
        "vocab_size": 258,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "attention_bias": True,
        "parts": {
            "norm": {"kind": "rms"},
            "attention": {"qkv_bias": True, "o_bias": True, "qk_norm": "proj"},
            "mlp": {"kind": "gated", "activation": "silu"},
            "attn_norm": False,
            "mlp_norm": False,
            "post_attn_norm": True,
            "post_mlp_norm": True,
        },
    }
    path = _write(tmp_path / "olmo2-parts.yaml", recipe)
    status = main(["check", path, "--steps", "8"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "(family parts)" in out
    # A part that computes differently on the same tensors fails the comparison; one that
    # needs other tensors is named before anything runs.
    assert main(["check", path, "--set", "model.parts.norm.kind=rms_one_plus", "--steps", "4"]) == 1
    assert main(["check", path, "--set", "model.parts.attention.qk_norm=head", "--steps", "4"]) == 2
    assert "q_norm.weight: has shape (64,), expected (16,)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def neox_dir(tmp_path_factory: pytest.TempPathFactory, tiny_hf_checkpoint: Path) -> Path:
    """A tiny GPT-NeoX saved by transformers, with the tiny HF tokenizer beside it."""
    directory = tmp_path_factory.mktemp("tiny-neox")
    model = reference_model(
        config={
            "model_type": "gpt_neox",
            "vocab_size": 64,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 256,
            "partial_rotary_factor": 0.5,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
    )
    model.save_pretrained(directory)
    shutil.copy(tiny_hf_checkpoint / "tokenizer.json", directory / "tokenizer.json")
    return directory


def test_safetensors_dir_with_declared_tensor_names(
    tmp_path: Path,
    neox_dir: Path,
    build: Callable[..., Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Parts + a tensor-name mapping load a GPT-NeoX directory: ``llmrt check`` against
    GPTNeoXForCausalLM passes, and the container generates what the gpt_neox family does."""
    path = _safetensors_recipe(tmp_path, neox_dir, NEOX_PARTS)
    status = main(["check", path, "--steps", "8"])
    out = capsys.readouterr().out
    assert status == 0, out
    declared = build(path, SMALL)
    family = build("hf", {**SMALL, "checkpoint.path": str(neox_dir)})
    assert _tokens(declared) == _tokens(family)
    assert family.container.model.family().name == "gpt_neox"


def test_safetensors_dir_with_default_names_and_a_missing_mapping(
    tmp_path: Path, tiny_hf_checkpoint: Path, neox_dir: Path, build: Callable[..., Any]
) -> None:
    """Without ``tensor_names`` the decoder's default (Hugging Face Llama) names apply: a
    Llama directory loads and matches transformers; a GPT-NeoX one names what is missing."""
    llama_parts = {"norm": {"kind": "rms"}, "mlp": {"kind": "gated", "activation": "silu"}}
    runtime = build(_safetensors_recipe(tmp_path, tiny_hf_checkpoint, llama_parts), SMALL)
    tokens = _tokens(runtime)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_checkpoint).eval()
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor([PROMPTS[1]]), max_new_tokens=7, do_sample=False
        )[0, len(PROMPTS[1]) :]
    assert tokens[1] == expected.tolist()
    no_names = {key: value for key, value in NEOX_PARTS.items() if key != "tensor_names"}
    broken = build(_safetensors_recipe(tmp_path, neox_dir, no_names), SMALL)
    with pytest.raises(Exception, match=r"model\.embed_tokens\.weight"):
        broken.ready()


def test_a_variant_neither_a_family_nor_transformers_knows_runs(
    build: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """A new model type with a parallel residual, q/k norm per head, GELU-tanh MLP and no
    positional encoding on its last layer: validated, built and run from the recipe alone;
    ``llmrt check`` says it has no reference instead of comparing against something else."""
    variant = [
        "model.model_type=my_variant",
        "model.parts.residual=parallel",
        "model.parts.mlp_norm=false",
        "model.parts.attention.qk_norm=head",
        "model.parts.mlp.activation=gelu_tanh",
        "model.parts.nope_layers=[1]",
    ]
    runtime = build("tiny-parts", [*variant, *(f"{k}={v}" for k, v in SMALL.items())])
    tokens = _tokens(runtime)
    assert [len(t) for t in tokens] == [7, 7]
    spec = runtime.container.model.family().spec(
        runtime.container.model.weights().hf_config, dtype=torch.float32
    )
    assert (spec.residual, spec.attention.qk_norm, [layer.rope for layer in spec.layers]) == (
        "parallel",
        "head",
        [0, None],
    )
    assert main(["check", "tiny-parts", *(a for v in variant for a in ("--set", v))]) == 2
    assert "no reference" in capsys.readouterr().err
