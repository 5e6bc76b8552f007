"""GGUF tokenizers against the reference tokenizer of the same model, on 10,000 mixed lines.

For each GGUF tokenizer kind llmrt rebuilds, a small vocabulary is trained here with
``tokenizers`` and shaped as that model family's own ``tokenizer.json`` is (normalizer,
split regex, BPE options, as published with Llama 3, Qwen2 and SmolLM/GPT-2); the vocabulary
is written into a GGUF with gguf-py the way llama.cpp's converter writes it, read back by
llmrt, and both tokenizers encode and decode a deterministic corpus of mixed scripts, digits,
whitespace runs, code and decomposed accents.
"""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from llmrt.weights.gguf_file import open_gguf
from llmrt.weights.gguf_tokenizer import gguf_tokenizer

LINES = 10_000
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]

#: The split regexes as the models' own tokenizer.json files publish them.
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

WORDS = {
    "latin": [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "lazy",
        "dog",
        "naïve",
        "café",
        "déjà",
        "vu",
        "Straße",
        "Ærøskøbing",
        "piñata",
        "façade",
        "coöperate",
        "IMPORTANT",
        "CamelCase",
        "snake_case",
    ],
    "greek": ["Ελληνικά", "γλώσσα", "αλφάβητο", "Σωκράτης", "φιλοσοφία"],
    "cyrillic": ["русский", "текст", "Москва", "Київ", "українська", "мова", "съешь", "ещё"],
    "cjk": ["日本語のテキスト", "中文", "汉字", "한국어", "텍스트", "東京都", "漢字かな交じり文"],
    "arabic": ["العربية", "مرحبا", "بالعالم", "שלום", "עולם", "עברית"],
    "indic": ["हिन्दी", "नमस्ते", "दुनिया", "தமிழ்", "বাংলা", "ภาษาไทย", "สวัสดี"],
    "emoji": ["😀", "👍🏽", "🇺🇸", "👩\u200d👩\u200d👧", "🧑🏿\u200d💻", "✨", "🚀", "❤️"],
}
CODE = [
    "def f(x: int) -> int:\n    return x ** 2  # square",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "SELECT name, count(*) FROM users WHERE age >= 18 GROUP BY name;",
    "if (a && b || !c) { return a->b[c] << 2; }",
    "const re = /^[a-z]+\\d{2,}$/gi; // regex",
    '<div class="x">&amp; &lt;tag&gt;</div>',
    "fn main() { let v: Vec<u8> = vec![0xFF, 0x0a]; }",
]
CONTRACTIONS = ["I'm", "they'll", "we've", "it's", "YOU'RE", "She'D", "don't", "O'Brien"]
SPACES = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000"]


def corpus(n: int = LINES, seed: int = 0) -> list[str]:
    """``n`` deterministic lines mixing scripts, digits, whitespace runs, code, accents."""
    rng = random.Random(seed)
    scripts = list(WORDS)
    lines = []
    for _ in range(n):
        parts: list[str] = []
        for _ in range(rng.randint(1, 12)):
            kind = rng.random()
            if kind < 0.45:
                parts.append(rng.choice(WORDS[rng.choice(scripts)]))
            elif kind < 0.6:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 12))))
            elif kind < 0.7:
                parts.append(rng.choice(CODE))
            elif kind < 0.78:
                parts.append(rng.choice(CONTRACTIONS))
            elif kind < 0.85:
                word = rng.choice(WORDS["latin"])
                parts.append(unicodedata.normalize("NFD", word))  # decomposed accents
            else:
                parts.append(rng.choice("!?.,;:-_()[]{}'\"@#$%^&*+=/\\|~`…—«»"))
            parts.append(rng.choice(SPACES) if rng.random() < 0.3 else " ")
        line = "".join(parts)
        lines.append(line.strip() if rng.random() < 0.5 else line)
    return lines


