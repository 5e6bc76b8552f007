"""Rebuild a checkpoint's tokenizer from GGUF metadata (`tokenizer.*` keys).

A GGUF file carries no `tokenizer.json`; it stores the vocabulary, merges, token types and
special ids under llama.cpp's key names. Two kinds are rebuilt as the models' own
`tokenizer.json` files define them, so both give the same ids for the same text:

- `gpt2`: byte-level BPE, split by the `tokenizer.ggml.pre` regex;
- `llama`: SentencePiece BPE (Llama 2, Mistral, TinyLlama...): `▁` for spaces and a leading
  one (`tokenizer.ggml.add_space_prefix`), byte fallback to `<0xNN>` tokens, and merges
  recovered from the scores as Hugging Face's converter recovers them (every split of a
  piece into two pieces, best score first).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from llmrt.errors import CheckpointError
from llmrt.weights.tokenizer import Tokenizer, byte_spelling, special_token_processor

_UNKNOWN = 2
_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

GPT2_PRE_TOKENIZERS = frozenset({"default", "gpt2", "smollm"})
"""`tokenizer.ggml.pre` values whose split is GPT-2's own (the ByteLevel pre-tokenizer's regex)."""

SPLIT_PRE_TOKENIZERS: Mapping[str, str] = MappingProxyType(
    {
        "llama3": _LLAMA3_SPLIT,
        "llama-v3": _LLAMA3_SPLIT,
        "llama-bpe": _LLAMA3_SPLIT,
        "falcon3": _LLAMA3_SPLIT,
        "smaug-bpe": _LLAMA3_SPLIT,
        "dbrx": _LLAMA3_SPLIT,
        "qwen2": _QWEN2_SPLIT,
        "deepseek-r1-qwen": _QWEN2_SPLIT,
        "gpt-4o": _GPT4O_SPLIT,
        "llama4": _GPT4O_SPLIT,
    }
)
"""`tokenizer.ggml.pre` values with their own split regex (as llama.cpp and transformers use)."""

NFC_PRE_TOKENIZERS = frozenset({"qwen2", "deepseek-r1-qwen"})
"""`tokenizer.ggml.pre` values whose models' tokenizer.json normalizes text to NFC first
(Qwen2's), so composed and decomposed accents give the same ids."""

WHOLE_WORD_PRE_TOKENIZERS = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "llama4"})
"""`tokenizer.ggml.pre` values whose BPE takes a split found whole in the vocabulary as one
token before merging (``ignore_merges`` in Llama 3's tokenizer.json; llama.cpp does the same)."""


def gguf_tokenizer(metadata: Mapping[str, Any], *, item: str) -> Tokenizer | None:
    """The tokenizer described by `metadata`, or None when the file has no `tokenizer.ggml.model`.

    `item` (the file) prefixes the key named in any `CheckpointError`.
    """
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        return None
    if model == "llama":
        return _sentencepiece(metadata, item=item)
    if model != "gpt2":
        raise CheckpointError(
            f"{item}: tokenizer.ggml.model",
            f"unsupported tokenizer model {model!r}; llmrt rebuilds byte-level BPE ('gpt2') "
            "and SentencePiece BPE ('llama')",
        )
    tokens = _string_list(metadata, "tokenizer.ggml.tokens", item=item)
    merges = _string_list(metadata, "tokenizer.ggml.merges", item=item)
    token_types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(token_types) != len(tokens):
        raise CheckpointError(
            f"{item}: tokenizer.ggml.token_type",
            f"{len(token_types)} types for {len(tokens)} tokens",
        )
    spelled = _spell(tokens)
    backend = _bpe_backend(
        spelled=spelled, merges=merges, pre=metadata.get("tokenizer.ggml.pre"), item=item
    )

    alphabet = set(byte_spelling().values())
    specials = [
        token
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == _CONTROL and set(token) <= alphabet
    ]
    special_ids = {
        key: _special_id(metadata, key, len(tokens), item=item)
        for key in ("bos", "eos", "unknown", "padding", "eot", "eom")
    }
    specials += [spelled[i] for i in special_ids.values() if i is not None]
    if specials:
        backend.add_special_tokens(
            [AddedToken(token, normalized=False, special=True) for token in dict.fromkeys(specials)]
        )
    # The model's token_to_id per user-defined token, not ``get_vocab``, which builds a dict of
    # the whole vocabulary (Llama 3: 128k entries, ~0.2 s) to test a handful of tokens.
    model = backend.model
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == _USER_DEFINED and model.token_to_id(token) is not None
    ]
    if user_defined:
        backend.add_tokens(user_defined)
    return _finish(backend, spelled, special_ids, metadata, item=item, add_bos_default=False)


