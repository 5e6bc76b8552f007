"""The offline ``LLM`` API end to end on tiny-llama: streaming, stop conditions, seeded
sampling, log-probabilities, request errors and teardown."""

from __future__ import annotations

import random
import threading
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from lane_fixtures import module_torch_thread  # noqa: F401  (autouse fixture)

from llmrt.errors import RequestError, UnsupportedError
from llmrt.runtime.paged_kv_cache import KVCacheState
from llmrt.runtime.trace_compiler import ArtifactState
from llmrt.sampling.params import SamplingParams
from llmrt.serving.llm import LLM

EOS = 257  # the byte tokenizer's </s>
PROMPTS: list[str | list[int]] = [
    "hello world",
    "The quick brown fox jumps over the lazy dog",
    [5, 6, 7],
    "x" * 140,
]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM.from_recipe("tiny-llama") as served:
        yield served


def assert_idle(llm: LLM) -> None:
    """No request queued or running, no slot held, every block free, invariants intact."""
    scheduler = llm.engine.scheduler
    assert not scheduler.waiting and not scheduler.running
    for allocator in scheduler.allocators:
        allocator.check_invariants()
        assert allocator.num_free_blocks == allocator.config.num_blocks
    assert not llm.engine._streams


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)  # type: ignore[arg-type]


def test_outputs_carry_prompt_tokens_generated_tokens_text_and_reason(llm: LLM) -> None:
    outs = llm.generate(PROMPTS, greedy(8, ignore_eos=True))
    assert [o.index for o in outs] == list(range(len(PROMPTS)))
    assert outs[0].prompt == "hello world" and outs[2].prompt is None
    assert outs[0].prompt_token_ids == (256, *b"hello world")  # <s> then one id per byte
    assert outs[2].prompt_token_ids == (5, 6, 7)
    for out in outs:
        assert len(out.token_ids) == 8 and out.finish_reason == "length"
        assert out.text == llm.tokenizer.decode(list(out.token_ids), skip_special_tokens=True)
        assert out.ttft_s is not None and 0 <= out.ttft_s < 60
        assert len(out.token_times) == 8 and list(out.token_times) == sorted(out.token_times)
    one = llm.generate([5, 6, 7], greedy(8, ignore_eos=True))  # one token-id prompt
    assert len(one) == 1 and one[0].token_ids == outs[2].token_ids
    assert_idle(llm)


def test_stream_yields_exactly_the_generated_tokens(llm: LLM) -> None:
    params = greedy(10, ignore_eos=True)
    expected = llm.generate(PROMPTS, params)
    tokens: dict[int, list[int]] = defaultdict(list)
    text: dict[int, str] = defaultdict(str)
    finished: dict[int, list[bool]] = defaultdict(list)
    reasons: dict[int, str | None] = {}
    for event in llm.stream(PROMPTS, params):
        tokens[event.index].append(event.token_id)
        text[event.index] += event.text
        finished[event.index].append(event.finished)
        reasons[event.index] = event.finish_reason
    for out in expected:
        assert tuple(tokens[out.index]) == out.token_ids
        assert text[out.index] == out.text
        assert finished[out.index] == [False] * 9 + [True]
        assert reasons[out.index] == out.finish_reason == "length"
    assert_idle(llm)


def test_abandoned_stream_aborts_and_returns_every_block(llm: LLM) -> None:
    stream = llm.stream(PROMPTS, greedy(50, ignore_eos=True))
    for _ in range(6):
        next(stream)
    assert llm.engine.scheduler.running
    stream.close()
    assert_idle(llm)


def test_calls_interleaved_with_an_open_stream_leave_it_every_token(llm: LLM) -> None:
    """A generate (or a second stream) run while a stream is half read steps the stream's
    requests too: their tokens wait for it, none lost; closing one stream aborts only its
    own requests."""
    params = greedy(12, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(PROMPTS[:2], params)]
    first = llm.stream(PROMPTS[:2], params)
    seen = [next(first), next(first)]
    other = llm.generate(PROMPTS[2:], params)
    second = llm.stream(PROMPTS[2:3], params)
    next(second)
    second.close()  # aborts its request, not the first stream's
    seen += list(first)
    by_prompt: dict[int, list[int]] = defaultdict(list)
    for event in seen:
        by_prompt[event.index].append(event.token_id)
    assert [tuple(by_prompt[i]) for i in range(2)] == alone
    assert [len(o.token_ids) for o in other] == [12, 12]
    assert_idle(llm)


