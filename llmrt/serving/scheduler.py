"""Continuous batching over fixed-capacity decode slots.

Each ``step``: reserve a KV slot for the next token of every request that has
its first token (when blocks run out, the newest running request is preempted,
its blocks freed, and recomputed later from its prompt plus the tokens it
already generated); unless that preempted anything, admit waiting requests into
free slots (a slot's lane owns that request's KV blocks; prefix hits become
cached-token offsets; a request whose prefix another request is computing right now
waits for those blocks instead of computing them again); then prefill what fits the
token budget (long prompts advance one block-aligned chunk per step) and decode the
reserved requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import attrs

from llmrt.errors import RequestError
from llmrt.serving.block_pool import BlockAllocator, PrefixLookup
from llmrt.serving.request import Request, RequestStatus


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    num_lanes: int
    lane_capacity: int
    block_size: int
    max_num_batched_tokens: int
    max_model_len: int
    max_num_seqs: int

    @property
    def capacity(self) -> int:
        return self.num_lanes * self.lane_capacity


@attrs.frozen(kw_only=True)
class PrefillWork:
    """One request's prefill chunk this step: tokens ``[0, end)``, of which ``start`` cached."""

    request: Request
    start: int
    end: int
    block_ids: tuple[int, ...]

    @property
    def completes_prompt(self) -> bool:
        return self.end == self.request.num_tokens


@attrs.frozen(kw_only=True)
class StepPlan:
    prefill: tuple[PrefillWork, ...]
    decode: tuple[Request, ...]
    preempted: tuple[Request, ...]


class Scheduler:
    """Owns the waiting queue, slot assignment and each lane's block allocator."""

    def __init__(self, *, config: SchedulerConfig, allocators: Sequence[BlockAllocator]) -> None:
        if len(allocators) != config.num_lanes:
            raise RequestError("allocators", f"need one per lane ({config.num_lanes})")
        self.config = config
        self.allocators = tuple(allocators)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}

    # -- bookkeeping ---------------------------------------------------------------------

    def add(self, request: Request) -> None:
        if request.num_tokens > self.config.max_model_len:
            raise RequestError(
                "prompt",
                f"has {request.num_tokens} tokens, more than "
                f"serving.max_model_len={self.config.max_model_len}",
                row=request.index,
            )
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def lane_of(self, request: Request) -> int:
        if request.slot is None:
            raise RequestError("slot", f"request {request.request_id} holds no slot")
        return request.slot // self.config.lane_capacity

    def allocator_of(self, request: Request) -> BlockAllocator:
        return self.allocators[self.lane_of(request)]

    def block_table(self, request: Request) -> list[int]:
        return self.allocator_of(request).block_table(request.request_id)

    def _free_slot(self) -> int | None:
        """The free slot on the lane with the most free slots (spreads load over lanes)."""
        cap = self.config.lane_capacity
        best: tuple[int, int] | None = None
        for lane in range(self.config.num_lanes):
            free = [s for s in range(lane * cap, (lane + 1) * cap) if s not in self.running]
            if free and (best is None or len(free) > best[0]):
                best = (len(free), free[0])
        return None if best is None else best[1]

    def finish(self, request: Request, reason: str) -> None:
        """Free the request's slot and blocks now."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request.slot is not None:
            self.allocator_of(request).free(request.request_id)
            self.running.pop(request.slot, None)
            request.slot = None

    def preempt(self, request: Request) -> None:
        """Give the request's slot and blocks back; it recomputes from its tokens later."""
        if request.slot is not None:
            self.allocator_of(request).free(request.request_id)
            self.running.pop(request.slot, None)
            request.slot = None
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.preemptions += 1
        self.waiting.appendleft(request)

    def abort(self, request: Request) -> bool:
        """Finish one request as aborted wherever it is (queued or running); its slot and
        blocks return now. False when it had already finished."""
        if request.finished:
            return False
        if request.slot is None:
            try:
                self.waiting.remove(request)
            except ValueError:
                return False
        self.finish(request, "abort")
        return True

    def abort_all(self) -> None:
        for request in [*self.running.values(), *self.waiting]:
            self.finish(request, "abort")
        self.waiting.clear()

    # -- scheduling ----------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        preempted: list[Request] = []
        # Running requests first: admitting before reserving would hand new prompts the
        # blocks that decode needs and then preempt them again in the same step.
        decode = self._reserve_decode(preempted)
        if not preempted:
            self._admit()
        prefill = self._prefill_work(budget=self.config.max_num_batched_tokens)
        return StepPlan(prefill=tuple(prefill), decode=tuple(decode), preempted=tuple(preempted))

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            slot = self._free_slot()
            if slot is None:
                return
            request = self.waiting[0]
            allocator = self.allocators[slot // self.config.lane_capacity]
            tokens = request.all_token_ids
            if self._wait_for_prefix(allocator.prefix_lookup(tokens), num_tokens=len(tokens)):
                return
            hit = allocator.allocate_for_prompt(request_id=request.request_id, token_ids=tokens)
            if hit is None:
                return  # out of blocks: wait until running requests free some
            self.waiting.popleft()
            request.slot = slot
            request.status = RequestStatus.PREFILLING
            request.num_computed_tokens = hit.num_cached_tokens
            self.running[slot] = request

    @staticmethod
    def _wait_for_prefix(lookup: PrefixLookup, *, num_tokens: int) -> bool:
        """Hold a request back while a running request computes most of its prefix.

        Requests that arrive together with a shared prefix would otherwise all miss the
        cache and compute the prefix once each. Waiting costs at most the steps the
        running request needs to reach those blocks (it is prefilled first-come first-served,
        so it progresses every step), and pays off once the blocks in flight cover at least
        half of what this request would compute now. FCFS: nothing behind it is admitted
        ahead of it meanwhile.
        """
        return lookup.in_flight_tokens * 2 >= num_tokens - lookup.cached_tokens > 0

    def _reserve_decode(self, preempted: list[Request]) -> list[Request]:
        """Reserve a KV slot for each decoding request's next token, preempting if needed."""
        decoding = sorted(
            (r for r in self.running.values() if r.status is RequestStatus.DECODING),
            key=lambda r: r.arrival,
        )
        ready: list[Request] = []
        while decoding:
            request = decoding.pop(0)
            allocator = self.allocator_of(request)
            while allocator.append_slots(request_id=request.request_id, num_new_tokens=1) is None:
                victim = self._newest_on_lane(self.lane_of(request))
                self.preempt(victim)
                preempted.append(victim)
                if victim in decoding:
                    decoding.remove(victim)
                if victim is request:
                    break
            if request.slot is not None:
                ready.append(request)
        return ready

    def _newest_on_lane(self, lane: int) -> Request:
        cap = self.config.lane_capacity
        on_lane = [r for s, r in self.running.items() if s // cap == lane]
        return max(on_lane, key=lambda r: r.arrival)

    def _prefill_work(self, *, budget: int) -> list[PrefillWork]:
        work: list[PrefillWork] = []
        bs = self.config.block_size
        prefilling = sorted(
            (r for r in self.running.values() if r.status is RequestStatus.PREFILLING),
            key=lambda r: r.arrival,
        )
        for request in prefilling:
            if budget <= 0:
                break
            start = request.num_computed_tokens
            remaining = request.num_tokens - start
            take = remaining if remaining <= budget else (budget // bs) * bs
            if take <= 0:
                break
            end = start + take
            table = tuple(self.block_table(request))
            work.append(PrefillWork(request=request, start=start, end=end, block_ids=table))
            budget -= take
        return work
