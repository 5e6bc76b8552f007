"""Block pool and allocator: exact prefix hits, eviction order, all-or-nothing failures."""

from __future__ import annotations

import hashlib

import pytest

from llmrt.errors import ConfigError, KVCacheStateError, RequestError
from llmrt.serving.block_hash import BlockHash, hash_prompt_blocks
from llmrt.serving.block_pool import (
    BlockAllocator,
    BlockPool,
    KVBlock,
    OutOfBlocksError,
    PrefixCacheStats,
    PrefixLookup,
)


def _h(name: str) -> BlockHash:
    return BlockHash(hashlib.sha256(name.encode()).digest())


def _snapshot(pool: BlockPool) -> object:
    n = pool.config.num_blocks
    return (
        pool.free_block_ids(),
        [(pool.block(i).ref_count, pool.block(i).block_hash) for i in range(n)],
        {h: pool.get_cached_block(h) for i in range(n) if (h := pool.block(i).block_hash)},
    )


def _alloc(num_blocks: int = 16, block_size: int = 4, caching: bool = True) -> BlockAllocator:
    return BlockAllocator(
        num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=caching
    )


def _prefill(alloc: BlockAllocator, request_id: str, tokens: list[int]) -> int:
    """Allocate, 'compute' the prompt and cache it; returns the cached-token count."""
    hit = alloc.allocate_for_prompt(request_id=request_id, token_ids=tokens)
    assert hit is not None
    alloc.cache_blocks(request_id=request_id, token_ids=tokens)
    alloc.check_invariants()
    return hit.num_cached_tokens


# --- pool ------------------------------------------------------------------------------------


def test_new_pool_is_all_free_in_id_order() -> None:
    pool = BlockPool(num_blocks=5, block_size=4, enable_prefix_caching=True)
    assert pool.free_block_ids() == [0, 1, 2, 3, 4]
    assert (pool.num_free_blocks, pool.usage, pool.num_cached_blocks) == (5, 0.0, 0)
    blocks = pool.get_new_blocks(2)
    assert [(b.block_id, b.ref_count) for b in blocks] == [(0, 1), (1, 1)]
    assert pool.usage == pytest.approx(0.4)
    pool.check_invariants()


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("block_pool.num_blocks", {"num_blocks": 0, "block_size": 4}),
        ("block_pool.block_size", {"num_blocks": 4, "block_size": 0}),
        ("block_pool.block_size", {"num_blocks": 4, "block_size": True}),
    ],
)
def test_config_is_validated(field: str, kwargs: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match=field):
        BlockPool(**kwargs, enable_prefix_caching=True)


def test_out_of_blocks_raises_and_leaves_the_pool_unchanged() -> None:
    pool = BlockPool(num_blocks=4, block_size=2, enable_prefix_caching=True)
    held = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks=held[:1], block_hashes=[_h("a")])
    before = _snapshot(pool)
    with pytest.raises(OutOfBlocksError, match="requested 2, only 1 free") as err:
        pool.get_new_blocks(2)
    assert (err.value.requested, err.value.available) == (2, 1)
    assert _snapshot(pool) == before
    pool.check_invariants()


def test_freeing_an_unreferenced_block_names_it_and_changes_nothing() -> None:
    pool = BlockPool(num_blocks=3, block_size=2, enable_prefix_caching=False)
    b0, b1 = pool.get_new_blocks(2)
    before = _snapshot(pool)
    with pytest.raises(KVCacheStateError, match="block 1: freed more times than referenced"):
        pool.free_blocks([b0, b1, b1])
    assert _snapshot(pool) == before
    pool.free_blocks([b1])
    with pytest.raises(KVCacheStateError, match=r"block 1: .*\(ref_count 0\)"):
        pool.free_blocks([b1])


def test_foreign_blocks_are_rejected() -> None:
    pool = BlockPool(num_blocks=2, block_size=2, enable_prefix_caching=True)
    with pytest.raises(KVCacheStateError, match="block 0: not a block of this pool"):
        pool.touch([KVBlock(block_id=0)])
    with pytest.raises(KVCacheStateError, match="block 7: not a block of this pool"):
        pool.free_blocks([KVBlock(block_id=7, ref_count=1)])


