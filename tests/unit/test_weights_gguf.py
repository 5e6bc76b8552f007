"""GGUF loading on tiny files written here: tensors, config, tokenizer, cache, errors.

Each file is written from a tiny random Hugging Face model the way llama.cpp's converter
writes it (Q/K rotary permutation, GGUF names, reversed dims, some tensors Q8_0), so the
loader must undo every step to get the original tensors back; transformers' own GGUF
loader reads the same files as a second reference.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from model_files import CHAT_TEMPLATE, SPECIALS
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

import llmrt.weights.gguf as gguf_module
from llmrt.errors import CheckpointError, ConfigError
from llmrt.kernels.formats import QuantizedWeight
from llmrt.weights import Checkpoint, load_checkpoint

transformers = pytest.importorskip("transformers")

USER_DEFINED = "<think>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 12:45 and they'll be late!",
    "def fibonacci(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "naïve café, déjà vu, Straße, Ελληνικά, русский текст, 日本語のテキスト, 中文",
    "emoji: 😀 👍🏽 🇺🇸 👩‍👩‍👧 — and more text with    several   spaces\tand tabs\n\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }  // C code',
    "SELECT name, count(*) FROM users WHERE age >= 18 GROUP BY name;",
] * 20
PROBES = [
    "Hello world",
    " leading space and trailing  ",
    "def f(x):\n    return x ** 2  # square\n",
    "naïve café 日本語 русский",
    "emoji 😀👍🏽🇺🇸 family 👩‍👩‍👧 end",
    "<|im_start|>user\nhi<|im_end|>\n",
    "a<think>b</think>c",
    "numbers 1234567 3.14159 -42",
    "I'm sure they'll say we've done it",
    "\n\n\t  \r\n",
    "",
]


def train_bpe() -> HFTokenizer:
    """A small byte-level BPE with ChatML specials, trained on CORPUS."""
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=[*SPECIALS, USER_DEFINED],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return tokenizer


def tokenizer_metadata(bpe: HFTokenizer) -> dict[str, Any]:
    model = json.loads(bpe.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    tokens = [bpe.id_to_token(i) for i in range(bpe.get_vocab_size())]
    types = [3 if t in SPECIALS else 4 if t == USER_DEFINED else 1 for t in tokens]
    return {"tokens": tokens, "merges": merges, "types": types}


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `LlamaModel.permute`."""
    split = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
    return split.swapaxes(1, 2).reshape(w.shape)


LLAMA_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def llama_gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LLAMA_NAMES[module]}.{kind}"


def add_tokenizer(
    writer: gguf.GGUFWriter, meta: dict[str, Any], *, add_bos: bool, pre: str
) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(meta["tokens"])
    writer.add_token_types(meta["types"])
    writer.add_token_merges(meta["merges"])
    writer.add_bos_token_id(meta["tokens"].index("<|im_start|>"))
    writer.add_eos_token_id(meta["tokens"].index("<|im_end|>"))
    writer.add_pad_token_id(meta["tokens"].index("<|endoftext|>"))
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_llama_gguf(
    path: Path,
    model: Any,
    meta: dict[str, Any],
    *,
    quantized: tuple[str, ...] = ("ffn_gate", "ffn_up"),
    add_bos: bool = False,
    pre: str = "smollm",
    arch: str = "llama",
    skip: tuple[str, ...] = (),
    extra: Any = None,
) -> Path:
    """Write `model` (a LlamaForCausalLM) as llama.cpp would, Q8_0 for `quantized` tensors."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    if "rms_eps" not in skip:
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_vocab_size(cfg.vocab_size)
    add_tokenizer(writer, meta, add_bos=add_bos, pre=pre)
    if extra is not None:
        extra(writer)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gguf_name = llama_gguf_name(name)
        array = tensor.detach().float().numpy().copy()
        if ".attn_q." in gguf_name:
            array = llama_permute(array, cfg.num_attention_heads)
        elif ".attn_k." in gguf_name:
            array = llama_permute(array, cfg.num_key_value_heads)
        if any(f".{q}." in f".{gguf_name}" for q in quantized):
            blocks = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_llama(vocab_size: int, *, tie: bool = True, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)  # not all ones, so a misplaced norm would show
    return model


@pytest.fixture(scope="module")
def bpe_meta() -> dict[str, Any]:
    return tokenizer_metadata(train_bpe())


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("LLMRT_CACHE_DIR", str(path))
    return path


@pytest.fixture
def dequantize_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of every tensor the loader dequantizes during the test."""
    calls: list[str] = []
    original = gguf_module.dequantize_tensor

    def counting(tensor: Any, *, shape: tuple[int, ...], item: str) -> np.ndarray:
        calls.append(tensor.name)
        return original(tensor, shape=shape, item=item)

    monkeypatch.setattr(gguf_module, "dequantize_tensor", counting)
    return calls


