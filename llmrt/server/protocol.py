"""OpenAI request shapes (pydantic, strict) and how their sampling fields map onto
:class:`~llmrt.sampling.params.SamplingParams`.

Unknown fields and wrong types are refused (HTTP 400 naming the field), as OpenAI does;
vLLM's extensions ``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids`` and
``ignore_eos`` are accepted (the ``openai`` client sends them through ``extra_body``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from llmrt.errors import RequestError
from llmrt.sampling.params import SamplingParams
from llmrt.sampling.structured import StructuredOutput
from llmrt.server.tools import ToolUse

#: The ``max_tokens`` default of ``/v1/completions`` (OpenAI's legacy default).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: Most choices one request may ask for (``n``; OpenAI's own limit is 128).
MAX_CHOICES = 128


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JSONSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def structured(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput.json_object()
        if self.json_schema is None:
            raise RequestError("response_format.json_schema", "is required for type json_schema")
        schema = self.json_schema.schema_
        if schema is None:
            raise RequestError("response_format.json_schema.schema", "is required")
        try:
            return StructuredOutput.json_schema(schema)
        except RequestError as exc:
            raise RequestError("response_format.json_schema.schema", exc.reason) from None


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # vLLM's guided-decoding extensions (``extra_body`` in the openai client).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    user: str | None = None

    @field_validator(
        "n", "stream", "ignore_eos", "echo", "logprobs", mode="before", check_fields=False
    )
    @classmethod
    def _null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        """``null`` means the default, as OpenAI's schema types these fields (the openai
        client sends ``n=None`` as null)."""
        if value is None and info.field_name is not None:
            return cls.model_fields[info.field_name].default
        return value

    def check_unsupported(self) -> None:
        if not 1 <= self.n <= MAX_CHOICES:
            raise RequestError("n", f"must be in [1, {MAX_CHOICES}]", value=self.n)
        if self.logit_bias:
            raise RequestError("logit_bias", "is not supported", value=self.logit_bias)
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options", "is only allowed with stream=true")

    def structured_output(self) -> StructuredOutput | None:
        """What the output must match: ``response_format`` or one of vLLM's ``guided_*``."""
        given = {
            name: value
            for name, value in (
                ("response_format", self.response_format),
                ("guided_json", self.guided_json),
                ("guided_regex", self.guided_regex),
                ("guided_choice", self.guided_choice),
            )
            if value is not None
            and not (isinstance(value, ResponseFormat) and value.type == "text")
        }
        if len(given) > 1:
            raise RequestError(sorted(given)[1], f"give only one of {', '.join(sorted(given))}")
        if self.response_format is not None:
            return self.response_format.structured()
        if self.guided_json is not None:
            try:
                return StructuredOutput.json_schema(self.guided_json)
            except RequestError as exc:
                raise RequestError("guided_json", exc.reason) from None
        if self.guided_regex is not None:
            if not self.guided_regex:
                raise RequestError("guided_regex", "is empty")
            return StructuredOutput.regex(self.guided_regex)
        if self.guided_choice is not None:
            if not self.guided_choice:
                raise RequestError("guided_choice", "is empty")
            return StructuredOutput.regex("|".join(_regex_literal(c) for c in self.guided_choice))
        return None

    def sampling_params(self, *, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; a bad value raises RequestError naming the field."""
        given: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logprobs": logprobs,
            "structured_output": self.structured_output(),
        }
        return SamplingParams(**{k: v for k, v in given.items() if v is not None})


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise RequestError("echo", "is not supported", value=True)
        if self.suffix is not None:
            raise RequestError("suffix", "is not supported", value=self.suffix)
        if self.best_of not in (None, 1):
            raise RequestError("best_of", "only 1 is supported", value=self.best_of)

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request (a string or token ids), in choice order."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise RequestError("prompt", "is empty")
        if all(isinstance(t, int) for t in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class MessageToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def to_template(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            # Text parts are lines of one message, as vLLM's chat parser joins them.
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_use(self) -> ToolUse | None:
        """The request's tools and choice (None without tools)."""
        choice = self.tool_choice
        return ToolUse.create(
            tools=[t.model_dump(exclude_none=True) for t in self.tools or ()],
            tool_choice=choice.model_dump() if isinstance(choice, NamedToolChoice) else choice,
            parallel_tool_calls=self.parallel_tool_calls,
        )

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs", "needs logprobs=true", value=self.top_logprobs)

    def engine_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's shape): a prompt, or chat messages rendered first."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's shape): token ids back to text."""

    model: str | None = None
    tokens: list[int]


def _regex_literal(text: str) -> str:
    """``text`` as a regex matching exactly it (llguidance's regex syntax escapes these)."""
    return "".join("\\" + c if c in r".^$*+?()[]{}|\\/-" else c for c in text)