def test_touch_unlinks_a_free_cached_block_from_the_middle_of_the_queue() -> None:
    pool = BlockPool(num_blocks=5, block_size=2, enable_prefix_caching=True)
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(blocks=[blocks[2]], block_hashes=[_h("x")])
    pool.free_blocks(blocks)
    assert pool.free_block_ids() == [0, 1, 2, 3, 4]
    hit = pool.get_cached_block(_h("x"))
    assert hit is blocks[2]
    pool.touch([hit])
    assert pool.free_block_ids() == [0, 1, 3, 4]
    assert (hit.ref_count, hit.block_hash) == (1, _h("x"))
    pool.touch([hit])  # a second holder: no queue change
    assert hit.ref_count == 2
    pool.check_invariants()
    pool.free_blocks([hit, hit])
    assert pool.free_block_ids() == [0, 1, 3, 4, 2]
    pool.check_invariants()


def test_least_recently_freed_cached_block_is_evicted_first() -> None:
    pool = BlockPool(num_blocks=3, block_size=2, enable_prefix_caching=True)
    b0, b1, b2 = pool.get_new_blocks(3)
    assert (
        pool.cache_full_blocks(blocks=[b0, b1, b2], block_hashes=[_h("0"), _h("1"), _h("2")]) == 3
    )
    for block in (b1, b2, b0):
        pool.free_blocks([block])
    assert pool.free_block_ids() == [1, 2, 0]
    assert pool.get_new_blocks(1) == [b1]
    assert b1.block_hash is None
    assert pool.get_cached_block(_h("1")) is None
    assert pool.get_cached_block(_h("2")) is b2
    assert pool.get_cached_block(_h("0")) is b0
    assert pool.get_new_blocks(1) == [b2]
    assert pool.get_cached_block(_h("2")) is None
    assert pool.num_cached_blocks == 1
    pool.check_invariants()


def test_a_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(num_blocks=2, block_size=2, enable_prefix_caching=True)
    first, second = pool.get_new_blocks(2)
    assert pool.cache_full_blocks(blocks=[first], block_hashes=[_h("same")]) == 1
    assert pool.cache_full_blocks(blocks=[second], block_hashes=[_h("same")]) == 0
    assert pool.get_cached_block(_h("same")) is first
    assert second.block_hash is None
    # Re-offering a block under its own hash is harmless; under another hash it is a bug.
    assert pool.cache_full_blocks(blocks=[first], block_hashes=[_h("same")]) == 0
    with pytest.raises(KVCacheStateError, match="block 0: already cached under a different"):
        pool.cache_full_blocks(blocks=[first], block_hashes=[_h("other")])
    pool.check_invariants()


def test_cache_full_blocks_rejects_free_blocks_and_length_mismatch() -> None:
    pool = BlockPool(num_blocks=2, block_size=2, enable_prefix_caching=True)
    (held,) = pool.get_new_blocks(1)
    with pytest.raises(KVCacheStateError, match="block 1: cannot cache a free block"):
        pool.cache_full_blocks(blocks=[held, pool.block(1)], block_hashes=[_h("a"), _h("b")])
    assert held.block_hash is None  # checked before anything was registered
    with pytest.raises(RequestError, match="block_hashes: expected one hash per block"):
        pool.cache_full_blocks(blocks=[held], block_hashes=[])


def test_disabled_prefix_caching_never_registers() -> None:
    pool = BlockPool(num_blocks=2, block_size=2, enable_prefix_caching=False)
    blocks = pool.get_new_blocks(2)
    assert pool.cache_full_blocks(blocks=blocks, block_hashes=[_h("a"), _h("b")]) == 0
    assert pool.get_cached_block(_h("a")) is None
    assert all(b.block_hash is None for b in blocks)


def test_reset_prefix_cache_only_when_nothing_is_referenced() -> None:
    pool = BlockPool(num_blocks=2, block_size=2, enable_prefix_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks=blocks, block_hashes=[_h("a"), _h("b")])
    pool.free_blocks(blocks[:1])
    before = _snapshot(pool)
    assert pool.reset_prefix_cache() is False
    assert _snapshot(pool) == before
    pool.free_blocks(blocks[1:])
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0
    assert pool.get_cached_block(_h("a")) is None
    assert all(b.block_hash is None for b in blocks)
    pool.check_invariants()


