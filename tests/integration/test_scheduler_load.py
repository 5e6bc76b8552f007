"""The continuous-batching scheduler under load: random requests with early stops and
preemption all finish correctly, and every block and slot comes back.

The 500-request runs drive the real ``Engine``, ``Scheduler`` and block allocators against a
fake lane group whose paged "KV cache" stores token ids: each prefill row first checks that
the cached prefix it was promised really holds its tokens, and every next token is a hash of
the whole sequence read back through the page table. A wrong block table, a stale prefix
hit or a botched recompute after preemption therefore changes the output, and each request
is compared with a reference computed without any paging. A smaller real end-to-end load on
tiny-llama with a small pool checks the same on the real runtime, down to leak counters.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lane_fixtures import module_torch_thread  # noqa: F401  (autouse fixture)

from llmrt.runtime.decode import DecodeOutput
from llmrt.runtime.paged_kv_cache import KVCacheState
from llmrt.runtime.prefill.plan import PrefillRow
from llmrt.runtime.prefill.result_collector import PrefillOutput
from llmrt.runtime.trace_compiler import ArtifactState
from llmrt.sampling.params import SamplingParams
from llmrt.serving.engine import Engine
from llmrt.serving.llm import LLM
from llmrt.serving.request import Request, RequestStatus
from llmrt.weights.tokenizer import BYTE_EOS_TOKEN_ID, byte_tokenizer

BLOCK_SIZE = 16
LANE_CAPACITY = 4
WIDTH = 32  # page-table entries per row: 512 tokens


def next_token(sequence: Sequence[int]) -> int:
    """The fake model: a hash of the whole sequence; about 1 in 64 tokens is </s>."""
    h = 17
    for t in sequence:
        h = (h * 1_000_003 + t + 1) % (2**61 - 1)
    return BYTE_EOS_TOKEN_ID if (h >> 20) % 64 == 0 else h % 256


def reference(prompt: Sequence[int], params: SamplingParams) -> tuple[list[int], str]:
    """What a request must produce, computed without paging, batching or preemption."""
    seq, out = list(prompt), []
    while True:
        token = next_token(seq)
        out.append(token)
        seq.append(token)
        if token == BYTE_EOS_TOKEN_ID and not params.ignore_eos:
            return out, "stop"
        if token in params.stop_token_ids:
            return out, "stop"
        if len(out) >= params.max_tokens:
            return out, "length"


class FakeLaneGroup:
    """A lane group whose KV blocks hold token ids (``None`` before the first write)."""

    def __init__(self, *, lanes: int, num_blocks: int, fail_on_call: int | None = None) -> None:
        lane = SimpleNamespace(
            layout=SimpleNamespace(width=WIDTH),
            decode=SimpleNamespace(config=SimpleNamespace(vocab_size=258)),
        )
        self.lanes = [lane] * lanes
        self.lane_capacity = LANE_CAPACITY
        self.kv: list[list[list[int | None]]] = [
            [[None] * BLOCK_SIZE for _ in range(num_blocks)] for _ in range(lanes)
        ]
        self.calls = 0
        self.fail_on_call = fail_on_call
        self.max_prefill_rows = 0

    def _call(self) -> None:
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RuntimeError(f"injected device failure on call {self.calls}")

    def _lane(self, slot: int) -> int:
        assert 0 <= slot < LANE_CAPACITY * len(self.lanes), slot
        return slot // LANE_CAPACITY

    def prefill_forward(
        self,
        *,
        rows: Sequence[PrefillRow],
        sampling_params: Any,
        step_offsets: Any,
        history: Any,
    ) -> PrefillOutput:
        self._call()
        self.max_prefill_rows = max(self.max_prefill_rows, len(rows))
        assert len({r.slot for r in rows}) == len(rows), "two rows share a slot"
        read: set[tuple[int, int]] = set()
        written: set[tuple[int, int]] = set()
        out = []
        for row in rows:
            lane = self._lane(row.slot)
            shared = row.cached_tokens // BLOCK_SIZE
            reads = {(lane, b) for b in row.block_ids[:shared]}
            writes = {(lane, b) for b in row.block_ids[shared:]}
            # Rows may share read-only prefix blocks; a written block belongs to one row.
            assert written.isdisjoint(reads | writes), "a row touches a block another writes"
            assert read.isdisjoint(writes), "a row writes a block another reads"
            read |= reads
            written |= writes
            tokens = row.tokens.tolist()
            n, cached = len(tokens), row.cached_tokens
            assert cached % BLOCK_SIZE == 0 and 0 <= cached < n
            assert len(row.block_ids) == -(-n // BLOCK_SIZE)
            cache = self.kv[lane]
            for p in range(cached):
                held = cache[row.block_ids[p // BLOCK_SIZE]][p % BLOCK_SIZE]
                assert held == tokens[p], f"cached position {p} holds {held}, not {tokens[p]}"
            for p in range(cached, n):
                cache[row.block_ids[p // BLOCK_SIZE]][p % BLOCK_SIZE] = tokens[p]
            out.append(next_token(tokens))
        return PrefillOutput(tokens=torch.tensor(out), logits=None)

    def decode_forward(
        self,
        *,
        tokens: torch.Tensor,
        start_pos: torch.Tensor,
        page_table: torch.Tensor,
        sampling_params: Any,
        step_offsets: Any,
        history: Any,
    ) -> DecodeOutput:
        self._call()
        assert page_table.shape == (tokens.shape[0], WIDTH)
        out = [0] * tokens.shape[0]
        for row in range(tokens.shape[0]):
            table = page_table[row].tolist()
            if all(b < 0 for b in table):
                continue  # an empty slot
            cache = self.kv[self._lane(row)]
            pos = int(start_pos[row])
            seq = [cache[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(pos)]
            assert None not in seq, f"slot {row} reads an unwritten KV position"
            cache[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] = int(tokens[row])
            out[row] = next_token([*seq, int(tokens[row])])
        return DecodeOutput(tokens=torch.tensor(out), logits=None)


def make_engine(fake: FakeLaneGroup, *, num_blocks: int, prefix_caching: bool) -> Engine:
    return Engine(
        executor=fake,  # type: ignore[arg-type]
        tokenizer=byte_tokenizer(),
        num_blocks=[num_blocks] * len(fake.lanes),
        block_size=BLOCK_SIZE,
        prefix_caching=prefix_caching,
        max_num_batched_tokens=256,
        max_model_len=min(512, num_blocks * BLOCK_SIZE),
        max_num_seqs=LANE_CAPACITY * len(fake.lanes),
    )


def random_requests(count: int, *, seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of 1..200 byte ids (half start with one of 4 shared prefixes); 1..20 new
    tokens; a third stop on one of 12 token ids; one in ten ignores </s>."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(rng.randrange(16, 160))] for _ in range(4)]
    out = []
    for _ in range(count):
        length = rng.randint(1, 200)
        head = rng.choice(prefixes)[:length] if rng.random() < 0.5 else []
        prompt = head + [rng.randrange(256) for _ in range(length - len(head))]
        stops = rng.sample(range(256), 12) if rng.random() < 0.35 else []
        params = SamplingParams(
            temperature=0,
            max_tokens=rng.randint(1, 20),
            stop_token_ids=stops,
            ignore_eos=rng.random() < 0.1,
        )
        out.append((prompt, params))
    return out


def assert_pool_full(engine: Engine) -> None:
    scheduler = engine.scheduler
    assert not scheduler.waiting and not scheduler.running and not scheduler.has_work
    for allocator in scheduler.allocators:
        allocator.check_invariants()
        assert allocator.num_free_blocks == allocator.config.num_blocks
        assert not allocator._requests
    assert not engine._streams


@pytest.mark.parametrize(
    ("lanes", "prefix_caching"),
    [(1, True), (1, False), (2, True)],
    ids=["1-lane", "no-cache", "2-lanes"],
)
def test_500_random_requests_finish_correctly_and_return_every_block(
    lanes: int, prefix_caching: bool
) -> None:
    num_blocks = 30  # 480 tokens per lane for 4 slots of up to 220 tokens: preemption
    fake = FakeLaneGroup(lanes=lanes, num_blocks=num_blocks)
    engine = make_engine(fake, num_blocks=num_blocks, prefix_caching=prefix_caching)
    pending = random_requests(500, seed=lanes * 10 + prefix_caching)
    rng = random.Random(1)
    submitted: list[Request] = []
    while pending or engine.has_work:
        burst = rng.choice([0, 0, 1, 2, 3, 12])  # arrivals while running, sometimes a burst
        for _ in range(min(len(pending), burst)):
            prompt, params = pending.pop(0)
            submitted.append(
                engine.add_request(prompt_token_ids=prompt, params=params, index=len(submitted))
            )
        engine.step()
        assert engine.stats().steps < 50_000, "the scheduler stopped making progress"
    assert len(submitted) == 500 and all(r.finished for r in submitted)
    for request in submitted:
        tokens, reason = reference(request.prompt_token_ids, request.params)
        assert (request.output_token_ids, request.finish_reason) == (tokens, reason), (
            request.request_id
        )
    reasons = {r.finish_reason for r in submitted}
    assert reasons == {"stop", "length"}
    assert sum(1 for r in submitted if r.params.stop_token_ids and r.finish_reason == "stop") > 10
    stats = engine.stats()
    assert stats.preemptions > 0 and sum(r.preemptions for r in submitted) == stats.preemptions
    assert fake.max_prefill_rows > 1  # waves of several prompts really happened
    if prefix_caching:
        assert stats.prefix_hit_tokens > 0
    else:
        assert stats.prefix_hit_tokens == 0
    assert_pool_full(engine)


def test_prefix_hits_admitted_together_share_one_prefill_call() -> None:
    """Four prompts hit the same cached prefix in one step; they share its read-only blocks
    in one prefill call (the fake checks no written block is shared), with correct results."""
    fake = FakeLaneGroup(lanes=1, num_blocks=64)
    engine = make_engine(fake, num_blocks=64, prefix_caching=True)
    rng = random.Random(2)
    prefix = [rng.randrange(256) for _ in range(70)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = engine.add_request(prompt_token_ids=prefix, params=params, index=0)
    while engine.has_work:
        engine.step()
    tails = [[rng.randrange(256) for _ in range(n)] for n in (1, 5, 20, 40)]
    requests = [
        engine.add_request(prompt_token_ids=prefix + tail, params=params, index=i)
        for i, tail in enumerate(tails)
    ]
    calls = fake.calls
    engine.step()
    assert fake.calls - calls == 1  # one prefill call for every request sharing the prefix
    assert all(r.num_computed_tokens == r.num_tokens - 1 for r in requests)
    while engine.has_work:
        engine.step()
    for request in [first, *requests]:
        assert request.output_token_ids == reference(request.prompt_token_ids, params)[0]
    assert engine.stats().prefix_hit_tokens == 4 * 64
    assert_pool_full(engine)


def test_requests_arriving_together_wait_for_a_shared_prefix_in_flight() -> None:
    """Submitted in one step, prompts sharing a long prefix do not each compute it: the
    first computes it, the rest wait for its blocks and hit them; a prompt that would gain
    little from waiting (in-flight share under half its prompt) is admitted at once."""
    fake = FakeLaneGroup(lanes=1, num_blocks=64)
    engine = make_engine(fake, num_blocks=64, prefix_caching=True)
    rng = random.Random(4)
    prefix = [rng.randrange(256) for _ in range(5 * BLOCK_SIZE)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    sharers = [
        engine.add_request(
            prompt_token_ids=prefix + [rng.randrange(256) for _ in range(5)], params=params, index=i
        )
        for i in range(3)
    ]
    engine.step()
    assert [r.status for r in sharers] == [
        RequestStatus.DECODING,
        RequestStatus.WAITING,
        RequestStatus.WAITING,
    ]
    while engine.has_work:
        engine.step()
    for request in sharers:
        assert request.output_token_ids == reference(request.prompt_token_ids, params)[0]
    assert [r.prefill_tokens_computed for r in sharers] == [5 * BLOCK_SIZE + 5, 5, 5]
    assert engine.stats().prefix_hit_tokens == 2 * 5 * BLOCK_SIZE
    assert_pool_full(engine)
    # Sharing one block of a 5-block prompt: not worth a step's wait.
    other = [rng.randrange(256) for _ in range(5 * BLOCK_SIZE)]
    first = engine.add_request(prompt_token_ids=other, params=params, index=3)
    second = engine.add_request(
        prompt_token_ids=other[:BLOCK_SIZE] + [rng.randrange(256) for _ in range(4 * BLOCK_SIZE)],
        params=params,
        index=4,
    )
    engine.step()
    assert first.status is second.status is RequestStatus.DECODING
    while engine.has_work:
        engine.step()
    assert_pool_full(engine)


def test_a_failed_step_aborts_cleanly_and_the_engine_serves_again() -> None:
    fake = FakeLaneGroup(lanes=2, num_blocks=24, fail_on_call=15)
    engine = make_engine(fake, num_blocks=24, prefix_caching=True)
    batch = random_requests(40, seed=3)
    requests = [
        engine.add_request(prompt_token_ids=p, params=s, index=i) for i, (p, s) in enumerate(batch)
    ]
    with pytest.raises(RuntimeError, match="injected device failure"):
        while engine.has_work:
            engine.step()
    assert engine.scheduler.running  # the failure left requests in flight...
    engine.abort_all()
    assert_pool_full(engine)  # ...and aborting gave every block and slot back
    assert all(r.finished for r in requests)
    assert {r.finish_reason for r in requests} >= {"abort"}
    again = [
        engine.add_request(prompt_token_ids=p, params=s, index=i) for i, (p, s) in enumerate(batch)
    ]
    while engine.has_work:
        engine.step()
    for request in again:
        tokens, reason = reference(request.prompt_token_ids, request.params)
        assert (request.output_token_ids, request.finish_reason) == (tokens, reason)
    assert_pool_full(engine)


def test_real_load_with_preemption_matches_an_unconstrained_run() -> None:
    """60 random requests on tiny-llama with a 24-block pool (preemption) and 2 lanes give
    the same tokens as one roomy lane, and the runtime leaks nothing after ``close``."""
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 200))] for _ in range(60)]
    params = [  # half greedy, half seeded sampling: both must survive recomputation
        SamplingParams(
            temperature=0 if i % 2 else 1.0,
            seed=None if i % 2 else i,
            max_tokens=rng.randint(1, 20),
            stop_token_ids=rng.sample(range(256), 12) if rng.random() < 0.35 else [],
        )
        for i in range(len(prompts))
    ]
    with LLM.from_recipe("tiny-llama", overrides={"trace.mode": "none"}) as roomy:
        expected = [(o.token_ids, o.finish_reason) for o in roomy.generate(prompts, params)]
    small = {"kv_cache.num_blocks": 24, "lanes": 2}
    llm = LLM.from_recipe("tiny-llama", overrides=small)
    try:
        got = [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]
        stats = llm.stats()
        allocators = llm.engine.scheduler.allocators
        scheduler = llm.engine.scheduler
        assert not scheduler.running and not scheduler.waiting
        for allocator in allocators:
            allocator.check_invariants()
            assert allocator.num_free_blocks == allocator.config.num_blocks == 24
        devices = llm.container.device.lane_devices()
        traces = [lane.trace_compiler() for lane in llm.container.lanes()]
        lanes = llm.engine.executor.lanes
    finally:
        llm.close()
    assert got == expected
    assert stats.preemptions > 0
    assert {reason for _, reason in got} == {"stop", "length"}
    for device in devices:
        device_stats = device.stats()
        assert (
            device_stats.live_tensors,
            device_stats.live_traces,
            device_stats.pending_reads,
        ) == (0, 0, 0)
        assert device_stats.replays > 0
    for lane in lanes:
        assert lane.kv_cache.state is KVCacheState.RELEASED and not lane.kv_cache.orphans
    assert all(a.state is ArtifactState.RELEASED for t in traces for a in t.artifacts.values())


def test_the_engine_steps_within_the_recipes_budget_on_the_cpu() -> None:
    """Unset, the budget is the CPU's (512 prompt tokens a step): of two 300-token prompts
    the first step prefills one whole and the other only up to the budget."""
    overrides: dict[str, Any] = {"serving.max_num_batched_tokens": None, "trace.mode": "none"}
    with LLM.from_recipe("tiny-llama", overrides=overrides) as llm:
        scheduler = llm.engine.scheduler
        assert scheduler.config.max_num_batched_tokens == 512
        rng = random.Random(0)
        for index in range(2):
            llm.engine.add_request(
                prompt_token_ids=[rng.randrange(3, 256) for _ in range(300)],
                params=SamplingParams(max_tokens=1),
                index=index,
            )
        plan = scheduler.schedule()
        spans = [(w.start, w.end) for w in plan.prefill]
        assert spans[0] == (0, 300) and len(spans) == 2
        assert spans[1][0] == 0 and 512 - llm.recipe.kv_cache.block_size < 300 + spans[1][1] <= 512