def test_threads_sharing_one_llm_batch_together_and_get_their_own_tokens(llm: LLM) -> None:
    """generate / stream from several threads at once (a web app's handlers): every call
    steps the engine under its lock, so they share steps, and each gets exactly its tokens."""
    params = greedy(16, ignore_eos=True)
    alone = {i: llm.generate([p], params)[0].token_ids for i, p in enumerate(PROMPTS)}
    got: dict[int, tuple[int, ...]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(PROMPTS) * 2)

    def call(i: int, streamed: bool) -> None:
        try:
            start.wait(30)
            if streamed:
                got[100 + i] = tuple(e.token_id for e in llm.stream([PROMPTS[i]], params))
            else:
                got[i] = llm.generate([PROMPTS[i]], params)[0].token_ids
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [
        threading.Thread(target=call, args=(i, streamed))
        for i in range(len(PROMPTS))
        for streamed in (False, True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert got == {**alone, **{100 + i: ids for i, ids in alone.items()}}
    assert_idle(llm)


def test_max_tokens_and_stop_token_ids(llm: LLM) -> None:
    reference = llm.generate(PROMPTS[1], greedy(16, ignore_eos=True))[0].token_ids
    # The first token that has not appeared before position 3 stops the request there.
    cut = next(i for i in range(3, 16) if reference[i] not in reference[:i])
    stopped = llm.generate(PROMPTS[1], greedy(16, stop_token_ids=[reference[cut]]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == reference[: cut + 1]  # the stop token is part of the output
    # ... but not of the text (vLLM's include_stop_str_in_output=False)
    assert stopped.text == llm.tokenizer.decode(list(reference[:cut]))
    streamed = "".join(
        e.text for e in llm.stream(PROMPTS[1], greedy(16, stop_token_ids=[reference[cut]]))
    )
    assert streamed == stopped.text
    short = llm.generate(PROMPTS[1], greedy(3, ignore_eos=True))[0]
    assert short.finish_reason == "length" and short.token_ids == reference[:3]
    assert_idle(llm)


def test_eos_stops_unless_ignored(llm: LLM) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(1, 30))] for _ in range(64)]
    outs = llm.generate(prompts, greedy(24))
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped, "no seeded prompt reached </s>; pick other prompts"
    for out in outs:
        assert (EOS in out.token_ids) == (out.finish_reason == "stop")
    for out in stopped:
        assert out.token_ids[-1] == EOS and len(out.token_ids) < 24
        again = llm.generate([list(out.prompt_token_ids)], greedy(24, ignore_eos=True))[0]
        assert again.finish_reason == "length" and len(again.token_ids) == 24
        assert again.token_ids[: len(out.token_ids)] == out.token_ids
    assert_idle(llm)


def test_stop_string_cuts_text_and_is_never_streamed(llm: LLM) -> None:
    prompt = PROMPTS[1]
    reference = llm.generate(prompt, greedy(24, ignore_eos=True))[0]
    # A two-character stop string (two byte tokens) from the middle of the reference text.
    at = next(
        i
        for i in range(4, len(reference.text) - 1)
        if reference.text[i : i + 2].isprintable()
        and reference.text[i : i + 2] not in reference.text[: i + 1]
    )
    stop = reference.text[at : at + 2]
    out = llm.generate(prompt, greedy(24, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.text == reference.text[:at]
    assert out.token_ids == reference.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < 24
    streamed = "".join(e.text for e in llm.stream(prompt, greedy(24, stop=[stop], ignore_eos=True)))
    assert streamed == out.text and stop not in streamed
    assert_idle(llm)


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm: LLM) -> None:
    seeded = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True
    )
    other = SamplingParams(temperature=0.7, seed=7, max_tokens=5, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded)[0].token_ids
    first = llm.generate([PROMPTS[0], *PROMPTS[1:]], [seeded, other, other, other])[0].token_ids
    last = llm.generate([*PROMPTS[1:], PROMPTS[0]], [other, other, other, seeded])[-1].token_ids
    assert alone == first == last
    reseeded = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=4321, max_tokens=12, ignore_eos=True
    )
    assert llm.generate(PROMPTS[0], reseeded)[0].token_ids != alone
    greedy_tokens = llm.generate(PROMPTS[0], greedy(12, ignore_eos=True))[0].token_ids
    assert greedy_tokens != alone  # temperature 1 over a near-uniform model is not greedy
    assert_idle(llm)


