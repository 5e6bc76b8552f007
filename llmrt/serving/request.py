"""A generation request's state as the scheduler sees it."""

from __future__ import annotations

import enum

import attrs

from llmrt.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@attrs.define(kw_only=True, eq=False)
class Request:
    """One prompt's progress: computed tokens, generated tokens, slot and lane."""

    request_id: str
    index: int
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival: int
    """Submission order (monotonic over the engine's lifetime; preemption picks the newest)."""
    arrival_time: float = 0.0
    """``time.perf_counter()`` at submission (time to first token counts from here)."""
    output_token_ids: list[int] = attrs.Factory(list)
    logprobs: list[float] = attrs.Factory(list)
    top_logprobs: list[dict[int, float]] = attrs.Factory(list)
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""
    streamed_chars: int = 0
    """Characters of ``text`` already handed to a stream."""
    preemptions: int = 0
    first_token_time: float | None = None
    token_times: list[float] = attrs.Factory(list)
    prefill_tokens_computed: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt plus generated tokens: what a recompute after preemption prefills."""
        return [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