def trained(kind: str, lines: list[str]) -> Tokenizer:
    """A byte-level BPE shaped as ``kind``'s published tokenizer.json, trained on ``lines``."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=kind == "gpt2")
    tokenizer = Tokenizer(models.BPE(ignore_merges=kind == "llama3"))
    if kind == "llama3":
        split = pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif kind == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
        split = pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1500,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    return tokenizer


def write_gguf(path: Path, reference: Tokenizer, *, pre: str) -> Path:
    """The vocabulary as llama.cpp's converter writes a byte-level BPE (``gpt2``)."""
    model = json.loads(reference.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    tokens = [reference.id_to_token(i) for i in range(reference.get_vocab_size())]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index(SPECIALS[0]))
    writer.add_eos_token_id(tokens.index(SPECIALS[1]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def lines() -> list[str]:
    return corpus()


def test_the_corpus_is_varied(lines: list[str]) -> None:
    text = "".join(lines)
    assert len(lines) >= 10_000 and len(set(lines)) > 9_000
    for needle in ("\t", "  ", "\r\n", "日本", "😀", "русский", "0", "def ", "'ll"):
        assert needle in text, needle
    assert text != unicodedata.normalize("NFC", text)  # decomposed accents are in


@pytest.mark.parametrize(
    ("kind", "pre"), [("llama3", "llama-bpe"), ("qwen2", "qwen2"), ("gpt2", "smollm")]
)
def test_gguf_bpe_matches_the_reference_tokenizer(
    tmp_path: Path, lines: list[str], kind: str, pre: str
) -> None:
    reference = trained(kind, lines[::4])
    metadata = open_gguf(write_gguf(tmp_path / f"{kind}.gguf", reference, pre=pre)).metadata
    ours = gguf_tokenizer(metadata, item=kind)
    assert ours is not None
    mismatches: list[Any] = []
    for line in [*lines, *SPECIALS, "".join(SPECIALS), f"a{SPECIALS[2]}b"]:
        want = reference.encode(line, add_special_tokens=False).ids
        got = ours.encode(line, add_special_tokens=False)
        if got != want or ours.decode(got, skip_special_tokens=False) != reference.decode(
            want, skip_special_tokens=False
        ):
            mismatches.append((line, got[:12], want[:12]))
    assert not mismatches, f"{len(mismatches)} lines differ, first: {mismatches[:3]}"


def test_llama3_takes_a_whole_word_in_the_vocabulary_before_merging(tmp_path: Path) -> None:
    """Llama 3's tokenizer.json sets ``ignore_merges``: a split found whole in the vocabulary
    is one token even where the merges would never build it (here ``abc``: ``b c`` merges
    first and no ``a bc`` merge exists)."""
    alphabet = sorted(set(pre_tokenizers.ByteLevel.alphabet()))
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab |= {"bc": len(vocab), "abc": len(vocab) + 1, SPECIALS[0]: len(vocab) + 2}
    vocab |= {SPECIALS[1]: len(vocab)}
    for pre, whole in (("llama-bpe", True), ("smollm", False)):
        reference = Tokenizer(models.BPE(vocab=vocab, merges=[("b", "c")], ignore_merges=whole))
        reference.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        ours = gguf_tokenizer(
            open_gguf(write_gguf(tmp_path / f"{pre}.gguf", reference, pre=pre)).metadata, item=pre
        )
        assert ours is not None
        expected = [vocab["abc"]] if whole else [vocab["a"], vocab["bc"]]
        assert ours.encode("abc", add_special_tokens=False) == expected
        assert reference.encode("abc", add_special_tokens=False).ids == expected


SPM_SPECIALS = ["<unk>", "<s>", "</s>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def sentencepiece_vocab(lines: list[str]) -> tuple[list[str], list[float]]:
    """A SentencePiece-BPE vocabulary laid out as Llama 2's: ``<unk> <s> </s>``, the 256
    byte pieces, then pieces (``▁`` for spaces) scored by rank, learned from ``lines``."""
    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    learner.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    learner.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")  # no cross-word
    trainer = trainers.BpeTrainer(
        vocab_size=2000, special_tokens=[*SPM_SPECIALS, *BYTES], limit_alphabet=120,
        show_progress=False,
    )  # fmt: skip
    learner.train_from_iterator(lines, trainer=trainer)
    vocab = learner.get_vocab(with_added_tokens=False)
    tokens = sorted(vocab, key=vocab.__getitem__)
    fixed = len(SPM_SPECIALS) + len(BYTES)
    assert tokens[:fixed] == [*SPM_SPECIALS, *BYTES]
    return tokens, [0.0] * fixed + [-float(i) for i in range(len(tokens) - fixed)]


def llama2_reference(tokens: list[str], scores: list[float]) -> Tokenizer:
    """The tokenizer Llama 2's tokenizer.json describes, over this vocabulary, with the
    merges transformers' converter recovers from the SentencePiece scores."""
    from transformers.tokenization_utils_base import generate_merges

    vocab = {token: i for i, token in enumerate(tokens)}
    merges = generate_merges(vocab, dict(zip(tokens, scores, strict=True)))
    reference = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    reference.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    reference.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    reference.add_special_tokens([AddedToken(t, special=True) for t in SPM_SPECIALS])
    return reference


def test_gguf_sentencepiece_matches_the_llama2_tokenizer(tmp_path: Path, lines: list[str]) -> None:
    pytest.importorskip("transformers")
    tokens, scores = sentencepiece_vocab(lines[1::4])
    reference = llama2_reference(tokens, scores)
    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    types = [2, 3, 3] + [6] * len(BYTES) + [1] * (len(tokens) - 3 - len(BYTES))
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = gguf_tokenizer(open_gguf(tmp_path / "spm.gguf").metadata, item="spm")
    assert ours is not None and ours.bos_token_id == 1 and ours.eos_token_ids[0] == 2
    mismatches: list[Any] = []
    fallbacks = 0
    for line in [*lines, "  two leading spaces", "<s>hi</s>", "trailing  "]:
        want = reference.encode(line, add_special_tokens=False).ids
        got = ours.encode(line, add_special_tokens=False)
        fallbacks += any(3 <= i < 3 + len(BYTES) for i in want)
        if got != want or ours.decode(got) != reference.decode(want):
            mismatches.append((line, got[:12], want[:12]))
    assert not mismatches, f"{len(mismatches)} lines differ, first: {mismatches[:3]}"
    assert fallbacks > 100  # rare characters really went through <0xNN> pieces
    assert ours.encode("hello") == [1, *reference.encode("hello").ids]  # bos, as llama.cpp