@pytest.fixture
def llama_file(tmp_path: Path, bpe_meta: dict[str, Any]) -> tuple[Path, Any]:
    model = tiny_llama(len(bpe_meta["tokens"]))
    return write_llama_gguf(tmp_path / "tiny.gguf", model, bpe_meta), model


def load(path: Path, **kwargs: Any) -> Checkpoint:
    return load_checkpoint(format="gguf", path=str(path), **kwargs)


def q8_roundtrip(tensor: torch.Tensor) -> torch.Tensor:
    blocks = gguf.quants.quantize(tensor.numpy(), gguf.GGMLQuantizationType.Q8_0)
    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0))


def test_tensors_come_back_in_hugging_face_form(llama_file: tuple[Path, Any]) -> None:
    path, model = llama_file
    checkpoint = load(path)
    reference = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(checkpoint.tensors) == set(reference)
    for name, tensor in checkpoint.tensors.items():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        expected = reference[name]
        if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            expected = q8_roundtrip(expected)
            assert not torch.equal(tensor, reference[name])  # really was quantized
        assert torch.equal(tensor, expected), name


def test_matches_transformers_gguf_loader(llama_file: tuple[Path, Any]) -> None:
    path, _ = llama_file
    checkpoint = load(path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).state_dict()
    assert set(theirs) - set(checkpoint.tensors) == {"lm_head.weight"}  # tied: not stored
    for name, tensor in checkpoint.tensors.items():
        assert torch.equal(tensor, theirs[name]), name


def test_config_from_metadata(llama_file: tuple[Path, Any], bpe_meta: dict[str, Any]) -> None:
    path, _ = llama_file
    config = load(path).hf_config
    expected = {
        "model_type": "llama",
        "vocab_size": len(bpe_meta["tokens"]),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 128,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": bpe_meta["tokens"].index("<|im_start|>"),
        "eos_token_id": bpe_meta["tokens"].index("<|im_end|>"),
        "pad_token_id": 0,
    }
    assert {k: config[k] for k in expected} == expected
    assert config["rms_norm_eps"] == pytest.approx(1e-5)


def test_untied_output_is_lm_head(tmp_path: Path, bpe_meta: dict[str, Any]) -> None:
    model = tiny_llama(len(bpe_meta["tokens"]), tie=False)
    checkpoint = load(write_llama_gguf(tmp_path / "untied.gguf", model, bpe_meta))
    assert checkpoint.hf_config["tie_word_embeddings"] is False
    assert torch.equal(checkpoint.tensors["lm_head.weight"], model.lm_head.weight.detach())


def test_second_load_is_served_from_cache(
    llama_file: tuple[Path, Any], cache_dir: Path, dequantize_calls: list[str]
) -> None:
    path, _ = llama_file
    first = load(path)
    assert len(dequantize_calls) == len(first.tensors)
    assert list(cache_dir.glob("gguf/*/meta.json"))
    dequantize_calls.clear()
    second = load(path)
    assert dequantize_calls == []
    assert second.hf_config == first.hf_config
    assert set(second.tensors) == set(first.tensors)
    for name in first.tensors:
        assert torch.equal(second.tensors[name], first.tensors[name]), name
    assert second.tokenizer is not None and first.tokenizer is not None
    assert second.tokenizer.encode(PROBES[4]) == first.tokenizer.encode(PROBES[4])
    assert second.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == (
        first.tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    )


def test_digest_is_remembered_until_the_file_changes(
    llama_file: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch, dequantize_calls: list[str]
) -> None:
    path, _ = llama_file
    load(path)
    opened: list[str] = []
    real_open = Path.open

    def tracking_open(self: Path, *args: Any, **kwargs: Any) -> Any:
        opened.append(self.name)
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", tracking_open)
    load(path)
    assert path.name not in opened  # cache hit without re-hashing the file
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    dequantize_calls.clear()
    load(path)
    assert path.name in opened  # touched: re-hashed ...
    assert dequantize_calls == []  # ... but same content, same entry


