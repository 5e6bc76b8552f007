"""Model files as users have them, written in tmp for tests: tiny GGUFs (gguf-py's writer and
tensor-name map, from a tiny random transformers model), Hugging Face directories, and a
``huggingface_hub`` cache holding them under a Hub id (no network)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 12:45 and they'll be late!",
    "def fibonacci(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "naïve café, déjà vu, Straße, Ελληνικά, русский текст, 日本語のテキスト, 中文",
    "What is the capital of France? Paris is the capital of France.",
] * 10


def train_bpe(vocab_size: int = 400) -> HFTokenizer:
    """A small byte-level BPE with ChatML specials."""
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def add_bpe_tokenizer(writer: gguf.GGUFWriter, bpe: HFTokenizer, *, pre: str = "smollm") -> None:
    """``bpe`` under llama.cpp's ``tokenizer.ggml.*`` keys, with the ChatML template."""
    model = json.loads(bpe.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    tokens = [bpe.id_to_token(i) for i in range(bpe.get_vocab_size())]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.permute`` (Q/K rows of ``llama`` files)."""
    split = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
    return split.swapaxes(1, 2).reshape(w.shape)


def tiny_llama(vocab_size: int, *, seed: int = 0, context: int = 256) -> Any:
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    return transformers.LlamaForCausalLM(config).eval()


def write_llama_gguf(
    path: Path, model: Any, bpe: HFTokenizer, *, quantized: tuple[str, ...] = ()
) -> Path:
    """``model`` (a LlamaForCausalLM) as llama.cpp writes it: names from gguf-py's tensor map,
    Q/K rows permuted, Q8_0 blocks for tensors whose GGUF name holds one of ``quantized``."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(getattr(cfg, "rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_vocab_size(cfg.vocab_size)
    add_bpe_tokenizer(writer, bpe)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        array = tensor.detach().float().numpy().copy()
        if ".attn_q." in gguf_name:
            array = llama_permute(array, cfg.num_attention_heads)
        elif ".attn_k." in gguf_name:
            array = llama_permute(array, cfg.num_key_value_heads)
        if any(q in gguf_name for q in quantized):
            blocks = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def save_hf_dir(directory: Path, model: Any, bpe: HFTokenizer) -> Path:
    """``model`` saved by transformers (safetensors) with ``bpe`` as its tokenizer.json."""
    model.save_pretrained(directory, safe_serialization=True)
    bpe.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE})
    )
    return directory


def fake_hub_cache(
    cache: Path, repo: str, files: dict[str, Path], *, revision: str = "main"
) -> Path:
    """``files`` under ``repo`` in a ``huggingface_hub`` cache at ``cache`` (blobs, a snapshot
    of symlinks, ``refs/<revision>``), as a download would leave them; the snapshot dir."""
    commit = f"{abs(hash((repo, revision))):040x}"[:40]
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for name, source in files.items():
        blob = root / "blobs" / f"{abs(hash((repo, name))):064x}"[:64]
        shutil.copyfile(source, blob)
        (snapshot / name).symlink_to(Path("../..") / "blobs" / blob.name)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / revision).write_text(commit)
    return snapshot
