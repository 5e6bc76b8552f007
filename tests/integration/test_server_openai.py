"""``llmrt serve`` as OpenAI clients, frameworks and browsers use it: body limits, CORS,
access logs, the utility routes, several choices, what a cut shutdown sends, and the CLI's
one-line errors. A real uvicorn server on a free loopback port, on tiny-llama.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from lane_fixtures import module_torch_thread  # noqa: F401  (autouse fixture)

from llmrt.errors import RequestError
from llmrt.sampling.params import SamplingParams
from llmrt.sampling.structured import StructuredOutput
from llmrt.server.serve import BackgroundServer
from llmrt.serving.llm import LLM

RECIPE = "tiny-llama"
TIMEOUT = 120.0
LIMIT = 64 * 1024  # the small server's body limit
#: Room for the generic tool prompt: tiny-llama's byte tokens fill 512 positions quickly.
OVERRIDES = ["model.max_position_embeddings=2048", "serving.max_model_len=2048"]


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    """Default settings, except a body limit above 10 MB (the large-request test)."""
    with BackgroundServer(
        build=lambda: LLM.from_recipe(RECIPE, overrides=OVERRIDES),
        model_name=RECIPE,
        max_waiting=256,
        max_request_bytes=32 * 1024 * 1024,
    ) as running:
        yield running


@pytest.fixture(scope="module")
def small() -> Iterator[BackgroundServer]:
    """A small body limit and CORS for one origin."""
    with BackgroundServer(
        build=lambda: LLM.from_recipe(RECIPE),
        model_name=RECIPE,
        max_waiting=256,
        max_request_bytes=LIMIT,
        allowed_origins=["http://app.example"],
    ) as running:
        yield running


@pytest.fixture(scope="module")
def reference() -> Iterator[LLM]:
    with LLM.from_recipe(RECIPE, overrides=OVERRIDES) as llm:
        yield llm


@pytest.fixture()
def client(server: BackgroundServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT
    ) as c:
        yield c


def idle(server: BackgroundServer) -> None:
    llm = server.state.llm
    assert llm is not None
    deadline = time.monotonic() + 30
    while llm.engine.scheduler.running or llm.engine.scheduler.waiting:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for allocator in llm.engine.scheduler.allocators:
        allocator.check_invariants()
        assert allocator.num_free_blocks == allocator.config.num_blocks


# -- nothing stalls the server -------------------------------------------------------------


def test_a_body_over_the_limit_is_413_before_it_is_read(small: BackgroundServer) -> None:
    body = json.dumps({"prompt": "x" * (LIMIT + 1), "max_tokens": 1})
    r = httpx.post(f"{small.url}/v1/completions", content=body, timeout=TIMEOUT)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    assert str(LIMIT) in r.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: read up to the limit, then refused
        yield b'{"prompt": "'
        for _ in range(LIMIT // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(f"{small.url}/v1/completions", content=chunks(), timeout=TIMEOUT)
    assert r.status_code == 413, r.text
    ok = httpx.post(
        f"{small.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=TIMEOUT
    )
    assert ok.status_code == 200, ok.text


def test_a_10mb_prompt_during_8_streams_is_refused_by_its_length_and_stalls_nothing(
    server: BackgroundServer, reference: LLM
) -> None:
    """The 10 MB request gets a 400 naming the prompt's length without being tokenized, and
    the streams running meanwhile finish with exactly their offline greedy text. (The
    inter-chunk gap target is a timing target: ``llmrt bench --server --stall-check``.)"""
    expected = reference.generate(
        [[i + 1] * 4 for i in range(8)],
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
    )
    big = {"prompt": "y" * 10_000_000, "max_tokens": 1}

    async def stream(c: httpx.AsyncClient, i: int) -> str:
        body = {
            "prompt": [i + 1] * 4,
            "max_tokens": 48,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0,
        }
        text = ""
        async with c.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def main() -> tuple[list[str], httpx.Response, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as c:
            streams = [asyncio.create_task(stream(c, i)) for i in range(8)]
            await asyncio.sleep(0.05)
            start = time.perf_counter()
            refused = await c.post("/v1/completions", json=big)
            took = time.perf_counter() - start
            return list(await asyncio.gather(*streams)), refused, took

    texts, refused, took = asyncio.run(main())
    assert refused.status_code == 400, refused.text[:300]
    error = refused.json()["error"]
    assert error["param"] == "prompt" and "max_model_len" in error["message"]
    assert took < 30  # tokenizing 10 MB of bytes would take minutes here
    assert texts == [e.text for e in expected]
    idle(server)


# -- what users expect of an OpenAI server -------------------------------------------------


def test_cors_preflight_only_for_allowed_origins(
    small: BackgroundServer, server: BackgroundServer
) -> None:
    headers = {
        "Origin": "http://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = httpx.options(f"{small.url}/v1/chat/completions", headers=headers)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    r = httpx.get(f"{small.url}/v1/models", headers={"Origin": "http://app.example"})
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    r = httpx.options(f"{small.url}/v1/models", headers={**headers, "Origin": "http://evil"})
    assert "access-control-allow-origin" not in r.headers
    # Off by default.
    r = httpx.get(f"{server.url}/v1/models", headers={"Origin": "http://app.example"})
    assert "access-control-allow-origin" not in r.headers


def _access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    records = caplog.records
    return list(dict.fromkeys(r.getMessage() for r in records if r.name == "llmrt.server.access"))


def test_one_access_log_line_per_request_at_info(
    server: BackgroundServer, caplog: pytest.LogCaptureFixture
) -> None:
    access = logging.getLogger("llmrt.server.access")
    access.addHandler(caplog.handler)  # whatever propagation a server in this process set
    with caplog.at_level(logging.INFO, logger="llmrt.server.access"):
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "stream": True},
            timeout=TIMEOUT,
        )
        assert r.status_code == 200
        httpx.get(f"{server.url}/nope")
        deadline = time.monotonic() + 10
        # the handler may see each record twice (its own attachment and propagation to root):
        # wait for two distinct lines, not two records
        while len(_access_lines(caplog)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    access.removeHandler(caplog.handler)
    lines = _access_lines(caplog)
    assert len(lines) == 2, lines
    assert re.search(
        r'"POST /v1/completions" 200 prompt_tokens=3 completion_tokens=4 latency=\d', lines[0]
    ), lines[0]
    assert '"GET /nope" 404 prompt_tokens=- completion_tokens=-' in lines[1]


def test_tokenize_detokenize_version_and_model_card(
    server: BackgroundServer, client: openai.OpenAI, reference: LLM
) -> None:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "hé"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert tokens == reference.tokenizer.encode("hé")
    assert r.json()["count"] == len(tokens) and r.json()["max_model_len"] == 2048
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=TIMEOUT)
    rendered = reference.tokenizer.apply_chat_template(messages)
    assert r.json()["tokens"] == reference.tokenizer.encode(rendered)
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}, timeout=TIMEOUT)
    assert r.json() == {"prompt": reference.tokenizer.decode(tokens)}
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": [1, 10**6]}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert re.fullmatch(r"\d+\.\d+.*", httpx.get(f"{server.url}/version").json()["version"])
    card = client.models.retrieve(RECIPE)
    assert card.id == RECIPE and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")


def test_chat_ids_and_usage_null_on_chunks_before_the_last(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=RECIPE,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.id.startswith("chatcmpl-") for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    raw = [c.model_dump() for c in chunks[:-1]]
    assert all("usage" in c for c in raw)  # sent as null, not left out
    answer = client.chat.completions.create(
        model=RECIPE, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert answer.id.startswith("chatcmpl-")
    completion = client.completions.create(model=RECIPE, prompt="hi", max_tokens=2)
    assert completion.id.startswith("cmpl-")


def test_n_choices_share_the_prompt_blocks(
    server: BackgroundServer, client: openai.OpenAI, reference: LLM
) -> None:
    llm = server.state.llm
    assert llm is not None
    prompt = [7] * 70  # four full 16-token blocks
    expected = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))[0]
    hits = llm.engine.stats().prefix_hit_tokens
    greedy = client.completions.create(
        model=RECIPE, prompt=prompt, max_tokens=6, n=3, seed=1, temperature=0
    )
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert [c.text for c in greedy.choices] == [expected.text] * 3
    assert greedy.usage is not None
    assert greedy.usage.prompt_tokens == 70  # the prompt once, not per choice
    assert greedy.usage.completion_tokens == 3 * 6
    assert llm.engine.stats().prefix_hit_tokens - hits >= 2 * 64
    sampled = client.chat.completions.create(
        model=RECIPE,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=12,
        n=4,
        temperature=1.0,
        seed=3,
    )
    texts = [c.message.content for c in sampled.choices]
    assert len(set(texts)) > 1  # seeded per choice, not four copies
    again = client.chat.completions.create(
        model=RECIPE,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=12,
        n=4,
        temperature=1.0,
        seed=3,
    )
    assert [c.message.content for c in again.choices] == texts
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(
        model=RECIPE, prompt=prompt, max_tokens=6, n=2, stream=True, temperature=0
    ):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {0: expected.text, 1: expected.text}
    idle(server)


def test_max_waiting_counts_only_requests_without_a_slot(server: BackgroundServer) -> None:
    loop = server.state.loop
    assert loop is not None
    slots = 4  # tiny-llama: decode.lane_capacity 4, one lane
    loop.max_waiting = 1

    async def one(c: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": [i + 1], "max_tokens": 20, "ignore_eos": True}
        return (await c.post("/v1/completions", json=body)).status_code

    async def main(n: int) -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as c:
            return list(await asyncio.gather(*(one(c, i) for i in range(n))))

    try:
        assert asyncio.run(main(slots + 1)) == [200] * (slots + 1)
    finally:
        loop.max_waiting = 256
    idle(server)


def test_null_means_the_default_and_a_zero_token_budget_is_refused(
    server: BackgroundServer,
) -> None:
    """OpenAI's schema types n, stream, echo and logprobs as nullable (the openai client
    sends n=None as null); max_completion_tokens=0 is refused as max_tokens=0 is."""
    chat = f"{server.url}/v1/chat/completions"
    messages = [{"role": "user", "content": "x"}]
    nulls = {"n": None, "stream": None, "logprobs": None, "ignore_eos": None}
    r = httpx.post(chat, json={"messages": messages, "max_tokens": 3, **nulls}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "x", "max_tokens": 3, "echo": None, "n": None, "stream": None},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200, r.text
    for field in ("max_tokens", "max_completion_tokens"):
        r = httpx.post(chat, json={"messages": messages, field: 0}, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    both = {"messages": messages, "max_tokens": 10, "max_completion_tokens": 0}
    r = httpx.post(chat, json=both, timeout=TIMEOUT)  # the one used is the one named
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"


def test_streamed_text_offsets_continue_across_chunks(server: BackgroundServer) -> None:
    body = {"prompt": "Once upon", "max_tokens": 6, "temperature": 0, "logprobs": 1}
    url = f"{server.url}/v1/completions"
    whole = httpx.post(url, json=body, timeout=TIMEOUT).json()["choices"][0]["logprobs"]
    offsets: list[int] = []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=TIMEOUT) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                logprobs = json.loads(line[len("data: ") :])["choices"][0]["logprobs"]
                offsets += logprobs["text_offset"] if logprobs else []
    assert offsets == whole["text_offset"] and offsets[-1] > 0


# -- structured output ---------------------------------------------------------------------

#: Bounded in length, so even a random model completes it within max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


def _json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": schema, "strict": True},
    }


def test_every_json_schema_answer_validates_streamed_or_not(
    server: BackgroundServer, client: openai.OpenAI, reference: LLM
) -> None:
    fmt = _json_schema_format(PERSON)
    messages = [{"role": "user", "content": "A person, as JSON."}]
    answers: list[str] = []
    for temperature, seed in ((0.0, None), (1.0, 5), (1.3, 9)):
        done = client.chat.completions.create(
            model=RECIPE,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=120,
            n=2,
            temperature=temperature,
            seed=seed,
            response_format=fmt,  # type: ignore[arg-type]
        )
        answers += [c.message.content or "" for c in done.choices]
        assert all(c.finish_reason == "stop" for c in done.choices)
        text = ""
        for chunk in client.chat.completions.create(
            model=RECIPE,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=120,
            temperature=temperature,
            seed=seed,
            response_format=fmt,  # type: ignore[arg-type]
            stream=True,
        ):
            text += "".join(c.delta.content or "" for c in chunk.choices)
        answers.append(text)
        completion = client.completions.create(
            model=RECIPE,
            prompt="person:",
            max_tokens=120,
            temperature=temperature,
            seed=seed,
            extra_body={"response_format": fmt},
        )
        answers.append(completion.choices[0].text)
    for answer in answers:
        jsonschema.validate(json.loads(answer), PERSON)
    # Offline, the same params give the same greedy answer.
    ids = reference.tokenizer.encode(
        reference.tokenizer.apply_chat_template(messages), add_special_tokens=False
    )
    offline = reference.generate(
        [ids],
        SamplingParams(
            temperature=0.0, max_tokens=120, structured_output=StructuredOutput.json_schema(PERSON)
        ),
    )[0]
    assert offline.text == answers[0] == answers[1] == answers[2]
    idle(server)


def test_response_format_text_is_plain_and_a_bad_schema_is_a_400(
    server: BackgroundServer, client: openai.OpenAI
) -> None:
    plain = client.completions.create(model=RECIPE, prompt=[3, 4], max_tokens=5, temperature=0)
    text = client.completions.create(
        model=RECIPE,
        prompt=[3, 4],
        max_tokens=5,
        temperature=0,
        extra_body={"response_format": {"type": "text"}},
    )
    assert text.choices[0].text == plain.choices[0].text
    bad = _json_schema_format({"type": "no-such-type"})
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "response_format": bad},
        timeout=TIMEOUT,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format.json_schema.schema"
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema"},
        },
        timeout=TIMEOUT,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema"


#: A pattern llguidance accepts when it is compiled but cannot lex once decoding starts
#: ("lexer error: too many expressions constructed" at the first mask).
UNLEXABLE = "(a{1000}){1000}"


def test_a_structured_output_that_breaks_mid_decode_fails_alone(
    server: BackgroundServer, client: openai.OpenAI
) -> None:
    """The request's own failure is its 400 (an error event when streamed); the requests
    beside it finish and the server keeps serving, every KV block back."""
    bad = {"prompt": "code:", "max_tokens": 5, "guided_regex": UNLEXABLE}
    url = f"{server.url}/v1/completions"
    beside = threading.Thread(
        target=lambda: results.append(
            client.completions.create(model=RECIPE, prompt="x", max_tokens=40, temperature=0)
        )
    )
    results: list[Any] = []
    beside.start()
    r = httpx.post(url, json=bad, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "guided_regex" and "too many expressions" in error["message"]
    assert "<state>" not in error["message"]  # llguidance's parser dump stays out
    with httpx.stream("POST", url, json={**bad, "stream": True}, timeout=TIMEOUT) as streamed:
        events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert streamed.status_code == 200
    assert json.loads(events[-1][len("data: ") :])["error"]["param"] == "guided_regex"
    beside.join(TIMEOUT)
    assert results and results[0].choices[0].finish_reason == "length"
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200
    after = client.completions.create(model=RECIPE, prompt="x", max_tokens=3, temperature=0)
    assert after.choices[0].finish_reason == "length"
    idle(server)


def test_offline_a_broken_structured_output_raises_and_leaves_the_engine_usable(
    reference: LLM,
) -> None:
    bad = SamplingParams(
        temperature=0.0, max_tokens=5, structured_output=StructuredOutput.regex(UNLEXABLE)
    )
    good = SamplingParams(temperature=0.0, max_tokens=5)
    with pytest.raises(RequestError, match=r"structured_output.*too many expressions"):
        reference.generate(["code:", "x"], [good, bad])
    with pytest.raises(RequestError, match="structured_output"):
        list(reference.stream(["code:"], bad))
    scheduler = reference.engine.scheduler
    assert not scheduler.running and not scheduler.waiting
    assert all(a.num_free_blocks == a.config.num_blocks for a in scheduler.allocators)
    (out,) = reference.generate(["x"], good)
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_vllm_guided_extensions(client: openai.OpenAI) -> None:
    choices = ["yes", "no (maybe)", "a-b/c"]
    for seed in range(3):
        done = client.completions.create(
            model=RECIPE,
            prompt="answer:",
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_choice": choices},
        )
        assert done.choices[0].text in choices and done.choices[0].finish_reason == "stop"
        regex = client.completions.create(
            model=RECIPE,
            prompt="code:",
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_regex": "[a-z]{3}-[0-9]{2}"},
        )
        assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", regex.choices[0].text)
        guided = client.chat.completions.create(
            model=RECIPE,
            messages=[{"role": "user", "content": "person"}],
            max_tokens=120,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_json": PERSON},
        )
        jsonschema.validate(json.loads(guided.choices[0].message.content or ""), PERSON)
    with pytest.raises(openai.BadRequestError, match="guided_regex"):
        client.completions.create(
            model=RECIPE,
            prompt="x",
            max_tokens=2,
            extra_body={"guided_regex": "(", "guided_choice": None},
        )
    with pytest.raises(openai.BadRequestError, match="only one of"):
        client.completions.create(
            model=RECIPE,
            prompt="x",
            max_tokens=2,
            extra_body={"guided_regex": "a", "guided_choice": ["a"]},
        )


# -- tools ---------------------------------------------------------------------------------

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["paris", "rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 9},
                    "b": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _check_calls(calls: Any, *, names: set[str], most: int | None = None) -> None:
    assert calls, calls
    if most is not None:
        assert len(calls) <= most
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_tool_choice_make_valid_calls_streamed_or_not(
    server: BackgroundServer, client: openai.OpenAI
) -> None:
    messages: Any = [{"role": "user", "content": "weather in paris? and 2+3?"}]
    for temperature, seed in ((0.0, None), (1.0, 7)):
        done = client.chat.completions.create(
            model=RECIPE,
            messages=messages,
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=120,
            temperature=temperature,
            seed=seed,
        )
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message.tool_calls, names=set(SCHEMAS), most=1)
        named = client.chat.completions.create(
            model=RECIPE,
            messages=messages,
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "add"}},
            max_tokens=120,
            temperature=temperature,
            seed=seed,
        )
        assert named.choices[0].finish_reason == "tool_calls"
        assert named.choices[0].message.content is None
        _check_calls(named.choices[0].message.tool_calls, names={"add"})
        # Streamed: the calls arrive as tool_calls deltas, never as content.
        calls: dict[int, dict[str, str]] = {}
        reasons = []
        for chunk in client.chat.completions.create(
            model=RECIPE,
            messages=messages,
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="required",
            parallel_tool_calls=False,  # a random model may call forever otherwise
            max_tokens=200,
            temperature=temperature,
            seed=seed,
            stream=True,
        ):
            for c in chunk.choices:
                assert not c.delta.content
                for d in c.delta.tool_calls or ():
                    entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                    entry["name"] += (d.function and d.function.name) or ""
                    entry["arguments"] += (d.function and d.function.arguments) or ""
                if c.finish_reason:
                    reasons.append(c.finish_reason)
        assert reasons == ["tool_calls"] and calls
        for entry in calls.values():
            jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])
        # A named call streams its arguments as they are generated, id and name first.
        deltas = []
        for chunk in client.chat.completions.create(
            model=RECIPE,
            messages=messages,
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "add"}},
            max_tokens=120,
            temperature=temperature,
            seed=seed,
            stream=True,
        ):
            for c in chunk.choices:
                deltas.extend(c.delta.tool_calls or ())
        assert len(deltas) > 3  # token by token, not one piece at the end
        assert deltas[0].id and deltas[0].function and deltas[0].function.name == "add"
        assert all(d.id is None and d.index == 0 for d in deltas[1:])
        arguments = "".join((d.function and d.function.arguments) or "" for d in deltas)
        assert arguments == named.choices[0].message.tool_calls[0].function.arguments  # type: ignore[index]
        jsonschema.validate(json.loads(arguments), SCHEMAS["add"])
    idle(server)


def test_auto_and_none_tool_choice_and_tool_history_are_served(client: openai.OpenAI) -> None:
    history: Any = [
        {"role": "user", "content": "weather in rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "rome"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    ]
    for choice in ("auto", "none"):
        done = client.chat.completions.create(
            model=RECIPE,
            messages=history,
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice=choice,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
        )
        message = done.choices[0].message
        # A random model writes no call here: its text comes back as content.
        assert message.tool_calls is None and isinstance(message.content, str)
        assert done.usage is not None
        # The prompt holds the tool list, the earlier call and its result.
        without = client.chat.completions.create(
            model=RECIPE, messages=history[:1], max_tokens=1, temperature=0
        )
        assert without.usage is not None
        assert done.usage.prompt_tokens > without.usage.prompt_tokens + 200
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(
            model=RECIPE, messages=history[:1], tool_choice="required", max_tokens=2
        )
    with pytest.raises(openai.BadRequestError, match=r"tool_choice\.function\.name"):
        client.chat.completions.create(
            model=RECIPE,
            messages=history[:1],
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "nope"}},
            max_tokens=2,
        )


# -- the process ---------------------------------------------------------------------------


def _start(args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmrt.cli", "serve", RECIPE, "--port", "0", *args],
            stderr=sink,
            stdout=subprocess.DEVNULL,
            env=env,
        )
    deadline = time.monotonic() + TIMEOUT
    while not (found := re.search(r"http://127\.0\.0\.1:(\d+)", log.read_text())):
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
        time.sleep(0.05)
    url = f"http://127.0.0.1:{found.group(1)}"
    while httpx.get(f"{url}/health", timeout=TIMEOUT).status_code != 200:
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
        time.sleep(0.1)
    return proc, url


#: Room for long streams (tiny-llama holds 512 positions by default).
LONGER = [
    "--set", "model.max_position_embeddings=4096",
    "--set", "serving.max_model_len=4096",
    "--set", "kv_cache.max_num_blocks=2048",
]  # fmt: skip


def _signal_once_running(
    proc: subprocess.Popen[bytes],
    threads: list[threading.Thread],
    started: threading.Barrier,
    log: Path,
    signals: list[signal.Signals],
    *,
    settle: float = 0.0,
) -> float:
    """Start the clients, send ``signals`` (``settle`` s apart, the first ``settle`` s after
    every client ran) and require exit 0; the seconds from the first signal to the exit."""
    for t in threads:
        t.start()
    started.wait(TIMEOUT)
    time.sleep(settle)
    signalled = time.monotonic()
    for i, sig in enumerate(signals):
        if i:
            time.sleep(settle)
        proc.send_signal(sig)
    assert proc.wait(TIMEOUT) == 0, log.read_text()
    exited = time.monotonic() - signalled
    for t in threads:
        t.join(TIMEOUT)
    return exited


def _reap(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_shutdown_past_its_timeout_ends_every_stream_and_exits_promptly(tmp_path: Path) -> None:
    """Eight long streams on four slots: past the timeout each open one gets a final chunk
    with finish_reason "abort" and [DONE], one log line each, no traceback."""
    log = tmp_path / "serve.log"
    timeout = 1.0
    proc, url = _start(["--shutdown-timeout", str(timeout), "--log-level", "info", *LONGER], log)
    try:
        results: list[tuple[list[str], bool]] = []
        started = threading.Barrier(9)

        def client(i: int) -> None:
            body = {
                "messages": [{"role": "user", "content": f"story {i}"}],
                "max_tokens": 4000,
                "ignore_eos": True,
                "stream": True,
            }
            reasons, done, count = [], False, 0
            with httpx.stream(
                "POST", f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT
            ) as r:
                for sse in r.iter_lines():
                    if sse == "data: [DONE]":
                        done = True
                    elif sse.startswith("data: "):
                        count += 1
                        if count == 1:  # the role chunk: the engine accepted the request
                            started.wait(TIMEOUT)
                        reason = json.loads(sse[6:])["choices"][0]["finish_reason"]
                        if reason is not None:
                            reasons.append(reason)
            results.append((reasons, done))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        exited = _signal_once_running(proc, threads, started, log, [signal.SIGTERM])
    finally:
        _reap(proc)
    text = log.read_text()
    assert len(results) == 8 and all(done for _, done in results), results
    assert all(reasons in (["abort"], ["length"]) for reasons, _ in results), results
    cut = sum(reasons == ["abort"] for reasons, _ in results)
    assert cut >= 4, results  # 4000 steps cannot have finished in time
    assert "Traceback" not in text and "CancelledError" not in text, text
    lines = re.findall(r"cut chatcmpl-\w+ choice 0 after \d+ generated tokens", text)
    assert len(lines) == cut, text
    # The target is 1 s past the timeout; the bound leaves room for a loaded CI.
    assert exited < timeout + 4, (exited, text)
    print(f"exited {exited:.2f} s after SIGTERM (timeout {timeout} s), {cut} streams cut")


def test_a_second_sigint_cuts_every_request_with_its_ending(tmp_path: Path) -> None:
    """The first SIGINT drains (30 s default timeout); a second cuts the open requests now:
    streams end with "abort" and [DONE], plain requests answer 200 with what they have,
    no traceback, exit 0 long before the timeout."""
    log = tmp_path / "serve.log"
    proc, url = _start(["--log-level", "info", *LONGER], log)
    results: list[tuple[str, int, str | None, bool]] = []
    try:
        started = threading.Barrier(5)

        def client(stream: bool) -> None:
            body = {"prompt": "story", "max_tokens": 3000, "ignore_eos": True, "stream": stream}
            if not stream:
                started.wait(TIMEOUT)  # its request is queued before the signals
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
                reason = r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else None
                results.append(("plain", r.status_code, reason, True))
                return
            reason, done = None, False
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
                for n, sse in enumerate(r.iter_lines()):
                    if n == 0:
                        started.wait(TIMEOUT)
                    if sse == "data: [DONE]":
                        done = True
                    elif sse.startswith("data: "):
                        reason = json.loads(sse[6:])["choices"][0]["finish_reason"] or reason
            results.append(("stream", r.status_code, reason, done))

        threads = [threading.Thread(target=client, args=(i < 2,)) for i in range(4)]
        exited = _signal_once_running(
            proc, threads, started, log, [signal.SIGINT, signal.SIGINT], settle=0.5
        )
    finally:
        _reap(proc)
    text = log.read_text()
    assert sorted(results) == [
        ("plain", 200, "abort", True),
        ("plain", 200, "abort", True),
        ("stream", 200, "abort", True),
        ("stream", 200, "abort", True),
    ], (results, text)
    assert "Traceback" not in text and "CancelledError" not in text, text
    assert "SIGINT again during shutdown" in text, text
    assert exited < 15, (exited, text)  # the drain alone would wait 30 s


def test_the_port_answers_503_from_the_first_moment_until_warm(tmp_path: Path) -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmrt.cli", "serve", RECIPE, "--port", str(port)],
        stderr=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        env=env,
    )
    answers: list[tuple[int, str]] = []
    first: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + TIMEOUT
        while not answers or answers[-1][0] != 200:
            assert time.monotonic() < deadline and proc.poll() is None, answers
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=TIMEOUT)
            except httpx.ConnectError:
                assert not answers, "refused after it had answered"
                time.sleep(0.02)
                continue
            answers.append((r.status_code, r.json()["status"]))
            first = first or r.json()
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(TIMEOUT)
    assert answers[0] == (503, "starting")  # answered while still importing and building
    # ... in a shape OpenAI clients read as well (the API's own error object)
    assert first["error"]["type"] == "service_unavailable", first
    assert set(answers[:-1]) == {(503, "starting")} and answers[-1] == (200, "ok")


def test_cli_port_in_use_bad_host_and_a_model_file_as_recipe_are_one_line_exit_2(
    tmp_path: Path,
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\xff\xfe" + bytes(range(256)))
    cases: list[tuple[list[str], str]] = [
        ([RECIPE, "--port", str(port)], "already in use"),
        ([RECIPE, "--host", "no-such-host.invalid", "--port", "0"], "cannot resolve"),
        ([str(binary), "--port", "0"], "neither a recipe"),
    ]
    try:
        for args, reason in cases:
            done = subprocess.run(
                [sys.executable, "-m", "llmrt.cli", "serve", *args],
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
            )
            assert done.returncode == 2, done.stderr
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("llmrt: error:"), done.stderr
            assert reason in lines[0], lines[0]
        # A recipe whose model file is missing: the socket is bound first, then one line.
        recipe = tmp_path / "missing-model.yaml"
        text = (Path(__file__).parents[2] / "recipes" / "smollm2-135m.yaml").read_text()
        lines = [ln for ln in text.splitlines() if not ln.strip().startswith(("package:", "file:"))]
        at = next(i for i, ln in enumerate(lines) if ln.strip().startswith("format:"))
        lines.insert(at + 1, f"  path: {tmp_path / 'missing.gguf'}")
        recipe.write_text("\n".join(lines) + "\n")
        done = subprocess.run(
            [sys.executable, "-m", "llmrt.cli", "serve", str(recipe), "--port", "0"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("llmrt: error: checkpoint.path") and "no such file" in last, (
            done.stderr
        )
    finally:
        taken.close()
