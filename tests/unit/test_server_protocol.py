"""The OpenAI request models' own rules (what the endpoints build from a body)."""

from __future__ import annotations

from llmrt.server.protocol import ChatMessage


def test_text_parts_of_a_message_are_its_lines() -> None:
    message = ChatMessage.model_validate(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    )
    assert message.to_template() == {"role": "user", "content": "a\nb"}