def test_changed_content_gets_a_new_entry(
    tmp_path: Path, bpe_meta: dict[str, Any], cache_dir: Path, dequantize_calls: list[str]
) -> None:
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, tiny_llama(len(bpe_meta["tokens"]), seed=1), bpe_meta)
    first = load(path)
    write_llama_gguf(path, tiny_llama(len(bpe_meta["tokens"]), seed=2), bpe_meta)
    dequantize_calls.clear()
    second = load(path)
    assert dequantize_calls
    assert len(list(cache_dir.glob("gguf/*/meta.json"))) == 2
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(first.tensors[name], second.tensors[name])


def test_content_rewritten_in_place_with_its_old_size_and_mtime_is_hashed_again(
    tmp_path: Path, bpe_meta: dict[str, Any], cache_dir: Path, dequantize_calls: list[str]
) -> None:
    """``cp -p`` / ``rsync -a`` / ``touch -r`` give a rewritten file its old mtime back and a
    same-shape fine-tune has the same size: the memo key's ctime still moves."""
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, tiny_llama(len(bpe_meta["tokens"]), seed=1), bpe_meta)
    first = load(path)
    before = path.stat()
    other = tmp_path / "other.gguf"
    write_llama_gguf(other, tiny_llama(len(bpe_meta["tokens"]), seed=2), bpe_meta)
    assert other.stat().st_size == before.st_size
    path.write_bytes(other.read_bytes())  # in place: same inode, same size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    dequantize_calls.clear()
    second = load(path)
    assert dequantize_calls  # a new entry, not the stale one
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(first.tensors[name], second.tensors[name])


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda e: _truncate(e / "tensors.safetensors", 0.5), id="truncated-tensors"),
        pytest.param(lambda e: _truncate(e / "tensors.safetensors", 0.0), id="empty-tensors"),
        pytest.param(lambda e: (e / "meta.json").write_text("{not json"), id="garbage-meta"),
        pytest.param(lambda e: _truncate(e / "tokenizer.json", 0.5), id="truncated-tokenizer"),
        pytest.param(lambda e: (e / "tensors.safetensors").unlink(), id="missing-tensors"),
        pytest.param(lambda e: _scramble(e / "tokenizer.json"), id="scrambled-tokenizer"),
        pytest.param(lambda e: _zero_half(e / "tensors.safetensors"), id="zeroed-at-its-size"),
    ],
)
def test_corrupt_cache_entry_is_rebuilt(
    llama_file: tuple[Path, Any],
    cache_dir: Path,
    dequantize_calls: list[str],
    damage: Callable[[Path], object],
) -> None:
    path, _ = llama_file
    first = load(path)
    (entry,) = (p.parent for p in cache_dir.glob("gguf/*/meta.json"))
    damage(entry)
    dequantize_calls.clear()
    rebuilt = load(path)
    assert len(dequantize_calls) == len(first.tensors)
    for name in first.tensors:
        assert torch.equal(rebuilt.tensors[name], first.tensors[name])
    dequantize_calls.clear()
    load(path)
    assert dequantize_calls == []  # the rebuilt entry is good


def test_a_killed_writers_temporary_file_is_removed_by_the_next_write(
    llama_file: tuple[Path, Any], cache_dir: Path
) -> None:
    """SIGKILL (or a power cut) mid-write leaves the hidden temporary file, as large as the
    tensors; the next write of that entry removes it, not a live writer's fresh one."""
    path, _ = llama_file
    load(path)
    (entry,) = (p.parent for p in cache_dir.glob("gguf/*/meta.json"))
    stale = entry / ".tensors.safetensors.dead.tmp"
    fresh = entry / ".tensors.safetensors.live.tmp"
    for left in (stale, fresh):
        left.write_bytes(b"x" * 1024)
    old = time.time() - 3600
    os.utime(stale, (old, old))
    (entry / "meta.json").unlink()  # the entry is rewritten on the next load
    load(path)
    assert not stale.exists() and fresh.exists()


