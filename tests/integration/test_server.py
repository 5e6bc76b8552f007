"""``llmrt serve`` end to end: a real uvicorn server on a free loopback port, driven by the
``openai`` package and raw HTTP, on tiny-llama.

Outputs are checked against a separate offline ``LLM`` built from the same recipe (seeded
weights, so the same model); the engine's state is checked through ``/metrics`` and,
since the server runs in this process, directly on its scheduler.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from lane_fixtures import module_torch_thread  # noqa: F401  (autouse fixture)
from prometheus_client.parser import text_string_to_metric_families

from llmrt.sampling.params import SamplingParams
from llmrt.server.serve import BackgroundServer
from llmrt.serving.llm import LLM

RECIPE = "tiny-llama"
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    with BackgroundServer(
        build=lambda: LLM.from_recipe(RECIPE), model_name=RECIPE, max_waiting=256
    ) as running:
        yield running


@pytest.fixture(scope="module")
def reference() -> Iterator[LLM]:
    with LLM.from_recipe(RECIPE) as llm:
        yield llm


@pytest.fixture()
def client(server: BackgroundServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT
    ) as c:
        yield c


def metrics(server: BackgroundServer) -> dict[str, float]:
    """``/metrics`` samples by name, labels other than ``model_name`` kept in the key."""
    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(
                f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name"
            )
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def assert_idle(server: BackgroundServer, *, timeout: float = 30.0) -> None:
    """Nothing queued or running, every slot and KV block free (metrics and scheduler)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["llmrt_num_requests_running"] == 0 and m["llmrt_num_requests_waiting"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    assert m["llmrt_kv_blocks_used"] == 0
    llm = server.state.llm
    assert llm is not None
    scheduler = llm.engine.scheduler
    assert not scheduler.waiting and not scheduler.running
    assert m["llmrt_kv_blocks_free"] == sum(a.config.num_blocks for a in scheduler.allocators)
    for allocator in scheduler.allocators:
        allocator.check_invariants()
        assert allocator.num_free_blocks == allocator.config.num_blocks
    assert not llm.engine._streams


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


# -- the API -------------------------------------------------------------------------------


def test_health_and_models(server: BackgroundServer, client: openai.OpenAI) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [RECIPE]


def test_greedy_completions_equal_llm_generate(
    server: BackgroundServer, client: openai.OpenAI, reference: LLM
) -> None:
    prompts: list[Any] = ["hello world", "The quick brown fox", [5, 6, 7, 8, 9]]
    expected = reference.generate(prompts, greedy(12, ignore_eos=True))
    for prompt, want in zip(prompts, expected, strict=True):
        got = client.completions.create(
            model=RECIPE,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert got.choices[0].text == want.text
        assert got.choices[0].finish_reason == "length"
        assert got.usage is not None
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.token_ids) == 12
        stream = client.completions.create(
            model=RECIPE,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == want.text
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    # Several prompts in one request: one choice each, in order, usage summed.
    many = client.completions.create(
        model=RECIPE, prompt=[[5, 6, 7, 8, 9], [1, 2, 3]], max_tokens=4, temperature=0
    )
    ref = reference.generate([[5, 6, 7, 8, 9], [1, 2, 3]], greedy(4))
    assert [c.index for c in many.choices] == [0, 1]
    assert [c.text for c in many.choices] == [r.text for r in ref]
    assert many.usage is not None
    assert many.usage.completion_tokens == sum(len(r.token_ids) for r in ref)
    assert_idle(server)


def test_greedy_chat_equals_llm_chat(
    server: BackgroundServer, client: openai.OpenAI, reference: LLM
) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi there"},
    ]
    want = reference.chat(messages, greedy(10, ignore_eos=True))[0]
    got = client.chat.completions.create(
        model=RECIPE,
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage is not None
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == 10
    chunks = list(
        client.chat.completions.create(
            model=RECIPE,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert_idle(server)


def test_sampling_fields_and_logprobs_reach_the_engine(
    server: BackgroundServer, client: openai.OpenAI, reference: LLM
) -> None:
    prompt = [10, 20, 30, 40]
    fields = {
        "temperature": 0.8,
        "top_p": 0.9,
        "seed": 7,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
    }
    extra = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True}
    want = reference.generate(
        [prompt],
        SamplingParams(max_tokens=8, logprobs=2, **fields, **extra),  # type: ignore[arg-type]
    )[0]
    got = client.completions.create(
        model=RECIPE, prompt=prompt, max_tokens=8, logprobs=2, extra_body=extra, **fields
    )
    choice = got.choices[0]
    assert choice.text == want.text
    assert choice.logprobs is not None and want.logprobs is not None
    assert choice.logprobs.token_logprobs == pytest.approx(list(want.logprobs), abs=1e-4)
    assert choice.logprobs.top_logprobs is not None
    assert want.top_logprobs is not None
    # Keyed by token text (OpenAI's legacy shape): byte tokens may share one text.
    for got_top, want_top in zip(choice.logprobs.top_logprobs, want.top_logprobs, strict=True):
        assert 1 <= len(got_top) <= 2
        assert max(got_top.values()) == pytest.approx(max(want_top.values()), abs=1e-4)
    chat = client.chat.completions.create(
        model=RECIPE,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs
    assert content is not None and content.content is not None and len(content.content) >= 1
    assert all(len(t.top_logprobs) == 3 for t in content.content)
    assert all(t.logprob <= 0 for t in content.content)
    # A stop string cuts the text and ends the request with "stop".
    full = reference.generate(["hello world"], greedy(20, ignore_eos=True))[0].text
    stop = full[5:7]
    if stop and "\ufffd" not in stop:
        cut = client.completions.create(
            model=RECIPE, prompt="hello world", max_tokens=20, temperature=0, stop=[stop]
        )
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == full[: full.find(stop)]
    assert_idle(server)


# -- under load ----------------------------------------------------------------------------


async def _stream_one(
    client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int, stop_ids: list[int]
) -> tuple[str, str | None, Any, int]:
    stream = await client.completions.create(
        model=RECIPE,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"stop_token_ids": stop_ids},
    )
    text, reason, usage, chunks = "", None, None, 0
    async for chunk in stream:
        if chunk.choices:
            chunks += 1
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage is not None:
            usage = chunk.usage
    return text, reason, usage, chunks


def test_64_concurrent_streams_batch_complete_and_leave_nothing_allocated(
    server: BackgroundServer, reference: LLM
) -> None:
    rng = random.Random(17)
    jobs = []
    for _ in range(64):
        prompt = [rng.randrange(0, 256) for _ in range(rng.randint(1, 80))]
        stop_ids = rng.sample(range(256), 3) if rng.random() < 0.5 else []
        jobs.append((prompt, rng.randint(1, 24), stop_ids))
    before = metrics(server)

    async def main() -> list[tuple[str, str | None, Any, int]]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT
        ) as client:
            return await asyncio.gather(*(_stream_one(client, *job) for job in jobs))

    results = asyncio.run(main())
    expected = reference.generate(
        [p for p, _, _ in jobs], [greedy(n, stop_token_ids=s) for _, n, s in jobs]
    )
    for (prompt, max_tokens, _), (text, reason, usage, chunks), want in zip(
        jobs, results, expected, strict=True
    ):
        assert text == want.text
        assert reason == want.finish_reason
        assert usage.prompt_tokens == len(prompt)
        assert usage.completion_tokens == len(want.token_ids) == chunks <= max_tokens
        assert usage.total_tokens == len(prompt) + chunks
    after = metrics(server)
    # The engine batched the connections: some step ran more than one request at once.
    steps = "llmrt_iteration_running_requests"
    batched = (after[f"{steps}_count"] - before[f"{steps}_count"]) - (
        after[f'{steps}_bucket{{le="1.0"}}'] - before[f'{steps}_bucket{{le="1.0"}}']
    )
    assert batched > 0
    assert server.state.loop is not None and server.state.loop.peak_running > 1
    generated = after["llmrt_generation_tokens_total"] - before["llmrt_generation_tokens_total"]
    assert generated == sum(len(w.token_ids) for w in expected)
    assert (
        after["llmrt_time_to_first_token_seconds_count"]
        - before["llmrt_time_to_first_token_seconds_count"]
        == 64
    )
    assert_idle(server)


def test_clients_that_disconnect_mid_stream_abort_their_requests(
    server: BackgroundServer, reference: LLM
) -> None:
    rng = random.Random(71)
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randint(1, 60))] for _ in range(64)]
    before = metrics(server)
    aborted = 'llmrt_request_success_total{finished_reason="abort"}'

    async def one(client: httpx.AsyncClient, i: int) -> str | None:
        quitter = i % 2 == 0
        body = {
            "model": RECIPE,
            "prompt": prompts[i],
            "temperature": 0,
            "stream": True,
            # A quitter asks for far more than it reads, so only an abort can end it early.
            "max_tokens": 400 if quitter else 12,
            "ignore_eos": True,
        }
        text, seen = "", 0
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                seen += 1
                text += json.loads(line[6:])["choices"][0]["text"]
                if quitter and seen == 3:
                    return None  # leaving the block closes the connection mid-stream
        return text

    async def main() -> list[str | None]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))

    results = asyncio.run(main())
    expected = reference.generate(prompts[1::2], greedy(12, ignore_eos=True))
    assert results[1::2] == [w.text for w in expected]
    assert_idle(server)
    after = metrics(server)
    assert after.get(aborted, 0) - before.get(aborted, 0) == 32
    generated = after["llmrt_generation_tokens_total"] - before["llmrt_generation_tokens_total"]
    assert generated < 32 * 12 + 32 * 200  # the quitters stopped long before 400 tokens


