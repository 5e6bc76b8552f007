"""Random allocate / compute / decode / preempt / free sequences against a model of the KV.

Besides the pool's own invariants, the machine keeps a fake KV store: writing a token slot
records the token prefix it belongs to. Every prefix hit must then point at blocks whose
recorded prefix is exactly the new prompt's, and a request may only write blocks it holds
alone, so a stale cache entry or a shared block being overwritten fails here.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from llmrt.errors import RequestError
from llmrt.serving.block_hash import ExtraKeys, hash_prompt_blocks
from llmrt.serving.block_pool import BlockAllocator, BlockPool, KVBlock

# A few fixed documents over a tiny vocabulary, so random prompts share prefixes often.
_rng = random.Random(7)
DOCS = [[_rng.randrange(3) for _ in range(24)] for _ in range(2)]
EXTRA_KEYS: list[ExtraKeys] = [(), (), ("lora-a",)]


def _snapshot(pool: BlockPool) -> object:
    n = pool.config.num_blocks
    return (
        pool.free_block_ids(),
        [(pool.block(i).ref_count, pool.block(i).block_hash) for i in range(n)],
    )


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc: BlockAllocator | None = None
        self.tokens: dict[str, list[int]] = {}  # tokens that have slots
        self.computed: dict[str, int] = {}  # leading tokens whose KV is written
        self.extra: dict[str, ExtraKeys] = {}
        self.kv: dict[int, tuple[ExtraKeys, tuple[int, ...]]] = {}  # block -> prefix it holds
        self.next_id = 0

    @property
    def a(self) -> BlockAllocator:
        assert self.alloc is not None
        return self.alloc

    @initialize(
        num_blocks=st.integers(3, 16),
        block_size=st.sampled_from([1, 2, 3, 4]),
        caching=st.booleans(),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.alloc = BlockAllocator(
            num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=caching
        )

    def _try_allocate(self, rid: str, prompt: list[int], extra: ExtraKeys) -> None:
        a, bs = self.a, self.a.config.block_size
        if -(-len(prompt) // bs) > a.config.num_blocks:
            try:
                a.allocate_for_prompt(request_id=rid, token_ids=prompt, extra_keys=extra)
            except RequestError:
                return
            raise AssertionError("an oversized prompt was accepted")
        # The longest cached chain, capped so the last prompt token is recomputed.
        expected: list[KVBlock] = []
        if a.config.enable_prefix_caching:
            for h in hash_prompt_blocks(prompt, block_size=bs, extra_keys=extra):
                block = a.pool.get_cached_block(h)
                if block is None or len(expected) == (len(prompt) - 1) // bs:
                    break
                expected.append(block)
        free_after_touch = a.num_free_blocks - sum(b.ref_count == 0 for b in expected)
        fits = -(-len(prompt) // bs) - len(expected) <= free_after_touch
        before = _snapshot(a.pool)
        hit = a.allocate_for_prompt(request_id=rid, token_ids=prompt, extra_keys=extra)
        event(f"prompt: {'refused' if hit is None else 'hit' if expected else 'miss'}")
        if hit is None:
            assert not fits
            assert _snapshot(a.pool) == before
            assert rid not in a
            return
        assert fits
        assert hit.num_cached_tokens == len(expected) * bs < len(prompt)
        assert list(hit.block_ids[: len(expected)]) == [b.block_id for b in expected]
        assert len(hit.block_ids) == -(-len(prompt) // bs)
        for i, block_id in enumerate(hit.block_ids[: len(expected)]):
            assert self.kv[block_id] == (extra, tuple(prompt[: (i + 1) * bs]))
        self.tokens[rid] = list(prompt)
        self.computed[rid] = hit.num_cached_tokens
        self.extra[rid] = extra

    @rule(
        doc=st.sampled_from(DOCS),
        shared=st.integers(0, 24),
        suffix=st.lists(st.integers(0, 2), max_size=6),
        extra=st.sampled_from(EXTRA_KEYS),
    )
    def allocate(self, doc: list[int], shared: int, suffix: list[int], extra: ExtraKeys) -> None:
        prompt = doc[:shared] + suffix
        if not prompt:
            return
        self.next_id += 1
        self._try_allocate(f"r{self.next_id}", prompt, extra)

    @precondition(lambda self: any(self.computed[r] < len(self.tokens[r]) for r in self.tokens))
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        """A (chunked) prefill or decode step writes KV, then the completed blocks are cached."""
        a, bs = self.a, self.a.config.block_size
        rid = data.draw(
            st.sampled_from(
                sorted(r for r in self.tokens if self.computed[r] < len(self.tokens[r]))
            )
        )
        tokens, start = self.tokens[rid], self.computed[rid]
        end = data.draw(st.integers(start + 1, len(tokens)))
        table = a.block_table(rid)
        for pos in range(start, end):
            block_id = table[pos // bs]
            assert a.pool.block(block_id).ref_count == 1, "write into a shared block"
            self.kv[block_id] = (self.extra[rid], tuple(tokens[: pos + 1]))
        a.cache_blocks(request_id=rid, token_ids=tokens[:end])
        self.computed[rid] = end

    @precondition(lambda self: any(self.computed[r] == len(self.tokens[r]) for r in self.tokens))
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def decode(self, data: st.DataObject, new: list[int]) -> None:
        """Reserve slots for sampled tokens of a fully computed request."""
        a, bs = self.a, self.a.config.block_size
        rid = data.draw(
            st.sampled_from(
                sorted(r for r in self.tokens if self.computed[r] == len(self.tokens[r]))
            )
        )
        table_before = a.block_table(rid)
        total = len(self.tokens[rid]) + len(new)
        num_new_blocks = -(-total // bs) - len(table_before)
        before = _snapshot(a.pool)
        if -(-total // bs) > a.config.num_blocks:
            try:
                a.append_slots(request_id=rid, num_new_tokens=len(new))
            except RequestError:
                assert _snapshot(a.pool) == before
                return
            raise AssertionError("growth beyond the pool was accepted")
        added = a.append_slots(request_id=rid, num_new_tokens=len(new))
        event(f"decode: {'refused' if added is None else 'granted'}")
        if added is None:
            assert num_new_blocks > a.num_free_blocks
            assert _snapshot(a.pool) == before
            assert a.block_table(rid) == table_before
            return
        assert len(added) == num_new_blocks
        assert a.block_table(rid) == table_before + added
        self.tokens[rid] += new

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), resume=st.booleans())
    def free(self, data: st.DataObject, resume: bool) -> None:
        """Finish a request, or preempt it and (maybe) re-admit it to recompute."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens, extra = self.tokens.pop(rid), self.extra.pop(rid)
        del self.computed[rid]
        assert self.a.free(rid) is True
        assert self.a.free(rid) is False
        if resume:
            self._try_allocate(rid, tokens, extra)

    @invariant()
    def pool_is_consistent(self) -> None:
        if self.alloc is None:
            return
        a = self.alloc
        a.check_invariants()
        held = {b for r in self.tokens for b in a.block_table(r)}
        assert a.num_free_blocks == a.config.num_blocks - len(held)
        assert set(a.pool.free_block_ids()).isdisjoint(held)
        stats = a.prefix_cache_stats
        assert 0 <= stats.hit_tokens <= stats.queried_tokens

    def teardown(self) -> None:
        if self.alloc is None:
            return
        for rid in list(self.tokens):
            self.alloc.free(rid)
        self.alloc.check_invariants()
        n = self.alloc.config.num_blocks
        assert self.alloc.num_free_blocks == n
        assert all(self.alloc.pool.block(i).ref_count == 0 for i in range(n))
        assert sorted(self.alloc.pool.free_block_ids()) == list(range(n))


AllocatorMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocatorMachine = AllocatorMachine.TestCase