def test_logprobs_when_asked(llm: LLM) -> None:
    out = llm.generate(PROMPTS[:2], greedy(6, logprobs=2, ignore_eos=True))
    plain = llm.generate(PROMPTS[:2], greedy(6, ignore_eos=True))
    for got, ref in zip(out, plain, strict=True):
        assert got.token_ids == ref.token_ids and ref.logprobs is None
        assert got.logprobs is not None and got.top_logprobs is not None
        assert len(got.logprobs) == len(got.top_logprobs) == 6
        for token, logprob, top in zip(got.token_ids, got.logprobs, got.top_logprobs, strict=True):
            assert logprob <= 0 and len(top) == 2
            assert top[token] == pytest.approx(logprob) == max(top.values())  # greedy: top-1
        record = got.to_json()  # what --json prints: the top logprobs too
        assert record["top_logprobs"] == [
            {str(t): v for t, v in d.items()} for d in got.top_logprobs
        ]
        assert (record["index"], record["logprobs"]) == (got.index, list(got.logprobs))
    chosen_only = llm.generate(PROMPTS[0], greedy(3, logprobs=0))[0]
    assert chosen_only.logprobs is not None and len(chosen_only.logprobs) == 3
    assert chosen_only.top_logprobs is None
    assert_idle(llm)


def test_logprobs_are_rejected_clearly_with_two_lanes() -> None:
    with LLM.from_recipe("tiny-llama", overrides={"lanes": 2, "trace.mode": "none"}) as llm:
        with pytest.raises(UnsupportedError, match=r"logprobs: .* lanes"):
            llm.generate(PROMPTS, greedy(4, logprobs=1))
        assert_idle(llm)
        outs = llm.generate(PROMPTS, greedy(4, ignore_eos=True))
        assert all(len(o.token_ids) == 4 for o in outs)
        assert_idle(llm)


@pytest.mark.parametrize(
    ("prompts", "params", "match"),
    [
        ([""], None, "prompt: is empty"),
        ([[]], None, "prompt: is empty"),
        (["x" * 600], None, "max_model_len=512"),
        ([[1, 2, 999]], None, r"token id out of range \[0, 258\)"),
        (["a", "b"], [SamplingParams()], "has 2 entries for 3 prompts"),
        ([None], None, r"row 1: prompts: each prompt must be a string or a list of token ids"),
        ([b"bytes"], None, "row 1: prompts: each prompt"),
        ([[1, "a"]], None, "row 1: prompts: each prompt"),
    ],
)
def test_request_errors_leave_the_engine_idle(
    llm: LLM, prompts: list[str | list[int]], params: Sequence[SamplingParams] | None, match: str
) -> None:
    with pytest.raises(RequestError, match=match):
        llm.generate(["fine", *prompts], None if params is None else [SamplingParams(), *params])
    assert_idle(llm)
    assert len(llm.generate("still works", greedy(2))[0].token_ids) <= 2


def test_arguments_of_the_wrong_kind_are_request_errors(llm: LLM) -> None:
    for bad in (None, 5, b"bytes", {"prompt": "x"}):
        with pytest.raises(RequestError, match="prompts: must be a string, a list of token"):
            llm.generate(bad)  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="messages: must be a list"):
        llm.chat("hello")  # type: ignore[arg-type]
    user = {"role": "user", "content": "hi"}
    with pytest.raises(RequestError, match="row 1: messages: each conversation"):
        llm.chat([[user], user])  # type: ignore[list-item]
    with pytest.raises(RequestError, match="row 1: sampling_params: each entry"):
        llm.generate(["a", "b"], [SamplingParams(), {"max_tokens": 3}])  # type: ignore[list-item]
    with pytest.raises(RequestError, match="row 1: prompt: is empty"):
        llm.generate(["a", ""])
    import numpy as np

    ids = np.array([5, 6, 7])  # numpy's integers are token ids too
    assert llm.generate(list(ids), greedy(2))[0].prompt_token_ids == (5, 6, 7)
    assert_idle(llm)