def test_check_invariants_detects_corruption() -> None:
    pool = BlockPool(num_blocks=3, block_size=2, enable_prefix_caching=True)
    pool.block(1).ref_count = 1  # referenced yet still queued
    with pytest.raises(KVCacheStateError, match="block 1: ref_count 1 but in the free queue"):
        pool.check_invariants()
    pool.block(1).ref_count = 0
    pool.block(2).block_hash = _h("ghost")  # hash without a map entry
    with pytest.raises(KVCacheStateError, match="block 2: hash missing from the hash map"):
        pool.check_invariants()
    pool.block(2).block_hash = None
    pool.check_invariants()


# --- allocator -------------------------------------------------------------------------------


def test_shared_prefix_hits_exact_counts() -> None:
    alloc = _alloc(block_size=4)
    doc = list(range(100, 110))  # 2 full blocks + 2 tokens
    hit_a = alloc.allocate_for_prompt(request_id="a", token_ids=doc)
    assert hit_a is not None and hit_a.num_cached_tokens == 0
    assert len(hit_a.block_ids) == 3
    # a is not computed yet, so b shares nothing; b computes and caches its blocks first.
    assert _prefill(alloc, "b", doc) == 0
    b_blocks = alloc.block_table("b")
    # a's identical blocks are then not registered: b's entries keep serving hits.
    alloc.cache_blocks(request_id="a", token_ids=doc)
    assert [alloc.pool.block(i).block_hash for i in hit_a.block_ids] == [None, None, None]
    hit_c = alloc.allocate_for_prompt(request_id="c", token_ids=[*doc[:8], 1, 2, 3, 4, 5])
    assert hit_c is not None and hit_c.num_cached_tokens == 8
    assert list(hit_c.block_ids[:2]) == b_blocks[:2]
    assert len(hit_c.block_ids) == 4
    assert [alloc.pool.block(i).ref_count for i in b_blocks] == [2, 2, 1]
    # Sharing only part of the second block hits only the first.
    assert _prefill(alloc, "d", [*doc[:6], 0, 0, 0]) == 4
    # A different first block, or different extra keys, shares nothing.
    assert _prefill(alloc, "e", [0, *doc[1:]]) == 0
    hit_f = alloc.allocate_for_prompt(request_id="f", token_ids=doc, extra_keys=("lora-b",))
    assert hit_f is not None and hit_f.num_cached_tokens == 0
    assert alloc.prefix_cache_stats == PrefixCacheStats(
        queried_tokens=10 + 10 + 13 + 9 + 10 + 10, hit_tokens=8 + 4
    )
    assert alloc.prefix_cache_stats.hit_rate == pytest.approx(12 / 62)
    alloc.check_invariants()
    for rid in "abcdef":
        assert alloc.free(rid) is True
    assert alloc.num_free_blocks == 16
    alloc.check_invariants()


def test_prefix_lookup_reports_blocks_in_flight_until_computed_or_freed() -> None:
    alloc = _alloc(block_size=4)
    doc = list(range(100, 114))  # 3 full blocks + 2 tokens
    assert alloc.prefix_lookup(doc) == PrefixLookup(cached_tokens=0, in_flight_tokens=0)
    assert alloc.allocate_for_prompt(request_id="a", token_ids=doc) is not None
    # a holds its 3 full blocks uncomputed; a prompt sharing 2 of them would gain 8 tokens.
    assert alloc.prefix_lookup([*doc[:9], 7]) == PrefixLookup(cached_tokens=0, in_flight_tokens=8)
    assert alloc.prefix_lookup(doc) == PrefixLookup(cached_tokens=0, in_flight_tokens=12)
    alloc.cache_blocks(request_id="a", token_ids=doc[:4])  # a's first chunk lands
    assert alloc.prefix_lookup(doc) == PrefixLookup(cached_tokens=4, in_flight_tokens=8)
    alloc.check_invariants()
    # A second holder of the same blocks keeps them in flight after the first lets go.
    assert alloc.allocate_for_prompt(request_id="b", token_ids=[*doc[:8], 1]) is not None
    assert alloc.free("a") is True
    assert alloc.prefix_lookup(doc) == PrefixLookup(cached_tokens=4, in_flight_tokens=4)
    alloc.check_invariants()
    alloc.cache_blocks(request_id="b", token_ids=[*doc[:8], 1])
    assert alloc.prefix_lookup(doc) == PrefixLookup(cached_tokens=8, in_flight_tokens=0)
    assert alloc.free("b") is True
    alloc.check_invariants()
    assert not alloc._in_flight
    stats = alloc.prefix_cache_stats
    alloc.prefix_lookup(doc)
    assert alloc.prefix_cache_stats == stats  # lookups count nothing
    off = _alloc(caching=False)
    assert off.allocate_for_prompt(request_id="a", token_ids=doc) is not None
    assert off.prefix_lookup(doc) == PrefixLookup(cached_tokens=0, in_flight_tokens=0)


