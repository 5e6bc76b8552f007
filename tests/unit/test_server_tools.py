"""Tool calling's pure parts: the prompt a template gets, the constraint of a required or
named choice, and parsing a reply into calls."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from llmrt.errors import RequestError
from llmrt.sampling.guided import GuidedDecoding
from llmrt.server.tools import ToolUse, render_history

WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": ADD}]


def use(choice: Any = "auto", parallel: bool | None = None) -> ToolUse:
    made = ToolUse.create(tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel)
    assert made is not None
    return made


def test_choices_are_validated() -> None:
    assert ToolUse.create(tools=None, tool_choice=None, parallel_tool_calls=None) is None
    assert ToolUse.create(tools=None, tool_choice="none", parallel_tool_calls=None) is None
    with pytest.raises(RequestError, match="tool_choice: needs tools"):
        ToolUse.create(tools=None, tool_choice="required", parallel_tool_calls=None)
    with pytest.raises(RequestError, match=r"tool_choice\.function\.name"):
        use({"type": "function", "function": {"name": "nope"}})
    with pytest.raises(RequestError, match="unique"):
        ToolUse.create(tools=TOOLS + TOOLS[:1], tool_choice=None, parallel_tool_calls=None)
    assert use().choice == "auto" and use().parallel


@pytest.mark.parametrize(
    "reply",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '[{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}]',
    ],
)
def test_auto_parses_the_common_call_forms(reply: str) -> None:
    content, calls = use().parse(reply)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_auto_keeps_text_that_is_not_a_call_and_text_around_calls() -> None:
    for text in ("Paris is sunny.", '{"name": "unknown", "arguments": {}}', "{not json"):
        assert use().parse(text) == (text, [])
    content, calls = use().parse(
        'Let me check.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    )
    assert content == "Let me check." and [c.arguments for c in calls] == ['{"a": 1}', '{"a": 2}']
    _, one = use(parallel=False).parse(
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    )
    assert len(one) == 1
    assert use("none").parse('{"name": "add", "arguments": {}}')[1] == []


def test_streams_hold_back_only_what_may_be_a_call() -> None:
    auto = use()
    assert auto.may_be_call("") and auto.may_be_call("  {") and auto.may_be_call("<tool")
    assert not auto.may_be_call("Hello") and not auto.may_be_call("<b>")
    assert not use("none").may_be_call("{")
    assert use("required").may_be_call("anything")


def test_required_and_named_constraints_accept_exactly_valid_calls() -> None:
    assert use().structured_output() is None and use("none").structured_output() is None
    required = use("required", parallel=False).structured_output()
    assert required is not None and required.kind == "json_schema"
    schema = json.loads(required.spec)
    ok = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}}]}
    jsonschema.validate(ok, schema)
    for bad in (
        {"tool_calls": []},
        {"tool_calls": [{"name": "get_weather", "arguments": {}}]},
        {"tool_calls": [{"name": "other", "arguments": {}}]},
        {"tool_calls": [ok["tool_calls"][0], ok["tool_calls"][0]]},  # not parallel
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    GuidedDecoding.grammar(required)  # llguidance compiles it
    named = use({"type": "function", "function": {"name": "add"}}).structured_output()
    assert named is not None and json.loads(named.spec) == ADD["parameters"]
    content, calls = use({"type": "function", "function": {"name": "add"}}).parse('{"a": 3}')
    assert content is None and calls[0].name == "add" and json.loads(calls[0].arguments) == {"a": 3}


HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_a_template_that_renders_tools_gets_them_and_calls_as_objects() -> None:
    messages, extra = render_history(
        HISTORY, use(), template_source="{% for t in tools %}{{ m.tool_calls }}{% endfor %}"
    )
    assert extra == {"tools": TOOLS}
    assert messages[0] == HISTORY[0] and len(messages) == len(HISTORY)
    call = messages[2]["tool_calls"][0]
    assert call["function"]["arguments"] == {"city": "Rome"}
    assert messages[3] == HISTORY[3]


def test_a_template_without_tools_gets_the_generic_prompt_and_calls_as_json() -> None:
    messages, extra = render_history(HISTORY, use(), template_source="{{ m.content }}")
    assert extra == {}
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert "get_weather" in messages[0]["content"] and '"tool_calls"' in messages[0]["content"]
    written = json.loads(messages[2]["content"])
    assert written == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}}]}
    assert "tool_calls" not in messages[2]
    no_system, _ = render_history(HISTORY[1:2], use(), template_source="")
    assert [m["role"] for m in no_system] == ["system", "user"]


def test_a_reply_cut_short_keeps_its_whole_calls() -> None:
    call = '{"name": "add", "arguments": {"a": 1}}'
    content, calls = use("required").parse('{"tool_calls": [' + f"{call}, {call}, " + '{"na')
    assert content is None and [c.arguments for c in calls] == ['{"a": 1}', '{"a": 1}']
    assert use().parse('{"tool_calls": [{"na') == ('{"tool_calls": [{"na', [])
