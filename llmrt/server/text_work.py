"""Request text work off the event loop: JSON parsing, chat-template rendering, tokenizing.

Every connection shares one event loop, so anything that holds it for long delays every
other stream's next chunk. The routes hand their request's text work to a small thread
pool (:class:`TextWorkers`). Threads alone are not enough under the GIL: the tokenizer's
single-text ``encode`` holds it for the whole call (seconds for a megabyte), so
:meth:`~llmrt.weights.tokenizer.Tokenizer.encode` takes the batch entry point for long texts,
which releases it. JSON parsing still holds the GIL (~10 ms per MB here), which is what
the request body limit (:mod:`llmrt.server.body_limit`) bounds.

Before tokenizing, :meth:`TextWorkers.check_length` refuses a text that cannot fit the
context whatever its tokens: no token spells more than ``max_token_bytes`` UTF-8 bytes, so
a text of more than ``max_model_len * max_token_bytes`` bytes has more than
``max_model_len`` tokens. Before parsing, :meth:`TextWorkers.check_body` applies the same
bound to the body's longest JSON string, found by numpy (which releases the GIL), so a
body holding a string no context can hold is refused without the parse that would hold
the GIL for tens of milliseconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from llmrt.errors import RequestError
from llmrt.weights.tokenizer import Tokenizer

T = TypeVar("T")

#: Worker threads for request text work (the GIL serializes most of it anyway; two let a
#: long tokenization, which releases the GIL, overlap the next request's parse).
TEXT_WORKERS = 2


def max_token_bytes(tokenizer: Tokenizer) -> int:
    """The most UTF-8 bytes one token's text can cover (special tokens included).

    A token whose bytes are not valid UTF-8 alone decodes to U+FFFD (3 bytes) per
    incomplete sequence (at most 3 bytes each), so the decoded length bounds its bytes.
    """
    ids = [[i] for i in range(tokenizer.vocab_size)]
    texts = tokenizer.backend.decode_batch(ids, skip_special_tokens=False)
    return max(1, max(len(t.encode("utf-8", "replace")) for t in texts))


#: JSON spells one character in at most 6 bytes (``\\u0041``); its UTF-8 takes at least 1.
JSON_BYTES_PER_CHAR = 6


def longest_json_string(raw: bytes) -> tuple[int, str | None]:
    """The raw length of the longest string literal in a JSON document (0 without one) and
    the object key it is the value of (None when it is not a value, or the key is odd),
    from its unescaped quotes; the work is numpy's over the whole body."""
    data = np.frombuffer(raw, dtype=np.uint8)
    quotes = np.flatnonzero(data == ord('"'))
    if quotes.size < 2:
        return 0, None
    # A quote is escaped after an odd run of backslashes; runs are rare, so walk those.
    after_backslash = quotes[(quotes > 0) & (data[np.maximum(quotes - 1, 0)] == ord("\\"))]
    escaped = set()
    for q in after_backslash.tolist():
        run = 0
        while q - run - 1 >= 0 and data[q - run - 1] == ord("\\"):
            run += 1
        if run % 2:
            escaped.add(q)
    if escaped:
        quotes = quotes[~np.isin(quotes, np.fromiter(escaped, dtype=quotes.dtype))]
    opens, closes = quotes[0::2], quotes[1::2]
    n = min(opens.size, closes.size)
    if n == 0:
        return 0, None
    lengths = closes[:n] - opens[:n] - 1
    i = int(lengths.argmax())
    key = None
    if i > 0 and raw[int(closes[i - 1]) + 1 : int(opens[i])].strip() == b":":
        name = raw[int(opens[i - 1]) + 1 : int(closes[i - 1])]
        if len(name) <= 64 and name.isascii() and b"\\" not in name:
            key = name.decode()
    return int(lengths[i]), key


def check_unicode(value: Any, field: str) -> None:
    """Raise RequestError naming the field of the first string that is not valid Unicode
    text (a lone surrogate such as ``"\\ud800"`` parses from JSON but cannot be encoded)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(
                field,
                f"is not valid Unicode text (lone surrogate {value[exc.start]!r} at "
                f"character {exc.start})",
            ) from None
    elif isinstance(value, Mapping):
        for key, item in value.items():
            check_unicode(key, field)
            check_unicode(item, f"{field}.{key}" if field else str(key))
    elif isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        for i, item in enumerate(value):
            check_unicode(item, f"{field}.{i}")


class TextWorkers:
    """The thread pool for request text work and the tokenizer facts it checks against
    (owns the pool; borrows the tokenizer)."""

    def __init__(self, *, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_token_bytes = max_token_bytes(tokenizer)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=TEXT_WORKERS, thread_name_prefix="llmrt-text"
        )

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on a worker thread, awaited from the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def check_length(self, text: str, field: str) -> None:
        """Refuse a text that certainly has more than ``max_model_len`` tokens, before
        tokenizing it (bytes over the most bytes a token can cover)."""
        size = len(text.encode("utf-8", "surrogatepass"))
        bound = self.max_model_len * self.max_token_bytes
        if size > bound:
            raise RequestError(
                field,
                f"has {size} bytes, more than max_model_len={self.max_model_len} tokens can "
                f"hold (at most {self.max_token_bytes} bytes per token)",
            )

    def check_body(self, raw: bytes) -> None:
        """Refuse a JSON body holding a string longer than any context can hold (call on a
        worker, before parsing; bodies too short to hold one are not scanned)."""
        bound = JSON_BYTES_PER_CHAR * self.max_model_len * self.max_token_bytes
        if len(raw) <= bound:
            return
        longest, key = longest_json_string(raw)
        if longest > bound:
            raise RequestError(
                key or "request body",
                f"holds a string of {longest} bytes, more than max_model_len="
                f"{self.max_model_len} tokens can hold (at most {self.max_token_bytes} bytes "
                f"per token, {JSON_BYTES_PER_CHAR} JSON bytes per character)",
            )

    def encode(self, text: str, field: str, *, add_special_tokens: bool = True) -> list[int]:
        """Length-checked token ids of ``text`` (call on a worker)."""
        self.check_length(text, field)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def close(self) -> None:
        """Stop the pool (idempotent); work still queued is dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)