def test_a_failing_step_ends_every_live_call_and_leaves_the_engine_usable(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that raises has taken tokens for other calls' requests whose events it lost:
    they are aborted with it (ended, not silently missing a token), the caller gets the
    error, and the engine serves the next call."""
    params = greedy(12, ignore_eos=True)
    reference = llm.generate(PROMPTS[:1], params)[0].token_ids
    other = llm.stream(PROMPTS[:1], params)
    seen = [next(other)]
    real_step = llm.engine.step

    def failing() -> list[Any]:
        real_step()  # the step ran (tokens taken), then failed
        raise RuntimeError("device fault")

    monkeypatch.setattr(llm.engine, "step", failing)
    with pytest.raises(RuntimeError, match="device fault"):
        llm.generate(PROMPTS[1:2], params)
    monkeypatch.setattr(llm.engine, "step", real_step)
    seen += list(other)  # ends: its request was aborted with the failed step
    tokens = [e.token_id for e in seen]
    assert len(tokens) < 12 and tokens == list(reference[: len(tokens)])  # no token skipped
    assert_idle(llm)
    assert len(llm.generate(PROMPTS[0], greedy(3, ignore_eos=True))[0].token_ids) == 3


def test_close_tears_down_even_when_aborting_the_requests_fails() -> None:
    served = LLM.from_recipe("tiny-llama")

    def broken() -> None:
        raise RuntimeError("abort failed")

    served.engine.abort_all = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="abort failed"):
        served.close()
    assert served.container.root_scope().closed
    served.close()  # nothing left: a no-op


def test_close_while_another_thread_generates_ends_that_call_cleanly() -> None:
    """close() waits for the step in progress, aborts every live request, and the calls
    still running end with 'llm was closed' (no teardown failure, nothing orphaned)."""
    served = LLM.from_recipe("tiny-llama")
    errors: list[BaseException] = []
    started = threading.Event()

    def long_call() -> None:
        try:
            for _ in served.stream(["Once upon a time"], greedy(400, ignore_eos=True)):
                started.set()
        except BaseException as exc:  # reported below
            errors.append(exc)

    worker = threading.Thread(target=long_call)
    worker.start()
    assert started.wait(60)
    served.close()
    worker.join(60)
    assert len(errors) == 1 and isinstance(errors[0], RequestError), errors
    assert "was closed while this call ran" in str(errors[0])
    assert not served.container.root_scope().orphans()
    with pytest.raises(RequestError, match="llm: is closed"):
        served.generate("x")


def test_close_releases_kv_traces_and_device_memory() -> None:
    llm = LLM.from_recipe("tiny-llama", overrides={"lanes": 2, "trace.mode": "all"})
    devices = llm.container.device.lane_devices()
    lanes = llm.engine.executor.lanes
    traces = [lane.trace_compiler() for lane in llm.container.lanes()]
    llm.generate(PROMPTS, greedy(5))
    assert all(d.stats().live_tensors > 0 and d.stats().live_traces > 0 for d in devices)
    artifacts = [a for compiler in traces for a in compiler.artifacts.values()]
    assert artifacts and all(a.state is ArtifactState.CAPTURED for a in artifacts)
    assert any(a.replays for a in artifacts)
    llm.close()
    for device in devices:
        stats = device.stats()
        assert (stats.live_tensors, stats.live_traces, stats.pending_reads) == (0, 0, 0)
        assert stats.allocations == stats.deallocations > 0
    for lane in lanes:
        assert lane.kv_cache.state is KVCacheState.RELEASED and not lane.kv_cache.orphans
    for compiler in traces:
        assert compiler.artifacts
        assert all(a.state is ArtifactState.RELEASED for a in compiler.artifacts.values())
    llm.close()  # idempotent
    with pytest.raises(RequestError, match="closed"):
        llm.generate("hi")


def test_abort_returns_one_requests_slot_and_blocks_at_once(llm: LLM) -> None:
    """``Engine.abort`` (what a disconnected server client triggers) frees a running
    request's slot and blocks immediately and drops a queued one; the others go on
    exactly as if it had never been there."""
    params = greedy(20, ignore_eos=True)
    prompts = [*PROMPTS, "one more prompt than slots"]
    expected = llm.generate(prompts, params)
    engine = llm.engine
    requests = [
        engine.add_request(prompt_token_ids=llm.encode(p), params=params, index=i)
        for i, p in enumerate(prompts)
    ]
    tokens: dict[int, list[int]] = defaultdict(list)
    for _ in range(3):
        for event in engine.step():
            tokens[event.index].append(event.token_id)
    running, queued = requests[1], requests[4]
    assert running.slot is not None and queued.slot is None
    allocator = engine.scheduler.allocator_of(running)
    held = len(allocator.block_table(running.request_id))
    free = allocator.num_free_blocks
    assert held > 0
    assert engine.abort(running)
    assert running.finished and running.finish_reason == "abort" and running.slot is None
    assert allocator.num_free_blocks == free + held
    assert running.request_id not in allocator
    assert engine.abort(queued) and queued.finish_reason == "abort"
    assert queued not in engine.scheduler.waiting
    assert not engine.abort(running)  # already finished: nothing to give back
    for event in engine.run():
        assert event.index not in (1, 4)
        tokens[event.index].append(event.token_id)
    for i in (0, 2, 3):
        assert tuple(tokens[i]) == expected[i].token_ids
    assert_idle(llm)
