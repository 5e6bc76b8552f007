"""Text <-> token ids for a checkpoint: a thin, typed layer over `tokenizers.Tokenizer`.

Every tokenizer llmrt uses is a `Tokenizer`: one read from a Hugging Face `tokenizer.json`,
one rebuilt from GGUF metadata (`gguf_tokenizer.py`), and the byte tokenizer random test
models use (`byte_tokenizer()`), so all three share one interface and one decode path.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from llmrt.errors import CheckpointError, UnsupportedError
from llmrt.weights.chat_template import ChatTemplate

_REPLACEMENT = "\ufffd"

BYTE_BOS_TOKEN = "<s>"
BYTE_EOS_TOKEN = "</s>"
BYTE_BOS_TOKEN_ID = 256
BYTE_EOS_TOKEN_ID = 257
BYTE_VOCAB_SIZE = 258
"""Ids 0..255 are the bytes, 256 is `<s>` (bos) and 257 is `</s>` (eos)."""

#: Texts at least this long are encoded with the GIL released (`Tokenizer.encode`).
GIL_FREE_ENCODE_CHARS = 4096

BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@attrs.frozen(kw_only=True, eq=False)
class Tokenizer:
    """Encodes, decodes and renders chat prompts; owns its `tokenizers.Tokenizer` backend.

    `eos_token_ids` lists every id that ends generation (the first is `eos_token`'s).
    """

    backend: tokenizers.Tokenizer
    bos_token: str | None
    bos_token_id: int | None
    eos_token: str | None
    eos_token_ids: tuple[int, ...]
    chat_template: ChatTemplate | None

    @classmethod
    def create(
        cls,
        *,
        backend: tokenizers.Tokenizer,
        bos_token: str | None,
        eos_tokens: Sequence[str],
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None,
        item: str,
    ) -> Tokenizer:
        """Resolve special tokens to ids in `backend`; `item` names the source in errors."""
        bos_id = None if bos_token is None else _token_id(backend, bos_token, f"{item}.bos_token")
        eos_ids = [_token_id(backend, token, f"{item}.eos_token") for token in eos_tokens]
        size = backend.get_vocab_size(with_added_tokens=True)
        for token_id in extra_eos_token_ids:
            if not 0 <= token_id < size:
                raise CheckpointError(f"{item}.eos_token_id", f"{token_id} outside vocab of {size}")
            eos_ids.append(token_id)
        return cls(
            backend=backend,
            bos_token=bos_token,
            bos_token_id=bos_id,
            eos_token=eos_tokens[0] if eos_tokens else None,
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            chat_template=(
                None
                if chat_template is None
                else ChatTemplate.compile(source=chat_template, item=f"{item}.chat_template")
            ),
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        """The id of `token` as spelled in the vocabulary, or None."""
        token_id = self.backend.token_to_id(token)
        return None if token_id is None else int(token_id)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; `add_special_tokens` applies the post-processor (e.g. bos).

        Texts from `GIL_FREE_ENCODE_CHARS` characters go through `encode_batch`, which
        releases the GIL (the single-text `encode` holds it: ~4 s for 1.2 MB here, during
        which no other thread of the process runs, a server's event loop included).
        """
        if len(text) >= GIL_FREE_ENCODE_CHARS:
            batch = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
            return list(batch[0].ids)
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text for `ids`; incomplete UTF-8 sequences come out as U+FFFD."""
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def stream(self, *, skip_special_tokens: bool = True) -> DetokenizerStream:
        """A fresh incremental decoder over this tokenizer (borrowed)."""
        return DetokenizerStream(tokenizer=self, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """Render `messages` with the chat template; `extra` adds template variables."""
        if self.chat_template is None:
            raise UnsupportedError("apply_chat_template: this checkpoint has no chat template")
        return self.chat_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            extra=extra,
        )

    def to_json(self) -> str:
        """Serialize (backend included) for the checkpoint cache; inverse of `from_json`."""
        return json.dumps(
            {
                "backend": self.backend.to_str(),
                "bos_token": self.bos_token,
                "bos_token_id": self.bos_token_id,
                "eos_token": self.eos_token,
                "eos_token_ids": list(self.eos_token_ids),
                "chat_template": None if self.chat_template is None else self.chat_template.source,
            }
        )

    @classmethod
    def from_json(cls, text: str, *, item: str) -> Tokenizer:
        """Inverse of `to_json`; malformed data is a `CheckpointError` naming `item`."""
        try:
            data = json.loads(text)
            backend = tokenizers.Tokenizer.from_str(data["backend"])
            template = data["chat_template"]
            return cls(
                backend=backend,
                bos_token=data["bos_token"],
                bos_token_id=data["bos_token_id"],
                eos_token=data["eos_token"],
                eos_token_ids=tuple(int(i) for i in data["eos_token_ids"]),
                chat_template=(
                    None if template is None else ChatTemplate.compile(source=template, item=item)
                ),
            )
        except CheckpointError:
            raise
        except Exception as exc:  # tokenizers reports malformed JSON as a bare Exception
            raise CheckpointError(item, f"unreadable tokenizer data: {exc}") from exc


class DetokenizerStream:
    """Turns a stream of token ids into text, emitting only complete UTF-8 characters.

    Keeps the window `ids[prefix:]`, decodes it, and emits what the newest ids add once it no
    longer ends in a partial character (U+FFFD), so multi-byte characters split across tokens
    and decoders that depend on the preceding token (leading-space rules) stay correct.
    Borrows its `Tokenizer`.
    """

    def __init__(self, *, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text (possibly empty)."""
        self._ids.append(int(token_id))
        window = self._ids[self._prefix :]
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(window)
        if len(text) <= len(before) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix = self._read
        self._read = len(self._ids)
        return text[len(before) :]

    def extend(self, token_ids: Iterable[int]) -> str:
        """Push several ids; return the text they complete."""
        return "".join(self.push(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """Return whatever is pending, incomplete characters as U+FFFD, and reset the window."""
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(before) :] if text.startswith(before) else text

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def byte_tokenizer() -> Tokenizer:
    """The tokenizer for random test models: one id per byte, then `<s>` and `</s>`."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    spelling = byte_spelling()
    if set(spelling.values()) != set(alphabet):
        raise RuntimeError("tokenizers' byte-level alphabet changed")
    vocab = {spelling[b]: b for b in range(256)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(BYTE_BOS_TOKEN, special=True, normalized=False),
            AddedToken(BYTE_EOS_TOKEN, special=True, normalized=False),
        ]
    )
    backend.post_processor = special_token_processor(
        bos=(BYTE_BOS_TOKEN, BYTE_BOS_TOKEN_ID), eos=None
    )
    tokenizer = Tokenizer.create(
        backend=backend,
        bos_token=BYTE_BOS_TOKEN,
        eos_tokens=[BYTE_EOS_TOKEN],
        chat_template=BYTE_CHAT_TEMPLATE,
        item="byte_tokenizer",
    )
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.vocab_size)
    if ids != (BYTE_BOS_TOKEN_ID, (BYTE_EOS_TOKEN_ID,), BYTE_VOCAB_SIZE):
        raise RuntimeError(f"byte tokenizer layout changed: {ids}")
    return tokenizer


def byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table (`bytes_to_unicode`)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def special_token_processor(
    *, bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing:
    """Post-processor adding `bos` before and `eos` after each sequence (as transformers does)."""
    single = " ".join(
        [*([f"{bos[0]}:0"] if bos else []), "$A:0", *([f"{eos[0]}:0"] if eos else [])]
    )
    pair = " ".join(
        [single, *([f"{bos[0]}:1"] if bos else []), "$B:1", *([f"{eos[0]}:1"] if eos else [])]
    )
    specials = [token for token in (bos, eos) if token is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _token_id(backend: tokenizers.Tokenizer, token: str, item: str) -> int:
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise CheckpointError(item, f"token {token!r} is not in the vocabulary")
    return int(token_id)