def test_failed_cache_write_leaves_no_entry_and_still_loads(
    llama_file: tuple[Path, Any], cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = llama_file
    import llmrt.weights.cache as cache_module

    def crash(tensors: dict[str, torch.Tensor], filename: str) -> None:
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(cache_module, "save_file", crash)
    checkpoint = load(path)
    assert checkpoint.tensors
    files = [p for p in cache_dir.rglob("*") if p.is_file() and p.parent.name != "digests"]
    assert files == []  # no partial tensors, no temporary files, no meta


def test_cache_dir_argument_overrides_environment(
    llama_file: tuple[Path, Any], tmp_path: Path, cache_dir: Path
) -> None:
    path, _ = llama_file
    load(path, cache_dir=tmp_path / "explicit")
    assert list((tmp_path / "explicit").glob("gguf/*/meta.json"))
    assert not cache_dir.exists()


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.999])
def test_truncated_gguf_is_a_checkpoint_error(
    llama_file: tuple[Path, Any], tmp_path: Path, keep: float
) -> None:
    path, _ = llama_file
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])
    with pytest.raises(CheckpointError) as info:
        load(broken)
    assert str(broken) in str(info.value)


def test_missing_file_names_the_checkpoint_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^checkpoint.path: no such file, got '.*absent.gguf'"):
        load(tmp_path / "absent.gguf")


def test_missing_metadata_field_is_named(tmp_path: Path, bpe_meta: dict[str, Any]) -> None:
    model = tiny_llama(len(bpe_meta["tokens"]))
    path = write_llama_gguf(tmp_path / "m.gguf", model, bpe_meta, skip=("rms_eps",))
    with pytest.raises(CheckpointError) as info:
        load(path)
    assert info.value.item.endswith("llama.attention.layer_norm_rms_epsilon")


def test_unknown_architecture_is_named(tmp_path: Path, bpe_meta: dict[str, Any]) -> None:
    model = tiny_llama(len(bpe_meta["tokens"]))
    path = write_llama_gguf(tmp_path / "m.gguf", model, bpe_meta, arch="mamba")
    with pytest.raises(CheckpointError, match=r"general\.architecture"):
        load(path)


def test_the_loader_learns_architectures_from_the_registry(
    tmp_path: Path, bpe_meta: dict[str, Any]
) -> None:
    """A family registered in-process with a ``gguf`` map makes its architecture loadable;
    nothing in the GGUF loader names it."""
    import attrs

    from llmrt.families import llama, registry
    from llmrt.weights.gguf_architectures import LLAMA_CPP_ARCHITECTURES

    reference_map = LLAMA_CPP_ARCHITECTURES["llama"]
    model = tiny_llama(len(bpe_meta["tokens"]))
    path = write_llama_gguf(tmp_path / "variant.gguf", model, bpe_meta, arch="llama_variant")

    def config(meta: Any, shapes: Any, item: str) -> dict[str, Any]:
        as_llama = {k.replace("llama_variant.", "llama.", 1): v for k, v in meta.items()}
        return {**reference_map.hf_config(as_llama, shapes, item), "model_type": "llama_variant"}

    variant = attrs.evolve(
        llama.FAMILY,
        name="llama_variant",
        model_types=("llama_variant",),
        gguf=attrs.evolve(reference_map, name="llama_variant", hf_config=config),
    )
    with pytest.raises(CheckpointError, match=r"general\.architecture.*'llama_variant'"):
        load(path)
    with registry.register(variant):
        checkpoint = load(path)
    reference = load(write_llama_gguf(tmp_path / "llama.gguf", model, bpe_meta))
    assert checkpoint.hf_config == {**reference.hf_config, "model_type": "llama_variant"}
    assert checkpoint.tensors.keys() == reference.tensors.keys()
    for name, tensor in checkpoint.tensors.items():
        assert torch.equal(tensor, reference.tensors[name]), name


def test_expected_tensors_are_checked(llama_file: tuple[Path, Any]) -> None:
    path, model = llama_file
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    checkpoint = load(path, expected_tensors=lambda cfg: shapes, model_types=("llama",))
    assert set(checkpoint.tensors) == set(shapes)
    wrong = dict(shapes, **{"model.norm.weight": (65,)})
    with pytest.raises(CheckpointError) as info:
        load(path, expected_tensors=lambda cfg: wrong)
    assert info.value.item == "model.norm.weight"
    with pytest.raises(CheckpointError, match="unknown model_type 'llama'"):
        load(path, model_types=("gpt2",))