def test_backpressure_answers_429_beyond_max_waiting(server: BackgroundServer) -> None:
    loop = server.state.loop
    assert loop is not None
    loop.max_waiting = 2

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": RECIPE, "prompt": [i + 1], "max_tokens": 30, "ignore_eos": True}
        response = await client.post("/v1/completions", json=body)
        if response.status_code == 429:
            error = response.json()["error"]
            assert error["type"] == "rate_limit_exceeded" and "max_waiting" in error["message"]
        else:
            assert response.json()["usage"]["completion_tokens"] == 30
        return response.status_code

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as c:
            return await asyncio.gather(*(one(c, i) for i in range(24)))

    try:
        codes = asyncio.run(main())
    finally:
        loop.max_waiting = 256
    assert set(codes) == {200, 429}
    assert codes.count(200) >= 2  # the first max_waiting in always fit
    assert_idle(server)


# -- bad input -----------------------------------------------------------------------------

BAD: list[tuple[str, Any, str | None]] = [
    ("/v1/completions", {"model": "nope", "prompt": "x"}, "model"),
    ("/v1/completions", {"prompt": "x" * 600}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 600}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": "5"}, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_p": 2}, "min_p"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "x", "seed": 1.5}, "seed"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 129}, "n"),
    ("/v1/completions", {"prompt": "x\ud800y"}, "prompt"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "\udfff"}]},
        "messages.1.content",
    ),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"prompt": [1, 999999]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", '{"prompt": "x",', None),
    ("/v1/completions", "[1, 2]", None),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 1}]}, "messages.0.content"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10_000},
        "max_completion_tokens",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD)
