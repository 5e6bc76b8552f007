"""The serving engine: scheduler steps driven through the lane group.

One ``step`` runs the scheduler's plan: one prefill call (the runtime's planner
batches compatible rows into padded waves and chunks the rest) for the requests
admitted or still prefilling, then a decode over the slot batch (up to the highest
occupied slot; each lane pads it to its smallest decode batch that fits) for every
request that already had its first token. Finished requests give
back their slot and blocks immediately.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch

from llmrt.errors import RequestError, UnsupportedError
from llmrt.runtime.decode import DecodeOutput
from llmrt.runtime.lane_group import LaneGroupExecutor
from llmrt.runtime.prefill.plan import PrefillRow
from llmrt.runtime.prefill.result_collector import PrefillOutput
from llmrt.sampling.params import SamplingParams
from llmrt.serving.block_pool import BlockAllocator
from llmrt.serving.request import Request, RequestStatus
from llmrt.serving.scheduler import PrefillWork, Scheduler, SchedulerConfig
from llmrt.weights.tokenizer import DetokenizerStream, Tokenizer

if TYPE_CHECKING:  # imported where first used: llguidance costs ~3 MiB and 20 ms
    from llmrt.sampling.guided import GuidedDecoding


@attrs.frozen(kw_only=True)
class TokenEvent:
    """One generated token of one request (what a stream yields)."""

    index: int
    request_id: str
    token_id: int
    text: str
    finished: bool
    finish_reason: str | None
    error: RequestError | None = None
    """Why the request failed (``finish_reason`` ``"error"``); the others run on."""


@attrs.frozen(kw_only=True)
class EngineStats:
    prefill_tokens_computed: int
    prefix_hit_tokens: int
    prefix_queried_tokens: int
    preemptions: int
    steps: int


class Engine:
    """Drives one lane group with a continuous-batching scheduler (borrows the group)."""

    def __init__(
        self,
        *,
        executor: LaneGroupExecutor,
        tokenizer: Tokenizer,
        num_blocks: Sequence[int],
        block_size: int,
        prefix_caching: bool,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_num_seqs: int,
    ) -> None:
        self.executor = executor
        self.tokenizer = tokenizer
        allocators = [
            BlockAllocator(
                num_blocks=n, block_size=block_size, enable_prefix_caching=prefix_caching
            )
            for n in num_blocks
        ]
        self.scheduler = Scheduler(
            config=SchedulerConfig(
                num_lanes=len(executor.lanes),
                lane_capacity=executor.lane_capacity,
                block_size=block_size,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
            ),
            allocators=allocators,
        )
        self.width = executor.lanes[0].layout.width
        self._ids = itertools.count()
        self._streams: dict[str, DetokenizerStream] = {}
        self._steps = 0
        self._preemptions = 0
        self._prefill_tokens = 0
        self._guided: GuidedDecoding | None = None

    @property
    def guided(self) -> GuidedDecoding:
        """The structured-output compiler for this engine's tokenizer (built on first use)."""
        if self._guided is None:
            from llmrt.sampling.guided import GuidedDecoding

            eos = self.tokenizer.eos_token_ids
            if not eos:
                raise UnsupportedError(
                    "structured_output: the tokenizer has no end-of-text token to close a "
                    "completed output with"
                )
            self._guided = GuidedDecoding(
                tokenizer_json=self.tokenizer.backend.to_str(),
                eos_token_id=eos[0],
                vocab_size=self.executor.lanes[0].decode.config.vocab_size,
            )
        return self._guided

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self, *, prompt_token_ids: Sequence[int], params: SamplingParams, index: int
    ) -> Request:
        ids = tuple(int(t) for t in prompt_token_ids)
        if not ids:
            raise RequestError("prompt", "is empty", row=index)
        if params.logprobs is not None and len(self.executor.lanes) > 1:
            raise UnsupportedError(
                f"logprobs: not supported with {len(self.executor.lanes)} data-parallel lanes "
                "(log-probabilities are not aggregated across lanes); use lanes=1"
            )
        vocab = self.executor.lanes[0].decode.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                "prompt_token_ids", f"token id out of range [0, {vocab})", row=index, value=bad[0]
            )
        if params.structured_output is not None:
            # Each request owns its live constraint; the params it came with stay shareable.
            params = attrs.evolve(
                params, constraint=self.guided.constraint(params.structured_output)
            )
        number = next(self._ids)
        request = Request(
            request_id=f"req-{number}",
            index=index,
            prompt_token_ids=ids,
            params=params,
            arrival=number,
            arrival_time=time.perf_counter(),
        )
        self.scheduler.add(request)
        self._streams[request.request_id] = self.tokenizer.stream()
        return request

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def abort(self, request: Request) -> bool:
        """Abort one request between steps: its slot and KV blocks return at once.

        Returns False when it had already finished (nothing to give back).
        """
        aborted = self.scheduler.abort(request)
        self._streams.pop(request.request_id, None)
        return aborted

    def abort_all(self) -> None:
        """Finish every queued and running request as aborted, returning slots and blocks."""
        self.scheduler.abort_all()
        self._streams.clear()

    def stats(self) -> EngineStats:
        hit = sum(a.prefix_cache_stats.hit_tokens for a in self.scheduler.allocators)
        queried = sum(a.prefix_cache_stats.queried_tokens for a in self.scheduler.allocators)
        return EngineStats(
            prefill_tokens_computed=self._prefill_tokens,
            prefix_hit_tokens=hit,
            prefix_queried_tokens=queried,
            preemptions=self._preemptions,
            steps=self._steps,
        )

    # -- stepping ------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        """One scheduler step; returns the tokens it produced."""
        plan = self.scheduler.schedule()
        self._steps += 1
        self._preemptions += len(plan.preempted)
        # Prefill first: the prompts admitted this step get their first token one decode
        # step sooner, while running requests keep the same cadence (one prefill between
        # two decodes either way). The two touch disjoint requests and blocks.
        events: list[TokenEvent] = []
        if plan.prefill:
            events.extend(self._prefill(plan.prefill))
        if plan.decode:
            events.extend(self._decode(plan.decode))
        return events

    def run(self) -> Iterator[TokenEvent]:
        """Step until every request finished."""
        while self.has_work:
            yield from self.step()

    def _history(
        self, requests: Sequence[Request | None]
    ) -> list[tuple[Sequence[int], Sequence[int]]] | None:
        if not any(r is not None and r.params.has_penalties for r in requests):
            return None
        return [
            ((), ()) if r is None else (r.prompt_token_ids, r.output_token_ids) for r in requests
        ]

    def _prefill(self, work: Sequence[PrefillWork]) -> list[TokenEvent]:
        """Prefill the step's chunks in one runtime call.

        The planner batches compatible rows into warmed padded waves and lets rows share
        their read-only prefix-cache blocks, so no regrouping is needed here.
        """
        return self._after_prefill(work, self._prefill_forward(work))

    def _prefill_forward(self, work: Sequence[PrefillWork]) -> PrefillOutput:
        rows = []
        for i, w in enumerate(work):
            tokens = torch.tensor(w.request.all_token_ids[: w.end], dtype=torch.int64)
            n_blocks = -(-w.end // self.scheduler.config.block_size)
            rows.append(
                PrefillRow(
                    source_row=i,
                    tokens=tokens,
                    cached_tokens=w.start,
                    slot=int(w.request.slot or 0),
                    block_ids=w.block_ids[:n_blocks],
                )
            )
        return self.executor.prefill_forward(
            rows=rows,
            sampling_params=[w.request.params for w in work],
            step_offsets=[len(w.request.output_token_ids) for w in work],
            history=self._history([w.request for w in work]),
        )

    def _after_prefill(self, work: Sequence[PrefillWork], out: PrefillOutput) -> list[TokenEvent]:
        events = []
        for i, w in enumerate(work):
            request = w.request
            self._prefill_tokens += w.end - w.start
            request.prefill_tokens_computed += w.end - w.start
            request.num_computed_tokens = w.end
            allocator = self.scheduler.allocator_of(request)
            allocator.cache_blocks(
                request_id=request.request_id, token_ids=request.all_token_ids[: w.end]
            )
            if not w.completes_prompt:
                continue
            request.status = RequestStatus.DECODING
            if out.tokens is None:
                raise RuntimeError("prefill returned no tokens")
            events.append(
                self._accept(request, int(out.tokens[i]), out.logprobs, i, out.top_logprobs)
            )
        return events

    def _decode(self, requests: Sequence[Request]) -> list[TokenEvent]:
        cap = self.scheduler.config.capacity
        by_slot: list[Request | None] = [None] * cap
        for r in requests:
            by_slot[int(r.slot or 0)] = r
        last = max(int(r.slot or 0) for r in requests) + 1
        # Built as numpy arrays and wrapped once: element writes into torch tensors are
        # dispatched ops (~5 us each), paid for every row of every step.
        tokens = np.zeros(last, dtype=np.int64)
        positions = np.zeros(last, dtype=np.int32)
        table = np.full((last, self.width), -1, dtype=np.int32)
        params: list[SamplingParams | None] = [None] * last
        offsets = [0] * last
        for slot in range(last):
            held = by_slot[slot]
            if held is None:
                continue
            tokens[slot] = held.output_token_ids[-1]
            positions[slot] = held.num_tokens - 1
            blocks = self.scheduler.block_table(held)
            table[slot, : len(blocks)] = blocks
            params[slot] = held.params
            offsets[slot] = len(held.output_token_ids)
        out = self.executor.decode_forward(
            tokens=torch.from_numpy(tokens),
            start_pos=torch.from_numpy(positions),
            page_table=torch.from_numpy(table),
            sampling_params=params,
            step_offsets=offsets,
            history=self._history(by_slot[:last]),
        )
        if not isinstance(out, DecodeOutput) or out.tokens is None:
            raise RuntimeError("decode returned no tokens")
        events = []
        chosen = out.tokens.tolist()
        for r in requests:
            slot = int(r.slot or 0)
            r.num_computed_tokens = r.num_tokens
            events.append(self._accept(r, int(chosen[slot]), out.logprobs, slot, out.top_logprobs))
        return events

    # -- outputs -------------------------------------------------------------------------

    def _accept(
        self,
        request: Request,
        token: int,
        logprobs: torch.Tensor | None,
        row: int,
        top: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> TokenEvent:
        now = time.perf_counter()
        if request.first_token_time is None:
            request.first_token_time = now
        request.token_times.append(now)
        request.output_token_ids.append(token)
        if request.params.logprobs is not None and logprobs is not None:
            request.logprobs.append(float(logprobs[row]))
            if top is not None and request.params.logprobs:
                n = request.params.logprobs
                request.top_logprobs.append(
                    {
                        int(i): float(v)
                        for v, i in zip(
                            top[0][row, :n].tolist(), top[1][row, :n].tolist(), strict=True
                        )
                    }
                )
        stream = self._streams[request.request_id]
        reason: str | None
        if self._is_stop_token(request.params, token):
            # Its text stays out of the output, as vLLM's (include_stop_str_in_output=False);
            # what earlier tokens held back (a partial character) comes out now.
            request.text += stream.flush()
            reason = "stop_token"
        else:
            request.text += stream.push(token)
            reason = self._stop_reason(request)
        constraint = request.params.constraint
        if constraint is not None and reason is None:
            if not constraint.accept(token):
                return self._fail(request, token, constraint.error)
            if constraint.finished:
                reason = "stop"
        if reason is not None:
            if reason in ("stop_string", "stop_token"):
                reason = "stop"  # the text is final: cut at the stop string, or flushed above
            else:
                request.text += stream.flush()
            self.scheduler.finish(request, reason)
            del self._streams[request.request_id]
        return TokenEvent(
            index=request.index,
            request_id=request.request_id,
            token_id=token,
            text=self._unstreamed_text(request),
            finished=request.finished,
            finish_reason=request.finish_reason,
        )

    def _unstreamed_text(self, request: Request) -> str:
        """Text not yet streamed, holding back a tail that may still become a stop string.

        The deltas of one request concatenate to its final ``text``: a stop string split over
        several tokens is never streamed before it is recognised and cut.
        """
        end = len(request.text)
        if not request.finished and request.params.stop:
            end -= max(len(stop) for stop in request.params.stop) - 1
        if end <= request.streamed_chars:
            return ""
        delta = request.text[request.streamed_chars : end]
        request.streamed_chars = end
        return delta

    def _fail(self, request: Request, token: int, why: str | None) -> TokenEvent:
        """End one request whose structured output broke (its grammar's matcher failed,
        e.g. a lexer past llguidance's limits, so the mask could not hold): it finishes with
        ``finish_reason="error"`` and frees its slot; the step's other requests run on.
        The refused token is not reported."""
        error = RequestError(
            "structured_output",
            f"could not be enforced at output token {len(request.output_token_ids) - 1} "
            f"(token {token} left the grammar: {why or 'the matcher refused it'})",
            row=request.index,
        )
        self.scheduler.finish(request, "error")
        del self._streams[request.request_id]
        return TokenEvent(
            index=request.index,
            request_id=request.request_id,
            token_id=token,
            text="",
            finished=True,
            finish_reason="error",
            error=error,
        )

    def _is_stop_token(self, params: SamplingParams, token: int) -> bool:
        """EOS (unless ignored) or one of the request's ``stop_token_ids``."""
        return token in params.stop_token_ids or (
            not params.ignore_eos and token in self.tokenizer.eos_token_ids
        )

    def _stop_reason(self, request: Request) -> str | None:
        """Why the request ends after its latest token, a stop string or a length limit
        (stop tokens are ``_is_stop_token``'s)."""
        params = request.params
        for stop in params.stop:
            at = request.text.find(stop)
            if at >= 0:
                request.text = request.text[:at]
                return "stop_string"
        if len(request.output_token_ids) >= params.max_tokens:
            return "length"
        if request.num_tokens >= self.scheduler.config.max_model_len:
            return "length"
        return None
