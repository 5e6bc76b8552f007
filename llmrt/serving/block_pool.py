"""Paged-KV block bookkeeping with prefix caching: the block pool and the per-request allocator.

The pool owns the *bookkeeping* of every KV block id (reference counts, cache keys, the free
queue); the KV tensors themselves live with the model runner, indexed by these ids.

A free block may still hold reusable KV: if it is a full block with a hash, it stays in the
hash map until it is handed out again, so a later request with the same prefix can pick it
straight out of the free queue. The free queue is therefore also the eviction order (least
recently freed first), and it is a doubly linked list so such a hit can unlink a block from
the middle in O(1).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

import attrs

from llmrt.errors import ConfigError, KVCacheStateError, LLMRTError, RequestError
from llmrt.serving.block_hash import BlockHash, ExtraKeys, hash_prompt_blocks


class OutOfBlocksError(LLMRTError, RuntimeError):
    """The pool has fewer free blocks than requested; nothing was allocated."""

    def __init__(self, *, requested: int, available: int) -> None:
        self.requested = requested
        self.available = available
        super().__init__(
            f"out of KV blocks: requested {requested}, only {available} free "
            f"(the pool is unchanged)"
        )


def _positive_int(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"block_pool.{attribute.name}", value, "must be a positive int")


def _is_bool(instance: object, attribute: attrs.Attribute[bool], value: bool) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"block_pool.{attribute.name}", value, "must be a bool")


def _check_count(field: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError(field, "must be a non-negative int", value=value)


@attrs.frozen(kw_only=True)
class BlockPoolConfig:
    """Static shape of a block pool: ``num_blocks`` blocks of ``block_size`` token slots."""

    num_blocks: int = attrs.field(validator=_positive_int)
    block_size: int = attrs.field(validator=_positive_int)
    enable_prefix_caching: bool = attrs.field(validator=_is_bool)


@attrs.define(kw_only=True, eq=False)
class KVBlock:
    """Runtime record of one KV block id.

    ``block_hash`` is set only while the block is registered in the prefix cache.
    ``prev_free``/``next_free`` are its links in the pool's free queue (both None when the
    block is not queued) and belong to :class:`FreeBlockQueue`. Compared by identity: the
    queue and the hash map hold these very records.
    """

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVBlock | None = attrs.field(default=None, repr=False)
    next_free: KVBlock | None = attrs.field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked queue of free blocks; the head is evicted first.

    Sentinel head and tail records make every queued block have two neighbours, so link and
    unlink never branch on the ends.
    """

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head = KVBlock(block_id=-1)
        self._tail = KVBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev_free is not None

    def __iter__(self) -> Iterator[KVBlock]:
        """Queued blocks in eviction order (head first)."""
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def checked_blocks(self, *, limit: int) -> list[KVBlock]:
        """The queued blocks after checking every link and the count (for invariant checks)."""
        out: list[KVBlock] = []
        prev, node = self._head, self._head.next_free
        while node is not self._tail:
            if node is None or node.prev_free is not prev or len(out) >= limit:
                raise KVCacheStateError(
                    f"free queue: broken link after block {prev.block_id} "
                    f"({len(out)} blocks walked)"
                )
            out.append(node)
            prev, node = node, node.next_free
        if self._tail.prev_free is not prev or len(out) != self._len:
            raise KVCacheStateError(
                f"free queue: tail link or count is wrong ({len(out)} walked, {self._len} counted)"
            )
        return out

    def popleft_n(self, n: int) -> list[KVBlock]:
        """Unlink and return the first ``n`` blocks (the caller checked ``n <= len(self)``)."""
        out: list[KVBlock] = []
        node = self._head.next_free
        for _ in range(n):
            if node is None or node is self._tail:
                raise KVCacheStateError(f"free queue holds fewer than {n} blocks")
            out.append(node)
            nxt = node.next_free
            node.prev_free = node.next_free = None
            node = nxt
        self._head.next_free = node
        if node is not None:
            node.prev_free = self._head
        self._len -= len(out)
        return out

    def remove(self, block: KVBlock) -> None:
        """Unlink ``block`` from wherever it sits, in O(1)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise KVCacheStateError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def append(self, block: KVBlock) -> None:
        """Queue ``block`` at the tail (evicted last)."""
        if block.prev_free is not None:
            raise KVCacheStateError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        if last is None:
            raise KVCacheStateError("free queue: the tail sentinel lost its back link")
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1


class BlockPool:
    """Owns the bookkeeping of ``num_blocks`` KV block ids and the prefix-cache hash map.

    Every block is preallocated as a :class:`KVBlock` and starts in the free queue in id
    order. A block is either referenced (``ref_count > 0``, not queued) or free (queued);
    a full block with a hash stays in the hash map until it is reused for new content.
    """

    def __init__(self, *, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.config = BlockPoolConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
        )
        self._blocks = tuple(KVBlock(block_id=i) for i in range(num_blocks))
        self._free = FreeBlockQueue(self._blocks)
        # One block per hash: a second block computed with the same content (two requests
        # prefilling the same prefix at once) is simply not registered and is recycled on free.
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue, cached or not: what :meth:`get_new_blocks` can hand out."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, referenced or free."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request, in [0, 1]."""
        return 1.0 - len(self._free) / self.config.num_blocks

    def block(self, block_id: int) -> KVBlock:
        """The record of ``block_id`` (for inspection; mutate only through the pool)."""
        return self._blocks[block_id]

    def free_block_ids(self) -> list[int]:
        """Ids of the free blocks in eviction order (next to be reused first)."""
        return [b.block_id for b in self._free]

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue with ``ref_count`` 1.

        A reused block loses its cache entry: its KV is about to be overwritten. Raises
        :class:`OutOfBlocksError` (pool unchanged) when fewer blocks are free.
        """
        _check_count("num_blocks", num_blocks)
        if num_blocks > len(self._free):
            raise OutOfBlocksError(requested=num_blocks, available=len(self._free))
        blocks = self._free.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to each block (a prefix hit), pulling free ones out of the queue."""
        blocks = list(blocks)
        self._check_owned(blocks)
        for block in blocks:
            if block.ref_count == 0:
                self._free.remove(block)
            block.ref_count += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the queue's tail.

        Blocks are queued in the order given, so pass a request's blocks tail first to have
        its tail evicted before its prefix. Checks every block before changing any: freeing a
        block that has no reference raises :class:`KVCacheStateError` naming it.
        """
        blocks = list(blocks)
        self._check_owned(blocks)
        drops: dict[int, int] = {}
        for block in blocks:
            drops[block.block_id] = drops.get(block.block_id, 0) + 1
            if drops[block.block_id] > block.ref_count:
                raise KVCacheStateError(
                    f"block {block.block_id}: freed more times than referenced "
                    f"(ref_count {block.ref_count})",
                    current=f"ref_count={block.ref_count}",
                    requested="free",
                )
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free.append(block)

    def cache_full_blocks(
        self, *, blocks: Sequence[KVBlock], block_hashes: Sequence[BlockHash]
    ) -> int:
        """Register computed full blocks under their chain hashes; returns how many were added.

        A block whose hash is already registered to another block stays unregistered (the
        existing entry keeps serving hits). A no-op when prefix caching is disabled.
        """
        if len(blocks) != len(block_hashes):
            raise RequestError(
                "block_hashes",
                f"expected one hash per block ({len(blocks)} blocks)",
                value=len(block_hashes),
            )
        if not self.config.enable_prefix_caching:
            return 0
        self._check_owned(blocks)
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.ref_count == 0:
                raise KVCacheStateError(
                    f"block {block.block_id}: cannot cache a free block",
                    current="free",
                    requested="cache",
                )
            if block.block_hash is not None and block.block_hash != block_hash:
                raise KVCacheStateError(
                    f"block {block.block_id}: already cached under a different hash",
                    current=block.block_hash.hex(),
                    requested=block_hash.hex(),
                )
        added = 0
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block
                added += 1
        return added

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The block holding ``block_hash``'s KV, referenced or free, or None."""
        return self._cached.get(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (e.g. after a weight update); only when no block is in use.

        Returns False and changes nothing while blocks are referenced: their requests would
        re-register KV computed before the reset.
        """
        if len(self._free) != self.config.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True

    def check_invariants(self) -> None:
        """Raise :class:`KVCacheStateError` on the first broken internal invariant (for tests)."""
        num_blocks = self.config.num_blocks
        queued: set[int] = set()
        for block in self._free.checked_blocks(limit=num_blocks):
            if block.block_id in queued or self._blocks[block.block_id] is not block:
                raise KVCacheStateError(f"free queue: block {block.block_id} is foreign or twice")
            queued.add(block.block_id)
        referenced = 0
        for block in self._blocks:
            if block.ref_count < 0:
                raise KVCacheStateError(f"block {block.block_id}: ref_count {block.ref_count}")
            is_queued = block.block_id in queued
            if (block.ref_count == 0) != is_queued:
                raise KVCacheStateError(
                    f"block {block.block_id}: ref_count {block.ref_count} but "
                    f"{'in' if is_queued else 'not in'} the free queue"
                )
            if not is_queued and (block.prev_free is not None or block.next_free is not None):
                raise KVCacheStateError(f"block {block.block_id}: stale free-queue links")
            referenced += block.ref_count > 0
            if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
                raise KVCacheStateError(f"block {block.block_id}: hash missing from the hash map")
        if len(queued) + referenced != num_blocks:
            raise KVCacheStateError(
                f"{len(queued)} free + {referenced} referenced != {num_blocks} blocks"
            )
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash or self._blocks[block.block_id] is not block:
                raise KVCacheStateError(f"hash map: entry for block {block.block_id} is stale")
        if self._cached and not self.config.enable_prefix_caching:
            raise KVCacheStateError("hash map: not empty with prefix caching disabled")

    def _check_owned(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            if (
                not 0 <= block.block_id < len(self._blocks)
                or self._blocks[block.block_id] is not block
            ):
                raise KVCacheStateError(f"block {block.block_id}: not a block of this pool")


@attrs.frozen(kw_only=True)
class PrefixHit:
    """Outcome of a prompt allocation.

    ``block_ids`` is the request's whole block table; its first
    ``num_cached_tokens // block_size`` blocks already hold the prompt's KV.
    """

    num_cached_tokens: int
    block_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class PrefixLookup:
    """A prompt's reusable prefix: ``cached_tokens`` hit now, ``in_flight_tokens`` more soon."""

    cached_tokens: int
    in_flight_tokens: int


@attrs.frozen(kw_only=True)
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache and how many of them hit."""

    queried_tokens: int
    hit_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@attrs.define(kw_only=True, eq=False)
class RequestBlocks:
    """One request's blocks and how far its chain of block hashes and cache entries reach."""

    request_id: str
    blocks: list[KVBlock]
    num_tokens: int
    """Token slots reserved, prompt plus decode growth."""
    extra_keys: ExtraKeys = ()
    block_hashes: list[BlockHash] = attrs.Factory(list)
    """Chain hashes of the full blocks known so far (may run ahead of ``num_cached_blocks``)."""
    num_cached_blocks: int = 0
    """Leading blocks already hit in or offered to the prefix cache."""
    num_prompt_hashes: int = 0
    """Leading ``block_hashes`` known at allocation; those not yet cached are in flight."""


class BlockAllocator:
    """Allocates KV blocks to requests over a pool it owns (vLLM's KV cache manager role).

    Prompt allocation reuses the longest cached prefix of full blocks; decode growth adds
    blocks one request at a time; computed full blocks are registered for reuse with
    :meth:`cache_blocks`. Running out of blocks returns None with nothing changed, so the
    scheduler can preempt (:meth:`free`) and retry.
    """

    def __init__(self, *, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self._pool = BlockPool(
            num_blocks=num_blocks,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.config = self._pool.config
        self._requests: dict[str, RequestBlocks] = {}
        # Hashes of prompt blocks some request holds but has not computed yet, with how many
        # requests hold each: a request arriving in the same step can wait for them.
        self._in_flight: Counter[BlockHash] = Counter()
        self._queried_tokens = 0
        self._hit_tokens = 0

    @property
    def pool(self) -> BlockPool:
        """The pool this allocator owns; read it, but allocate only through the allocator."""
        return self._pool

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Counted over successful prompt allocations while prefix caching is enabled."""
        return PrefixCacheStats(queried_tokens=self._queried_tokens, hit_tokens=self._hit_tokens)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def prefix_lookup(
        self, token_ids: Sequence[int], *, extra_keys: ExtraKeys = ()
    ) -> PrefixLookup:
        """How much of a prompt's reusable prefix is cached now, and how much more is in flight.

        Reusable means full blocks within the first ``len(token_ids) - 1`` tokens (the last
        prompt token is always recomputed). In flight: blocks that follow the cached ones
        and that a running request has allocated but not computed yet; they become hits once
        that request's prefill reaches them. Changes nothing and counts no statistics.
        """
        if not token_ids or not self.config.enable_prefix_caching:
            return PrefixLookup(cached_tokens=0, in_flight_tokens=0)
        block_size = self.config.block_size
        usable = (len(token_ids) - 1) // block_size
        hashes = hash_prompt_blocks(
            token_ids[: usable * block_size], block_size=block_size, extra_keys=extra_keys
        )
        cached = len(self._leading_hits(hashes))
        pending = cached
        while pending < len(hashes) and (
            self._in_flight[hashes[pending]] > 0
            or self._pool.get_cached_block(hashes[pending]) is not None
        ):
            pending += 1
        return PrefixLookup(
            cached_tokens=cached * block_size, in_flight_tokens=(pending - cached) * block_size
        )

    def allocate_for_prompt(
        self, *, request_id: str, token_ids: Sequence[int], extra_keys: ExtraKeys = ()
    ) -> PrefixHit | None:
        """Give a new request blocks for its whole prompt, reusing cached prefix blocks.

        The hit is capped at ``len(token_ids) - 1`` tokens, since the last prompt token must
        be recomputed to produce the first logits, and caching is per full block, so
        ``num_cached_tokens = (hit full blocks) * block_size <= (len - 1) // block_size *
        block_size``: a fully cached prompt of 8 tokens with ``block_size`` 4 hits 4 tokens.
        All or nothing: returns None, with the pool unchanged, when the blocks do not fit now.
        """
        if request_id in self._requests:
            raise KVCacheStateError(f"request {request_id!r} already has blocks")
        if not token_ids:
            raise RequestError("token_ids", "the prompt is empty")
        block_size = self.config.block_size
        num_needed = -(-len(token_ids) // block_size)
        if num_needed > self.config.num_blocks:
            raise RequestError(
                "token_ids",
                f"needs {num_needed} blocks but the pool has {self.config.num_blocks}",
                value=len(token_ids),
            )
        caching = self.config.enable_prefix_caching
        hashes = (
            hash_prompt_blocks(token_ids, block_size=block_size, extra_keys=extra_keys)
            if caching
            else []
        )
        hits = self._leading_hits(hashes[: (len(token_ids) - 1) // block_size])
        # Touching a free hit takes it out of the free queue, so it no longer counts as free.
        free_after_touch = self._pool.num_free_blocks - sum(b.ref_count == 0 for b in hits)
        if num_needed - len(hits) > free_after_touch:
            return None
        # Touch before taking new blocks: otherwise the free hits could be evicted and reused.
        self._pool.touch(hits)
        blocks = hits + self._pool.get_new_blocks(num_needed - len(hits))
        self._requests[request_id] = RequestBlocks(
            request_id=request_id,
            blocks=blocks,
            num_tokens=len(token_ids),
            extra_keys=extra_keys,
            block_hashes=hashes,
            num_cached_blocks=len(hits),
            num_prompt_hashes=len(hashes),
        )
        self._in_flight.update(hashes[len(hits) :])
        num_cached_tokens = len(hits) * block_size
        if caching:
            self._queried_tokens += len(token_ids)
            self._hit_tokens += num_cached_tokens
        return PrefixHit(
            num_cached_tokens=num_cached_tokens, block_ids=tuple(b.block_id for b in blocks)
        )

    def append_slots(self, *, request_id: str, num_new_tokens: int) -> list[int] | None:
        """Reserve slots for ``num_new_tokens`` more tokens; returns the ids of added blocks.

        Returns None, with nothing changed, when the free blocks do not suffice (preempt and
        retry). Raises :class:`RequestError` when the request could not fit even in an
        otherwise empty pool.
        """
        req = self._request(request_id)
        _check_count("num_new_tokens", num_new_tokens)
        num_tokens = req.num_tokens + num_new_tokens
        num_new_blocks = -(-num_tokens // self.config.block_size) - len(req.blocks)
        if len(req.blocks) + num_new_blocks > self.config.num_blocks:
            raise RequestError(
                "num_new_tokens",
                f"request {request_id!r} would need {len(req.blocks) + num_new_blocks} blocks "
                f"but the pool has {self.config.num_blocks}",
                value=num_new_tokens,
            )
        if num_new_blocks > self._pool.num_free_blocks:
            return None
        new_blocks = self._pool.get_new_blocks(num_new_blocks)
        req.blocks.extend(new_blocks)
        req.num_tokens = num_tokens
        return [b.block_id for b in new_blocks]

    def cache_blocks(self, *, request_id: str, token_ids: Sequence[int]) -> None:
        """Register the request's full blocks whose KV is now computed.

        ``token_ids`` are the request's tokens whose KV has been written, from the first
        prompt token; each call must extend the tokens of the previous one.
        """
        req = self._request(request_id)
        if len(token_ids) > req.num_tokens:
            raise RequestError(
                "token_ids",
                f"request {request_id!r} has slots for only {req.num_tokens} tokens",
                value=len(token_ids),
            )
        if not self.config.enable_prefix_caching:
            return
        block_size = self.config.block_size
        num_full = len(token_ids) // block_size
        known = len(req.block_hashes)
        if num_full > known:
            req.block_hashes += hash_prompt_blocks(
                token_ids[known * block_size : num_full * block_size],
                block_size=block_size,
                parent=req.block_hashes[-1] if req.block_hashes else None,
                extra_keys=req.extra_keys,
            )
        if num_full > req.num_cached_blocks:
            self._pool.cache_full_blocks(
                blocks=req.blocks[req.num_cached_blocks : num_full],
                block_hashes=req.block_hashes[req.num_cached_blocks : num_full],
            )
            self._land(req, upto=num_full)
            req.num_cached_blocks = num_full

    def free(self, request_id: str) -> bool:
        """Release every block of the request (finish or preemption); False if it had none.

        Blocks are freed tail first so that, among them, the tail is evicted first: a cached
        prefix is only useful from its start. Idempotent.
        """
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self._land(req, upto=req.num_prompt_hashes)
        self._pool.free_blocks(reversed(req.blocks))
        return True

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in token order."""
        return [b.block_id for b in self._request(request_id).blocks]

    def reset_prefix_cache(self) -> bool:
        """See :meth:`BlockPool.reset_prefix_cache`."""
        return self._pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Pool invariants, plus: each block's ref_count equals the requests that hold it."""
        self._pool.check_invariants()
        holders: dict[int, int] = {}
        for req in self._requests.values():
            needed = -(-req.num_tokens // self.config.block_size)
            if len(req.blocks) != needed:
                raise KVCacheStateError(
                    f"request {req.request_id!r}: {len(req.blocks)} blocks for "
                    f"{req.num_tokens} tokens"
                )
            for block in req.blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        in_flight: Counter[BlockHash] = Counter()
        for req in self._requests.values():
            in_flight.update(req.block_hashes[req.num_cached_blocks : req.num_prompt_hashes])
        if in_flight != self._in_flight:
            raise KVCacheStateError(
                f"in-flight prefix blocks: tracked {sum(self._in_flight.values())}, "
                f"held uncomputed by requests {sum(in_flight.values())}"
            )
        for block_id in range(self.config.num_blocks):
            ref_count = self._pool.block(block_id).ref_count
            if ref_count != holders.get(block_id, 0):
                raise KVCacheStateError(
                    f"block {block_id}: ref_count {ref_count} but held by "
                    f"{holders.get(block_id, 0)} request(s)"
                )

    def _leading_hits(self, hashes: Sequence[BlockHash]) -> list[KVBlock]:
        """The cached blocks of the longest prefix of ``hashes`` that is all cached."""
        hits: list[KVBlock] = []
        for block_hash in hashes:
            block = self._pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def _land(self, req: RequestBlocks, *, upto: int) -> None:
        """Take the request's prompt blocks from ``num_cached_blocks`` to ``upto`` out of flight."""
        for block_hash in req.block_hashes[
            req.num_cached_blocks : min(upto, req.num_prompt_hashes)
        ]:
            left = self._in_flight[block_hash] - 1
            if left > 0:
                self._in_flight[block_hash] = left
            else:
                del self._in_flight[block_hash]

    def _request(self, request_id: str) -> RequestBlocks:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KVCacheStateError(f"request {request_id!r} has no blocks") from None