def test_bad_input_gets_400_naming_the_field_and_the_server_keeps_serving(
    server: BackgroundServer, path: str, body: Any, param: str | None
) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(
        f"{server.url}{path}",
        content=content,
        headers={"content-type": "application/json"},
        timeout=TIMEOUT,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]
    if param is not None:
        assert param.split(".")[0] in error["message"]
    ok = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=TIMEOUT
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert_idle(server)


def test_unknown_route_and_api_key(server: BackgroundServer) -> None:
    missing = httpx.get(f"{server.url}/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()
    state = server.state
    state.api_key = "s3cret"
    try:
        body = {"prompt": [1], "max_tokens": 1}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            denied = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
            assert denied.status_code == 401
            assert denied.json()["error"]["code"] == "invalid_api_key"
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0) as c:
            assert c.completions.create(model=RECIPE, prompt=[1], max_tokens=1).choices
        with (
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0) as c,
            pytest.raises(openai.AuthenticationError),
        ):
            c.models.list()
        assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key
    finally:
        state.api_key = None
    assert_idle(server)


# -- the bench ---------------------------------------------------------------------------


def test_bench_server_drives_a_running_server_against_offline(server: BackgroundServer) -> None:
    from llmrt.benchmarks.settings import BenchSettings
    from llmrt.cli.bench import bench_report

    settings = BenchSettings(recipe=RECIPE, server=server.url, num_prompts=4, max_new_tokens=4)
    report = bench_report(settings).to_json()
    assert report["server"]["output_tokens"] == report["offline"]["output_tokens"] == 16
    assert report["server"]["greedy_texts_identical"] == 4
    assert report["server_8_clients"]["output_tokens"] == 16
    assert report["headline_ratio"] == report["ratios"]["server_over_offline_tokens_per_s"] > 0
    assert_idle(server)