def test_package_lookup_never_imports_the_package(
    llama_file: tuple[Path, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = llama_file
    package = tmp_path / "site" / "fake_model_pkg"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('importing me is a bug')\n")
    (package / "data" / "__init__.py").write_text("raise ImportError('me too')\n")
    (package / "data" / "w.gguf").write_bytes(path.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    checkpoint = load_checkpoint(format="gguf", package="fake_model_pkg.data", file="w.gguf")
    assert checkpoint.source.endswith("w.gguf")
    assert "fake_model_pkg" not in sys.modules
    with pytest.raises(CheckpointError, match="not installed"):
        load_checkpoint(format="gguf", package="no_such_pkg_llmrt", file="w.gguf")
    with pytest.raises(CheckpointError, match="file not found"):
        load_checkpoint(format="gguf", package="fake_model_pkg", file="other.gguf")
    with pytest.raises(CheckpointError, match="inside the package"):
        load_checkpoint(format="gguf", package="fake_model_pkg", file="../x.gguf")


def test_argument_combinations_are_validated(llama_file: tuple[Path, Any]) -> None:
    path, _ = llama_file
    with pytest.raises(ConfigError, match=r"checkpoint\.path"):
        load_checkpoint(format="gguf", path=str(path), package="p", file="f")
    with pytest.raises(ConfigError, match=r"checkpoint\.file"):
        load_checkpoint(format="gguf", package="p")
    with pytest.raises(ConfigError, match=r"checkpoint\.model"):
        load_checkpoint(format="gguf", path=str(path), model={"model_type": "llama"})


# --- tokenizer rebuilt from GGUF metadata, against transformers on the same file ---


def transformers_tokenizer(path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize(
    ("pre", "add_bos"), [("smollm", False), ("smollm", True), ("llama-bpe", False)]
)
def test_tokenizer_matches_transformers(
    tmp_path: Path, bpe_meta: dict[str, Any], pre: str, add_bos: bool
) -> None:
    model = tiny_llama(len(bpe_meta["tokens"]))
    path = write_llama_gguf(tmp_path / "t.gguf", model, bpe_meta, add_bos=add_bos, pre=pre)
    ours = load(path).tokenizer
    theirs = transformers_tokenizer(path)
    assert ours is not None
    assert ours.vocab_size == len(theirs)
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_ids == (theirs.eos_token_id,)
    for text in PROBES:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            ), (text, skip)
    if add_bos:
        assert ours.encode("hi")[0] == ours.bos_token_id
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "naïve 😀 question?"},
        {"role": "assistant", "content": "Answer."},
        {"role": "user", "content": "def f(): pass"},
    ]
    for generation in (True, False):
        rendered = ours.apply_chat_template(messages, add_generation_prompt=generation)
        assert rendered == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation
        )
        assert ours.encode(rendered, add_special_tokens=False) == theirs.encode(
            rendered, add_special_tokens=False
        )


def test_user_defined_tokens_stay_whole_but_are_not_special(llama_file: tuple[Path, Any]) -> None:
    path, _ = llama_file
    tokenizer = load(path).tokenizer
    assert tokenizer is not None
    think = tokenizer.token_to_id(USER_DEFINED)
    ids = tokenizer.encode("a<think>b", add_special_tokens=False)
    assert think in ids
    assert "<think>" in tokenizer.decode(ids, skip_special_tokens=True)
    assert "<|im_end|>" not in tokenizer.decode(
        tokenizer.encode("x<|im_end|>", add_special_tokens=False), skip_special_tokens=True
    )


def test_stream_decoding_equals_full_decoding(llama_file: tuple[Path, Any]) -> None:
    path, _ = llama_file
    tokenizer = load(path).tokenizer
    assert tokenizer is not None
    text = "emoji 😀👍🏽 family 👩‍👩‍👧, 日本語 and naïve café"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = tokenizer.stream()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_unsupported_tokenizer_model_is_named(tmp_path: Path, bpe_meta: dict[str, Any]) -> None:
    model = tiny_llama(len(bpe_meta["tokens"]))
    path = write_llama_gguf(tmp_path / "m.gguf", model, bpe_meta, pre="some-new-pre")
    with pytest.raises(CheckpointError, match=r"tokenizer\.ggml\.pre"):
        load(path)


