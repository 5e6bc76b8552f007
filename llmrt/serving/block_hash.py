"""Deterministic chain hashes of full KV blocks: the keys of the prefix cache.

A block's hash covers its parent's hash, its own token ids and the request's extra keys
(adapter name, cache salt, ...), so equal hashes mean equal KV for the whole prefix, not just
the block. The hash is SHA-256 over a canonical byte encoding rather than Python's ``hash()``:
the latter is salted per process (``PYTHONHASHSEED``), and cache keys must agree between the
scheduler, workers and restarts. The full 32-byte digest is kept because a collision would
silently serve another prompt's KV.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType, TypeAlias

from llmrt.errors import ConfigError, RequestError

BlockHash = NewType("BlockHash", bytes)
"""SHA-256 digest (32 bytes) of one full block and, through its parent, of every block before it."""

ExtraKey: TypeAlias = str | int | bytes
ExtraKeys: TypeAlias = tuple[ExtraKey, ...]

# Parent of a sequence's first block. A fixed, versioned constant (not a random seed) so
# hashes agree across processes; bump the version if the encoding below ever changes.
ROOT_HASH = BlockHash(hashlib.sha256(b"llmrt.block_hash.v1").digest())

# Token ids are packed as little-endian uint64: wide enough for any vocabulary, and struct
# rejects negative or oversized values instead of wrapping them.
_TOKEN = "Q"


def hash_block_tokens(
    *, parent: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys = ()
) -> BlockHash:
    """Hash one full block chained to ``parent`` (None: the block starts the sequence)."""
    return _chain(
        parent if parent is not None else ROOT_HASH,
        _pack_tokens(token_ids),
        _encode_extra_keys(extra_keys),
    )


def hash_prompt_blocks(
    token_ids: Sequence[int],
    *,
    block_size: int,
    parent: BlockHash | None = None,
    extra_keys: ExtraKeys = (),
) -> list[BlockHash]:
    """Chain hashes of every *full* block of ``token_ids``; a trailing partial block has none.

    ``parent`` continues an existing chain (the hash of the block before ``token_ids[0]``).
    ``extra_keys`` are mixed into every block, so a continued chain stays consistent.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError("block_size", block_size, "must be a positive int")
    num_full = len(token_ids) // block_size
    if num_full == 0:
        return []
    packed = _pack_tokens(token_ids[: num_full * block_size])
    extra = _encode_extra_keys(extra_keys)
    stride = block_size * struct.calcsize(_TOKEN)
    view = memoryview(packed)
    hashes: list[BlockHash] = []
    prev = parent if parent is not None else ROOT_HASH
    for i in range(num_full):
        prev = _chain(prev, view[i * stride : (i + 1) * stride], extra)
        hashes.append(prev)
    return hashes


def _chain(parent: bytes, packed_tokens: bytes | memoryview, extra: bytes) -> BlockHash:
    # Every variable-length part is length-prefixed so no two inputs share an encoding.
    digest = hashlib.sha256(parent)
    digest.update(struct.pack("<Q", len(packed_tokens)))
    digest.update(packed_tokens)
    digest.update(extra)
    return BlockHash(digest.digest())


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(token_ids)}{_TOKEN}", *token_ids)
    except struct.error:
        for i, tok in enumerate(token_ids):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < 2**64:
                raise RequestError(
                    "token_ids", f"token {i} is not an int in [0, 2**64)", value=tok
                ) from None
        raise


def _encode_extra_keys(extra_keys: ExtraKeys) -> bytes:
    parts = [struct.pack("<Q", len(extra_keys))]
    for i, key in enumerate(extra_keys):
        if isinstance(key, bool):
            tag, raw = b"o", b"\x01" if key else b"\x00"
        elif isinstance(key, int):
            tag, raw = b"i", key.to_bytes((key.bit_length() + 8) // 8, "little", signed=True)
        elif isinstance(key, str):
            tag, raw = b"s", key.encode("utf-8")
        elif isinstance(key, bytes):
            tag, raw = b"b", key
        else:
            raise RequestError(
                "extra_keys", f"key {i} must be str, int or bytes", value=type(key).__name__
            )
        parts += (tag, struct.pack("<Q", len(raw)), raw)
    return b"".join(parts)
