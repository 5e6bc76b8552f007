"""Hugging Face safetensors checkpoint directories (single file, sharded, bf16, errors)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from llmrt.errors import CheckpointError, ConfigError
from llmrt.weights import byte_tokenizer, load_checkpoint, load_tokenizer

transformers = pytest.importorskip("transformers")

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tiny_llama(dtype: torch.dtype = torch.float32, *, tie: bool = False) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=258,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        bos_token_id=256,
        eos_token_id=257,
    )
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def save_tokenizer(directory: Path) -> Any:
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=byte_tokenizer().backend, bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
    return fast


def shapes_of(model: Any) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def load_dir(path: Path, **kwargs: Any) -> Any:
    return load_checkpoint(format="safetensors", path=str(path), **kwargs)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, Any]:
    model = tiny_llama()
    model.save_pretrained(str(tmp_path / "m"), safe_serialization=True)
    save_tokenizer(tmp_path / "m")
    return tmp_path / "m", model


def test_round_trip(saved: tuple[Path, Any]) -> None:
    path, model = saved
    checkpoint = load_dir(path, expected_tensors=lambda cfg: shapes_of(model))
    reference = model.state_dict()
    assert set(checkpoint.tensors) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(checkpoint.tensors[name], tensor), name
    assert checkpoint.hf_config["model_type"] == "llama"
    assert checkpoint.hf_config["num_key_value_heads"] == 2
    assert checkpoint.source == f"safetensors:{path}"


def test_tokenizer_matches_transformers(saved: tuple[Path, Any]) -> None:
    path, _ = saved
    ours = load_dir(path).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(str(path))
    assert ours is not None
    assert (ours.bos_token_id, ours.eos_token_ids) == (theirs.bos_token_id, (theirs.eos_token_id,))
    for text in ["plain", "héllo 😀 wörld", "<s>x</s>", "def f():\n\treturn 1"]:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True
        )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_no_tokenizer_files_means_no_tokenizer(tmp_path: Path) -> None:
    tiny_llama().save_pretrained(str(tmp_path), safe_serialization=True)
    assert load_dir(tmp_path).tokenizer is None


def test_bf16_becomes_float32(tmp_path: Path) -> None:
    model = tiny_llama(torch.bfloat16)
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    checkpoint = load_dir(tmp_path)
    for name, tensor in model.state_dict().items():
        assert checkpoint.tensors[name].dtype == torch.float32
        assert torch.equal(checkpoint.tensors[name], tensor.float()), name


def test_sharded_with_and_without_index(tmp_path: Path) -> None:
    model = tiny_llama()
    model.save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    reference = model.state_dict()
    for _ in range(2):
        checkpoint = load_dir(tmp_path, expected_tensors=lambda cfg: shapes_of(model))
        assert set(checkpoint.tensors) == set(reference)
        assert all(torch.equal(checkpoint.tensors[k], v) for k, v in reference.items())
        (tmp_path / "model.safetensors.index.json").unlink(missing_ok=True)


def test_index_naming_a_missing_shard_or_tensor(tmp_path: Path) -> None:
    tiny_llama().save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="20KB")
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.extra.weight"] = next(iter(index["weight_map"].values()))
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as info:
        load_dir(tmp_path)
    assert info.value.item == "model.extra.weight"
    index["weight_map"]["model.extra.weight"] = "model-99-of-99.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-99-of-99\.safetensors"):
        load_dir(tmp_path)


def test_missing_and_misshaped_tensors_are_named(saved: tuple[Path, Any]) -> None:
    path, model = saved
    shapes = shapes_of(model)
    with pytest.raises(CheckpointError) as info:
        extra = {**shapes, "model.layers.2.mlp.up_proj.weight": (64, 32)}
        load_dir(path, expected_tensors=lambda cfg: extra)
    assert info.value.item == "model.layers.2.mlp.up_proj.weight"
    assert "missing" in str(info.value)
    with pytest.raises(CheckpointError) as info:
        load_dir(path, expected_tensors=lambda cfg: {**shapes, "model.norm.weight": (33,)})
    assert info.value.item == "model.norm.weight"
    assert "(32,)" in str(info.value) and "(33,)" in str(info.value)


def test_optional_and_unexpected_tensors(tmp_path: Path) -> None:
    model = tiny_llama(tie=True)
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    shapes = shapes_of(model)
    partial = {k: v for k, v in shapes.items() if "layers.1" not in k}
    checkpoint = load_dir(
        tmp_path,
        expected_tensors=lambda cfg: partial,
        optional_tensors=lambda cfg: ["lm_head.weight"],
    )
    assert set(checkpoint.tensors) == set(partial) - {"lm_head.weight"}  # extras dropped


def test_base_model_prefix_is_restored(tmp_path: Path) -> None:
    """Hub GPT-2 stores `h.0...` where GPT2LMHeadModel names `transformer.h.0...`."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=258, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    )
    state = {k: v.contiguous() for k, v in model.transformer.state_dict().items()}
    state["h.0.attn.bias"] = torch.ones(1, 1, 4, 4, dtype=torch.bool)  # old causal-mask buffer
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    checkpoint = load_dir(tmp_path, expected_tensors=lambda cfg: expected)
    assert set(checkpoint.tensors) == set(expected)
    assert torch.equal(checkpoint.tensors["transformer.h.0.ln_1.weight"], state["h.0.ln_1.weight"])