# --- gpt2 architecture ---


def gpt2_gguf_name(hf_name: str) -> str:
    names = {
        "transformer.wte.weight": "token_embd.weight",
        "transformer.wpe.weight": "position_embd.weight",
        "transformer.ln_f.weight": "output_norm.weight",
        "transformer.ln_f.bias": "output_norm.bias",
        "lm_head.weight": "output.weight",
    }
    if hf_name in names:
        return names[hf_name]
    parts = {
        "ln_1": "attn_norm",
        "attn.c_attn": "attn_qkv",
        "attn.c_proj": "attn_output",
        "ln_2": "ffn_norm",
        "mlp.c_fc": "ffn_up",
        "mlp.c_proj": "ffn_down",
    }
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{parts[module]}.{kind}"


def test_gpt2_gguf_round_trip(tmp_path: Path, bpe_meta: dict[str, Any]) -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(bpe_meta["tokens"]), n_embd=64, n_layer=2, n_head=4, n_positions=64
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.1)
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(256)
    writer.add_head_count(4)
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    add_tokenizer(writer, bpe_meta, add_bos=False, pre="gpt2")
    reference = {
        k: v
        for k, v in model.state_dict().items()
        if k != "lm_head.weight" and ".attn.bias" not in k
    }
    for name, tensor in reference.items():
        array = tensor.detach().numpy().copy()
        if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            array = np.ascontiguousarray(array.T)  # llama.cpp stores Linear layout
        writer.add_tensor(gpt2_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    checkpoint = load(path, model_types=("gpt2",))
    assert set(checkpoint.tensors) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(checkpoint.tensors[name], tensor), name
    config_out = checkpoint.hf_config
    assert (config_out["n_embd"], config_out["n_layer"], config_out["n_head"]) == (64, 2, 4)
    assert config_out["n_positions"] == 64 and config_out["tie_word_embeddings"] is True


def _truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _zero_half(path: Path) -> None:
    """Same size and header, the second half of the tensor data zeroed (parses fine)."""
    data = bytearray(path.read_bytes())
    half = len(data) // 2
    data[half:] = bytes(len(data) - half)
    path.write_bytes(bytes(data))


def _scramble(path: Path) -> None:
    """Same size, unparsable content."""
    path.write_bytes(b"#" * path.stat().st_size)


def test_keep_quantized_keeps_blocks_in_hugging_face_row_order(
    tmp_path: Path, bpe_meta: dict[str, Any], dequantize_calls: list[str]
) -> None:
    """Quantized Q/K (rows permuted on disk), MLP and tied embedding stay as blocks; the
    blocks dequantize to exactly the float path's tensors; float tensors stay float."""
    model = tiny_llama(len(bpe_meta["tokens"]))
    path = write_llama_gguf(
        tmp_path / "q.gguf",
        model,
        bpe_meta,
        quantized=("attn_q", "attn_k", "ffn_up", "token_embd"),
    )
    dense = load(path)
    dequantize_calls.clear()
    native = load(path, keep_quantized=True)
    assert dequantize_calls and not any("attn_q" in n for n in dequantize_calls)
    assert set(native.tensors) == set(dense.tensors)
    kept = {n for n, t in native.tensors.items() if isinstance(t, QuantizedWeight)}
    assert kept == {
        "model.embed_tokens.weight",
        *(
            f"model.layers.{i}.{m}.weight"
            for i in range(2)
            for m in ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj")
        ),
    }
    for name, tensor in native.tensors.items():
        if isinstance(tensor, QuantizedWeight):
            assert tensor.kind == "q8_0"
            assert torch.equal(tensor.dequantize(), dense.tensors[name]), name
        else:
            assert torch.equal(tensor, dense.tensors[name]), name


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="needs /proc/self/smaps")
def test_a_quantized_checkpoint_gives_its_mapped_pages_back(
    tmp_path: Path, bpe_meta: dict[str, Any]
) -> None:
    """Blocks kept quantized view the file's mapping; once read, its pages can be given back
    (a model that copied them out) and the blocks still read the same bytes."""
    model = tiny_llama(len(bpe_meta["tokens"]))
    path = write_llama_gguf(tmp_path / "q.gguf", model, bpe_meta, quantized=("ffn_up",))
    assert load(path).mappings == ()  # the float path copies everything out of the file
    native = load(path, keep_quantized=True)
    assert len(native.mappings) == 1
    before = {
        n: t.dequantize() for n, t in native.tensors.items() if isinstance(t, QuantizedWeight)
    }
    release = native.release_mapped_pages()
    assert release.skipped is None and release.released_bytes > 0
    for name, weight in before.items():
        tensor = native.tensors[name]
        assert isinstance(tensor, QuantizedWeight) and torch.equal(tensor.dequantize(), weight)