def _sentencepiece(metadata: Mapping[str, Any], *, item: str) -> Tokenizer:
    """A ``llama`` (SentencePiece BPE) vocabulary as Llama 2's tokenizer.json spells it."""
    tokens = _string_list(metadata, "tokenizer.ggml.tokens", item=item)
    scores = list(metadata.get("tokenizer.ggml.scores") or [])
    if len(scores) != len(tokens):
        raise CheckpointError(
            f"{item}: tokenizer.ggml.scores", f"{len(scores)} scores for {len(tokens)} tokens"
        )
    token_types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(token_types) != len(tokens):
        raise CheckpointError(
            f"{item}: tokenizer.ggml.token_type",
            f"{len(token_types)} types for {len(tokens)} tokens",
        )
    special_ids = {
        key: _special_id(metadata, key, len(tokens), item=item)
        for key in ("bos", "eos", "unknown", "padding", "eot", "eom")
    }
    unk_id = special_ids["unknown"]
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_from_scores(tokens, [float(s) for s in scores], vocab),
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
    )
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", "\u2581")
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend("\u2581"), spaces]) if prefix else spaces
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    specials = [
        token
        for token, kind in zip(tokens, token_types, strict=True)
        if kind in (_UNKNOWN, _CONTROL)
    ]
    specials += [tokens[i] for i in special_ids.values() if i is not None]
    if specials:
        backend.add_special_tokens(
            [AddedToken(token, normalized=False, special=True) for token in dict.fromkeys(specials)]
        )
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == _USER_DEFINED
    ]
    if user_defined:
        backend.add_tokens(user_defined)
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
    return _finish(backend, tokens, special_ids, metadata, item=item, add_bos_default=True)


def _merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], vocab: Mapping[str, int]
) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a piece into two pieces
    of the vocabulary, best piece score first, then longer left and right parts (Hugging
    Face's converter's order, so both tokenizers merge alike)."""
    found: list[tuple[str, str, float]] = []
    for piece, score in dict(zip(tokens, scores, strict=True)).items():
        local = [
            (piece[:i], piece[i:], score)
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _finish(
    backend: tokenizers.Tokenizer,
    spelled: Sequence[str],
    special_ids: Mapping[str, int | None],
    metadata: Mapping[str, Any],
    *,
    item: str,
    add_bos_default: bool,
) -> Tokenizer:
    """The post-processor (bos/eos as the metadata asks) and the ``Tokenizer``."""
    bos_id, eos_id = special_ids["bos"], special_ids["eos"]
    add_bos = (
        bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos_id is not None
    )
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    if add_bos or add_eos:
        backend.post_processor = special_token_processor(
            bos=(spelled[bos_id], bos_id) if add_bos and bos_id is not None else None,
            eos=(spelled[eos_id], eos_id) if add_eos and eos_id is not None else None,
        )
    template = metadata.get("tokenizer.chat_template")
    return Tokenizer.create(
        backend=backend,
        bos_token=None if bos_id is None else spelled[bos_id],
        eos_tokens=[] if eos_id is None else [spelled[eos_id]],
        extra_eos_token_ids=[i for i in (special_ids["eot"], special_ids["eom"]) if i is not None],
        chat_template=template if isinstance(template, str) else None,
        item=f"{item}: tokenizer",
    )


def _bpe_backend(
    *, spelled: Sequence[str], merges: Sequence[str], pre: object, item: str
) -> tokenizers.Tokenizer:
    vocab = {token: index for index, token in enumerate(spelled)}
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise CheckpointError(f"{item}: tokenizer.ggml.merges", f"malformed merge {merge!r}")
        pairs.append((left, right))
    pre_name = "default" if pre is None else str(pre)
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            ignore_merges=pre_name in WHOLE_WORD_PRE_TOKENIZERS,
        )
    )
    if pre_name in NFC_PRE_TOKENIZERS:
        backend.normalizer = normalizers.NFC()
    if pre_name in GPT2_PRE_TOKENIZERS:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif pre_name in SPLIT_PRE_TOKENIZERS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(SPLIT_PRE_TOKENIZERS[pre_name]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        known = sorted(GPT2_PRE_TOKENIZERS | set(SPLIT_PRE_TOKENIZERS))
        raise CheckpointError(
            f"{item}: tokenizer.ggml.pre", f"unknown pre-tokenizer {pre_name!r}; known: {known}"
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _spell(tokens: Sequence[str]) -> list[str]:
    """Tokens in the byte-level alphabet; a plain-text token is respelled byte by byte."""
    spelling = byte_spelling()
    alphabet = set(spelling.values())
    return [
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))
        for token in tokens
    ]


def _string_list(metadata: Mapping[str, Any], key: str, *, item: str) -> list[str]:
    value = metadata.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointError(f"{item}: {key}", "missing or not a list of strings")
    return value


def _special_id(metadata: Mapping[str, Any], name: str, size: int, *, item: str) -> int | None:
    key = f"tokenizer.ggml.{name}_token_id"
    value = metadata.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or not 0 <= value < size:
        raise CheckpointError(f"{item}: {key}", f"{value!r} is not an id in a vocab of {size}")
    return value