def test_pickled_weights_are_refused_not_unpickled(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04 would-be pickle")
    with pytest.raises(CheckpointError, match="convert them to safetensors"):
        load_dir(tmp_path)


@pytest.mark.parametrize("keep", [0.0, 0.001, 0.5, 0.999])
def test_truncated_safetensors_is_named(saved: tuple[Path, Any], keep: float) -> None:
    path, _ = saved
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError) as info:
        load_dir(path)
    assert info.value.item == str(file)


def test_directory_and_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^checkpoint.path: no such directory, got '.*absent'"):
        load_dir(tmp_path / "absent")
    with pytest.raises(CheckpointError) as info:
        load_dir(tmp_path)
    assert info.value.item == str(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="unreadable JSON"):
        load_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(CheckpointError, match="model_type"):
        load_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_dir(tmp_path)


def test_unknown_model_type_and_unreadable_config_for_family(saved: tuple[Path, Any]) -> None:
    path, _ = saved
    with pytest.raises(CheckpointError, match="unknown model_type 'llama'"):
        load_dir(path, model_types=("gpt2",))

    def needs_field(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        return {"x": (config["n_embd"],)}

    with pytest.raises(CheckpointError) as info:
        load_dir(path, expected_tensors=needs_field)
    assert info.value.item == "config.n_embd"


def test_load_tokenizer_from_file_or_directory(tmp_path: Path) -> None:
    save_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    for location in (tmp_path, tmp_path / "tokenizer.json"):
        tokenizer = load_tokenizer(location)
        assert tokenizer.encode("hé", add_special_tokens=False) == [104, 195, 169]
        assert (tokenizer.bos_token_id, tokenizer.eos_token_ids) == (256, (257,))
        assert tokenizer.apply_chat_template([{"role": "user", "content": "q"}]) == "q!"
    with pytest.raises(CheckpointError, match="tokenizer file not found"):
        load_tokenizer(tmp_path / "nothing.json")
    (tmp_path / "tokenizer.json").write_text("{truncated")
    with pytest.raises(CheckpointError, match="unreadable tokenizer"):
        load_tokenizer(tmp_path)


def test_an_eos_id_outside_the_vocab_names_the_file_it_came_from(tmp_path: Path) -> None:
    from llmrt.weights.tokenizer_files import read_tokenizer_dir

    save_tokenizer(tmp_path)
    with pytest.raises(CheckpointError) as info:
        read_tokenizer_dir(tmp_path, hf_config={"eos_token_id": 32000})
    assert info.value.item == f"{tmp_path / 'config.json'}.eos_token_id"
    assert "32000 outside the tokenizer's vocab of 258" in str(info.value)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 999]}))
    with pytest.raises(CheckpointError) as info:
        read_tokenizer_dir(tmp_path, hf_config={"eos_token_id": 257})
    assert info.value.item == f"{tmp_path / 'generation_config.json'}.eos_token_id"