def test_an_olmo_gguf_runs_as_transformers_runs_the_original(
    tmp_path: Path, bpe_meta: dict[str, Any]
) -> None:
    """llama.cpp's ``olmo`` architecture (``OlmoModel`` in convert_hf_to_gguf: Llama's
    tensors with q/k permuted, no norm weights, ``clamp_kqv``) loads through the olmo
    family's ``GGUFArchitecture`` and matches transformers on the original weights."""
    from llmrt.families.registry import get_family
    from llmrt.testing.parity import Harness

    torch.manual_seed(0)
    config = transformers.OlmoConfig(
        vocab_size=len(bpe_meta["tokens"]), hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, clip_qkv=0.05, tie_word_embeddings=False,
    )  # fmt: skip
    config._attn_implementation = "eager"
    model = transformers.OlmoForCausalLM(config).eval()

    def olmo_keys(writer: gguf.GGUFWriter) -> None:
        writer.add_layer_norm_eps(1e-5)
        writer.add_clamp_kqv(0.05)

    path = write_llama_gguf(
        tmp_path / "olmo.gguf", model, bpe_meta, quantized=(), arch="olmo",
        skip=("rms_eps",), extra=olmo_keys,
    )  # fmt: skip
    checkpoint = load(path)
    assert checkpoint.hf_config["model_type"] == "olmo"
    assert checkpoint.hf_config["clip_qkv"] == pytest.approx(0.05)
    family = get_family("olmo")
    built = family.build(
        hf_config=checkpoint.hf_config, tensors=checkpoint.tensors, dtype=torch.float32,
        device="cpu",
    )  # fmt: skip
    harness = Harness(hf_model=model, model=built, vocab_size=config.vocab_size, seed=0)
    prompts = [harness.prompt(n, seed=n) for n in (12, 7)]
    harness.assert_parity(prompts, harness.greedy(prompts, cuts=[[5], []], steps=8))


def test_a_phi2_gguf_runs_as_transformers_runs_the_original(
    tmp_path: Path, bpe_meta: dict[str, Any]
) -> None:
    """llama.cpp's ``phi2`` (tensor names from gguf's own map, no q/k permutation, partial
    rotary as ``rope.dimension_count``, biased LM head) through the phi family."""
    from llmrt.families.registry import get_family
    from llmrt.testing.parity import Harness, perturb

    torch.manual_seed(0)
    config = transformers.PhiConfig(
        vocab_size=len(bpe_meta["tokens"]), hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=128, partial_rotary_factor=0.5,
    )  # fmt: skip
    config._attn_implementation = "eager"
    model = perturb(transformers.PhiForCausalLM(config), seed=1)
    path = tmp_path / "phi2.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_eps(config.layer_norm_eps)
    writer.add_rope_dimension_count(8)
    add_tokenizer(writer, bpe_meta, add_bos=False, pre="smollm")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI2, 2)
    for name, tensor in model.state_dict().items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        writer.add_tensor(gguf_name, tensor.detach().float().numpy().copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    checkpoint = load(path)
    assert checkpoint.hf_config["partial_rotary_factor"] == 0.5
    built = get_family("phi").build(
        hf_config=checkpoint.hf_config, tensors=checkpoint.tensors, dtype=torch.float32,
        device="cpu",
    )  # fmt: skip
    harness = Harness(hf_model=model, model=built, vocab_size=config.vocab_size, seed=0)
    prompts = [harness.prompt(n, seed=n) for n in (12, 7)]
    harness.assert_parity(prompts, harness.greedy(prompts, cuts=[[5], []], steps=8))
