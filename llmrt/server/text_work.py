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
``max_model_len`` tokens.
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

    def encode(self, text: str, field: str, *, add_special_tokens: bool = True) -> list[int]:
        """Length-checked token ids of ``text`` (call on a worker)."""
        self.check_length(text, field)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def close(self) -> None:
        """Stop the pool (idempotent); work still queued is dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)
