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
bound to the body's longest JSON string, found with ``bytes.find`` (~1 ms for 10 MB), so a
body holding a string no context can hold is refused without the parse that would hold
the GIL for tens of milliseconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

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
    the object key it is the value of (None when it is not a value, or the key is odd).

    Walks the unescaped quotes with ``bytes.find`` (memchr: ~1 ms for 10 MB); the Python
    work is per quote, so a body of a few huge strings costs nothing and one of many small
    ones yields the GIL as ordinary bytecode does.
    """
    quotes: list[int] = []
    at = raw.find(b'"')
    while at >= 0:
        if at and raw[at - 1] == 0x5C:  # a backslash: escaped after an odd run of them
            run = 1
            while at - run - 1 >= 0 and raw[at - run - 1] == 0x5C:
                run += 1
            if run % 2:
                at = raw.find(b'"', at + 1)
                continue
        quotes.append(at)
        at = raw.find(b'"', at + 1)
    best, best_at = 0, -1
    for i in range(0, len(quotes) - 1, 2):
        length = quotes[i + 1] - quotes[i] - 1
        if length > best:
            best, best_at = length, i
    if best_at < 0:
        return 0, None
    key = None
    if best_at >= 2 and raw[quotes[best_at - 1] + 1 : quotes[best_at]].strip() == b":":
        name = raw[quotes[best_at - 2] + 1 : quotes[best_at - 1]]
        if len(name) <= 64 and name.isascii() and b"\\" not in name:
            key = name.decode()
    return best, key


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
