"""Tool calling: the prompt that shows the model its tools, the constraint that makes a
required or named call, and the parser that turns its output into ``tool_calls``.

The model's chat template renders ``tools`` and the tool history where it knows how (its
source mentions ``tools`` / ``tool_calls``, as Hugging Face templates do). A template that
does not is given llama-server's generic form: a system message listing the tools and the
JSON a call is written as, and earlier calls written into the assistant's text as that JSON.

What the model writes (``tool_choice``):

- ``none``: text only; nothing is parsed.
- ``auto``: free text; a reply that is a call (Hermes ``<tool_call>{...}</tool_call>``
  blocks, or the generic JSON) becomes ``tool_calls``, anything else stays ``content``.
- ``required``: constrained to the generic JSON ``{"tool_calls": [{"name", "arguments"}]}``
  (one call unless ``parallel_tool_calls``), each call's arguments to its parameters schema;
  a reply max_tokens cut keeps its whole calls (``finish_reason`` stays ``length``).
- a named function: constrained to that function's arguments object (as vLLM does).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

import attrs

from llmrt.errors import RequestError
from llmrt.sampling.structured import StructuredOutput

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_CUT_CALLS = re.compile(r'\s*\{\s*"tool_calls"\s*:\s*\[')


@attrs.frozen(kw_only=True)
class ToolCall:
    """One call the model made: a function name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = attrs.Factory(lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


@attrs.frozen(kw_only=True)
class ToolUse:
    """A request's tools and how the model must use them (validated once)."""

    functions: tuple[dict[str, Any], ...]
    """Each tool's OpenAI ``function`` object (name, description, parameters)."""
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None
    parallel: bool = True

    @classmethod
    def create(
        cls,
        *,
        tools: Sequence[dict[str, Any]] | None,
        tool_choice: str | dict[str, Any] | None,
        parallel_tool_calls: bool | None,
    ) -> ToolUse | None:
        """None when the request has no tools (a ``tool_choice`` other than ``none`` then
        is a RequestError, as OpenAI answers)."""
        functions = tuple(t["function"] for t in tools or ())
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            raise RequestError("tools", "function names must be unique", value=names)
        if not functions:
            if tool_choice not in (None, "none"):
                raise RequestError("tool_choice", "needs tools", value=tool_choice)
            return None
        parallel = True if parallel_tool_calls is None else parallel_tool_calls
        if tool_choice is None:
            return cls(functions=functions, choice="auto", parallel=parallel)
        if isinstance(tool_choice, str):
            return cls(functions=functions, choice=tool_choice, parallel=parallel)
        name = tool_choice["function"]["name"]
        if name not in names:
            raise RequestError(
                "tool_choice.function.name", f"is not one of the tools {names}", value=name
            )
        return cls(functions=functions, choice="named", named=name, parallel=parallel)

    def function(self, name: str) -> dict[str, Any]:
        return next(f for f in self.functions if f["name"] == name)

    # -- the prompt ---------------------------------------------------------------------

    def template_tools(self) -> list[dict[str, Any]]:
        """``tools`` as Hugging Face chat templates read them."""
        return [{"type": "function", "function": f} for f in self.functions]

    def system_prompt(self) -> str:
        """llama-server's generic tool prompt, for templates that do not render tools."""
        listed = json.dumps(self.template_tools())
        many = "one or more calls" if self.parallel else "exactly one call"
        return (
            "You can call these tools:\n"
            f"{listed}\n\n"
            "To call tools, reply with only this JSON, " + many + ":\n"
            '{"tool_calls": [{"name": "<tool name>", "arguments": {<the tool\'s arguments>}}]}\n'
            "Otherwise, reply to the user in plain text."
        )

    # -- what the model writes ------------------------------------------------------------

    def structured_output(self) -> StructuredOutput | None:
        """The constraint of ``required`` or a named choice (None for ``auto`` / ``none``)."""
        if self.choice == "named":
            assert self.named is not None
            return StructuredOutput.json_schema(_parameters(self.function(self.named)))
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": _parameters(f)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in self.functions
        ]
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutput.json_schema(
            {
                "type": "object",
                "properties": {"tool_calls": array},
                "required": ["tool_calls"],
                "additionalProperties": False,
            }
        )

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a finished reply (content None when it was only calls)."""
        if self.choice == "none":
            return text, []
        if self.choice == "named":
            assert self.named is not None
            # The constraint made the whole reply the arguments; streamed as written.
            return None, [ToolCall(name=self.named, arguments=text)]
        calls: list[ToolCall] = []
        rest = text
        blocks = _HERMES.findall(text)
        if blocks:
            for block in blocks:
                calls.extend(self._calls_in(_loads(block)))
            rest = _HERMES.sub("", text).strip()
        else:
            data = _loads(text.strip())
            found = self._calls_in(data) if data is not None else []
            if not found and data is None:
                found = self._calls_in(_complete_calls(text.strip()))
            if found:
                calls, rest = found, ""
        if not calls:
            return text, []
        if not self.parallel:
            calls = calls[:1]
        return (rest or None), calls

    def _calls_in(self, data: Any) -> list[ToolCall]:
        """Calls in parsed JSON: ``{"tool_calls": [...]}``, a list of calls, or one call;
        a call names a known tool and has ``arguments`` (or ``parameters``) as an object."""
        if isinstance(data, dict) and "tool_calls" in data:
            data = data["tool_calls"]
        items = data if isinstance(data, list) else [data]
        known = {f["name"] for f in self.functions}
        calls = []
        for item in items:
            if not isinstance(item, dict) or item.get("name") not in known:
                return []
            arguments = item.get("arguments", item.get("parameters", {}))
            if isinstance(arguments, str):
                parsed = _loads(arguments)
                arguments = parsed if isinstance(parsed, dict) else None
            if not isinstance(arguments, dict):
                return []
            calls.append(ToolCall(name=item["name"], arguments=json.dumps(arguments)))
        return calls

    def may_be_call(self, text: str) -> bool:
        """Whether a reply beginning with ``text`` may still turn out to be a call (a stream
        holds such text back until it knows)."""
        if self.choice in ("required", "named"):
            return True
        if self.choice == "none":
            return False
        head = text.lstrip()
        if not head:
            return True
        marker = "<tool_call>"
        return head[0] in "{[" or head.startswith(marker) or marker.startswith(head)


def render_history(
    messages: list[dict[str, Any]], tools: ToolUse | None, *, template_source: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and template variables for the chat template (see the module doc)."""
    knows_tools = "tools" in template_source
    knows_calls = "tool_calls" in template_source
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls and not knows_calls:
            written = {"tool_calls": [_generic_call(c) for c in calls]}
            text = message.get("content") or ""
            message = {
                "role": "assistant",
                "content": (text + "\n" if text else "") + json.dumps(written),
            }
        elif calls:
            message = {**message, "tool_calls": [_template_call(c) for c in calls]}
        out.append(message)
    extra: dict[str, Any] = {}
    if tools is not None:
        if knows_tools:
            extra["tools"] = tools.template_tools()
        else:
            system = {"role": "system", "content": tools.system_prompt()}
            if out and out[0]["role"] == "system":
                merged = f"{out[0]['content']}\n\n{system['content']}"
                out[0] = {**out[0], "content": merged}
            else:
                out.insert(0, system)
    return out, extra


def _complete_calls(text: str) -> list[Any] | None:
    """The whole calls of a generic reply cut short (``{"tool_calls": [{...}, {...}, {``,
    what max_tokens leaves of a model repeating calls), or None."""
    head = _CUT_CALLS.match(text)
    if head is None:
        return None
    at = head.end()
    decoder = json.JSONDecoder()
    items: list[Any] = []
    while True:
        while at < len(text) and text[at] in " \n\t\r,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            break
        items.append(item)
    return items or None


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    return parameters if isinstance(parameters, dict) else {"type": "object"}


def _generic_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    arguments = _loads(function["arguments"])
    return {"name": function["name"], "arguments": arguments}


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """A call as Hugging Face templates read it: arguments as an object."""
    function = call["function"]
    arguments = _loads(function["arguments"])
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {
            "name": function["name"],
            "arguments": arguments if arguments is not None else function["arguments"],
        },
    }


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError, RecursionError):
        return None