@pytest.mark.parametrize(
    ("prompt_len", "expected"),
    [
        (4, 0),  # one full block, fully cached: the last token is recomputed, so no hit
        (5, 4),
        (8, 4),  # fully cached: capped at 7 tokens, rounded down to the block boundary
        (9, 8),
        (12, 8),  # only 8 tokens were ever cached
        (13, 8),
    ],
)
def test_last_prompt_token_is_always_recomputed(prompt_len: int, expected: int) -> None:
    alloc = _alloc(block_size=4)
    tokens = list(range(50, 63))
    _prefill(alloc, "warm", tokens[:8])
    hit = alloc.allocate_for_prompt(request_id="q", token_ids=tokens[:prompt_len])
    assert hit is not None
    assert hit.num_cached_tokens == expected
    assert len(hit.block_ids) == -(-prompt_len // 4)
    alloc.check_invariants()


def test_decode_growth_and_caching_generated_tokens() -> None:
    alloc = _alloc(num_blocks=8, block_size=4)
    tokens = [7, 7, 7, 7, 8, 8]
    _prefill(alloc, "a", tokens)
    assert alloc.append_slots(request_id="a", num_new_tokens=0) == []
    assert alloc.append_slots(request_id="a", num_new_tokens=1) == []  # 7 tokens, 2 blocks
    assert alloc.append_slots(request_id="a", num_new_tokens=2) == [2]  # 9 tokens, 3 blocks
    assert alloc.block_table("a") == [0, 1, 2]
    tokens += [8, 8, 9]
    with pytest.raises(RequestError, match="token_ids: request 'a' has slots for only 9"):
        alloc.cache_blocks(request_id="a", token_ids=[*tokens, 1])
    alloc.cache_blocks(request_id="a", token_ids=tokens)
    assert alloc.pool.num_cached_blocks == 2
    hit = alloc.allocate_for_prompt(request_id="b", token_ids=tokens)
    assert hit is not None and hit.num_cached_tokens == 8
    assert hit.block_ids[:2] == (0, 1)
    alloc.check_invariants()


def test_append_slots_out_of_blocks_returns_none_or_raises_when_it_can_never_fit() -> None:
    alloc = _alloc(num_blocks=3, block_size=2)
    _prefill(alloc, "a", [1, 2, 3])
    _prefill(alloc, "b", [4])
    before = (_snapshot(alloc.pool), alloc.block_table("a"))
    assert alloc.append_slots(request_id="a", num_new_tokens=2) is None
    assert (_snapshot(alloc.pool), alloc.block_table("a")) == before
    with pytest.raises(RequestError, match="num_new_tokens: request 'a' would need 4 blocks"):
        alloc.append_slots(request_id="a", num_new_tokens=4)
    with pytest.raises(RequestError, match="num_new_tokens: must be a non-negative int"):
        alloc.append_slots(request_id="a", num_new_tokens=-1)
    alloc.free("b")  # preempt b, then a fits
    assert alloc.append_slots(request_id="a", num_new_tokens=2) == [2]
    alloc.check_invariants()


def test_prompt_allocation_counts_free_hit_blocks_as_taken() -> None:
    # Free-but-cached hit blocks leave the free queue when touched; a check that counted them
    # as free would pass here, then fail half-way and leak the touched hits.
    alloc = _alloc(num_blocks=4, block_size=2)
    _prefill(alloc, "a", [1, 2, 3, 4, 5])
    alloc.free("a")
    assert alloc.pool.free_block_ids() == [3, 2, 1, 0]
    _prefill(alloc, "x", [9])  # takes block 3
    before = _snapshot(alloc.pool)
    # 4 blocks: 2 hits (free, cached) + 2 new, but only 1 free block besides the hits.
    assert alloc.allocate_for_prompt(request_id="b", token_ids=[1, 2, 3, 4, 7, 8, 9]) is None
    assert _snapshot(alloc.pool) == before
    assert "b" not in alloc
    assert alloc.prefix_cache_stats.queried_tokens == 5 + 1
    hit = alloc.allocate_for_prompt(request_id="b", token_ids=[1, 2, 3, 4, 7])
    assert hit is not None
    assert (hit.num_cached_tokens, hit.block_ids) == (4, (0, 1, 2))
    alloc.check_invariants()


def test_a_prompt_larger_than_the_pool_is_a_request_error() -> None:
    alloc = _alloc(num_blocks=2, block_size=2)
    with pytest.raises(RequestError, match="token_ids: needs 3 blocks but the pool has 2"):
        alloc.allocate_for_prompt(request_id="a", token_ids=[1, 2, 3, 4, 5])
    with pytest.raises(RequestError, match="token_ids: the prompt is empty"):
        alloc.allocate_for_prompt(request_id="a", token_ids=[])
    assert alloc.num_free_blocks == 2


def test_free_releases_the_tail_first_so_the_prefix_survives_eviction() -> None:
    alloc = _alloc(num_blocks=4, block_size=2)
    prompt = [0, 1, 2, 3, 4, 5, 6]
    _prefill(alloc, "a", prompt)  # blocks 0..3, the first three cached
    alloc.free("a")
    assert alloc.pool.free_block_ids() == [3, 2, 1, 0]
    _prefill(alloc, "x", [100])  # takes block 3 (the uncached partial block)
    _prefill(alloc, "y", [200, 201])  # takes block 2, evicting a's third block
    alloc.free("x")
    alloc.free("y")
    assert _prefill(alloc, "again", prompt) == 4


def test_request_lifecycle_errors_and_idempotent_free() -> None:
    alloc = _alloc(num_blocks=4, block_size=2)
    _prefill(alloc, "a", [1, 2, 3])
    with pytest.raises(KVCacheStateError, match="request 'a' already has blocks"):
        alloc.allocate_for_prompt(request_id="a", token_ids=[1])
    assert alloc.free("a") is True
    assert alloc.free("a") is False
    with pytest.raises(KVCacheStateError, match="request 'a' has no blocks"):
        alloc.block_table("a")
    with pytest.raises(KVCacheStateError, match="request 'a' has no blocks"):
        alloc.append_slots(request_id="a", num_new_tokens=1)
    alloc.check_invariants()


def test_prefix_caching_off_never_hits() -> None:
    alloc = _alloc(num_blocks=8, block_size=2, caching=False)
    prompt = [1, 2, 3, 4, 5]
    assert _prefill(alloc, "a", prompt) == 0
    assert _prefill(alloc, "b", prompt) == 0
    alloc.free("a")
    assert _prefill(alloc, "c", prompt) == 0
    assert alloc.pool.num_cached_blocks == 0
    assert alloc.prefix_cache_stats == PrefixCacheStats(queried_tokens=0, hit_tokens=0)
    assert alloc.reset_prefix_cache() is False


def test_reset_prefix_cache_drops_hits() -> None:
    alloc = _alloc(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    _prefill(alloc, "a", prompt)
    assert alloc.reset_prefix_cache() is False
    alloc.free("a")
    assert alloc.reset_prefix_cache() is True
    assert _prefill(alloc, "b", prompt) == 0


def test_block_hashes_match_the_public_hash_function() -> None:
    alloc = _alloc(num_blocks=8, block_size=2)
    prompt = [5, 6, 7, 8, 9]
    _prefill(alloc, "a", prompt)
    table = alloc.block_table("a")
    hashes = hash_prompt_blocks(prompt, block_size=2)
    assert [alloc.pool.get_cached_block(h) for h in hashes] == [
        alloc.pool.block(table[0]),
        alloc.pool.block(table[1]),
    ]
