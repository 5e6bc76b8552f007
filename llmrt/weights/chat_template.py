"""Chat templates: Jinja2 source from a checkpoint, rendered in a sandbox.

The environment follows the one Hugging Face transformers renders chat templates with
(`trim_blocks`, `lstrip_blocks`, loop controls, a non-escaping `tojson`, `raise_exception`,
`strftime_now`), so the same template gives the same text here and there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import attrs
import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmrt.errors import CheckpointError, RequestError


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` and renders the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@attrs.frozen(kw_only=True, eq=False)
class ChatTemplate:
    """A compiled chat template; `source` is the Jinja2 text it was compiled from."""

    source: str
    _template: jinja2.Template

    @classmethod
    def compile(cls, *, source: str, item: str = "chat_template") -> ChatTemplate:
        """Compile `source`; a syntax error is a `CheckpointError` naming `item`."""
        try:
            template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise CheckpointError(item, f"invalid Jinja2 chat template: {exc}") from exc
        return cls(source=source, template=template)

    def render(
        self,
        *,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        bos_token: str | None,
        eos_token: str | None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """Render `messages`; a template error (`raise_exception`) becomes a `RequestError`."""
        variables: dict[str, Any] = dict(extra or {})
        variables.update(
            messages=[dict(message) for message in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
        )
        try:
            return self._template.render(**variables)
        except (jinja2.exceptions.TemplateError, TypeError) as exc:
            reason = f"chat template rejected the conversation: {exc}"
            raise RequestError("messages", reason) from exc