def test_bench_server_schema_and_stall_checks_fit_a_short_context(
    server: BackgroundServer,
) -> None:
    """tiny-llama's 512 positions: the stall streams ask for what their prompts leave room
    for (they asked 128 and the server refused them: the check waited forever), and a
    schema answer cut by a small max_tokens before its array opens is still valid."""
    from llmrt.benchmarks.settings import BenchSettings
    from llmrt.cli.bench import bench_report

    settings = BenchSettings(
        recipe=RECIPE, server=server.url, num_prompts=4, max_new_tokens=8, schema=True,
        stall_check=True,
    )  # fmt: skip
    report = bench_report(settings).to_json()
    assert report["stall"]["large_request_large_request_status"] == 400
    assert report["structured"]["json_schema_tokens_per_s"] > 0
    assert_idle(server)


# -- the process ---------------------------------------------------------------------------


def test_a_warm_server_freezes_its_heap_out_of_full_collections_and_thaws_it_to_tear_down(
    server: BackgroundServer,
) -> None:
    # Off by default: this process is the tests' as much as the server's.
    assert server.state.frozen_objects == 0 and gc.get_freeze_count() == 0
    with BackgroundServer(
        build=lambda: LLM.from_recipe(RECIPE), model_name=RECIPE, max_waiting=8, freeze_heap=True
    ) as frozen:
        state = frozen.state
        # (objects freed by their references since leave the count: no equality)
        assert state.llm is not None and state.frozen_objects > 0 and gc.get_freeze_count() > 0
        walked = {id(o) for o in gc.get_objects()}  # what a full collection walks
        # The warm runtime is out of the collector's generations, the requests' objects not.
        assert id(state.llm) not in walked and id(state.llm.engine.scheduler) not in walked
        assert len(walked) < state.frozen_objects
        body = {"model": RECIPE, "prompt": [3] * 8, "max_tokens": 4, "ignore_eos": True}
        reply = httpx.post(f"{frozen.url}/v1/completions", json=body, timeout=TIMEOUT)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        llm = state.llm
    # Thawed before the teardown, so cycles among the runtime's objects are collectable.
    assert gc.get_freeze_count() == 0
    assert any(o is llm for o in gc.get_objects()) and llm._closed


def test_sigterm_during_load_drains_exits_0_and_leaves_a_passing_audit_log(
    tmp_path: Path,
) -> None:
    audit = tmp_path / "audit.jsonl"
    log = tmp_path / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmrt.cli", "serve", RECIPE, "--port", "0",
             "--audit-log", str(audit), "--shutdown-timeout", "20", "--log-level", "info"],
            stderr=sink,
            stdout=subprocess.DEVNULL,
            env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (found := re.search(r"http://127\.0\.0\.1:(\d+)", log.read_text())):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.05)
        url = f"http://127.0.0.1:{found.group(1)}"
        deadline = time.monotonic() + TIMEOUT
        while httpx.get(f"{url}/health", timeout=TIMEOUT).status_code != 200:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        results: list[tuple[int, str | None, bool]] = []
        started = threading.Barrier(9)

        def client(i: int) -> None:
            body = {"prompt": [i + 1] * 8, "max_tokens": 24, "ignore_eos": True, "stream": True}
            count, reason, done = 0, None, False
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
                for sse in r.iter_lines():
                    if sse == "data: [DONE]":
                        done = True
                    elif sse.startswith("data: "):
                        count += 1
                        if count == 1:
                            started.wait(TIMEOUT)
                        reason = json.loads(sse[6:])["choices"][0]["finish_reason"] or reason
            results.append((count, reason, done))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        started.wait(TIMEOUT)  # every client is mid-stream
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) == 0, log.read_text()
        for t in threads:
            t.join(TIMEOUT)
        # In the grace period every in-flight request finished normally.
        assert sorted(results) == [(24, "length", True)] * 8
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "llmrt serve: stopped" in log.read_text()
    # tiny-llama: 4 decode slots, 256 prompt tokens a step (its recipe's budget).
    assert "llmrt serve: ready (tiny-llama: 4 requests at once, 256 prompt tokens a step)" in (
        log.read_text()
    )
    # `llmrt serve` owns its process: the warm heap is frozen out of full collections.
    frozen = r"\d+ objects frozen out of the garbage collector's full passes"
    assert re.search(frozen, log.read_text())
    checked = subprocess.run(
        [sys.executable, "-m", "llmrt.cli", "audit", str(audit)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
