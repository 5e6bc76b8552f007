"""The server's text checks before parsing and tokenizing: the longest JSON string of a
raw body, the byte bound of a prompt, lone surrogates."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmrt.errors import RequestError
from llmrt.server.text_work import TextWorkers, check_unicode, longest_json_string
from llmrt.weights.tokenizer import byte_tokenizer

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def _strings(value: object) -> list[tuple[str, str | None]]:
    """Every string value with the key it is under (keys count as strings too)."""
    out: list[tuple[str, str | None]] = []
    if isinstance(value, str):
        out.append((value, None))
    elif isinstance(value, dict):
        for k, v in value.items():
            out.append((k, None))
            out.extend((s, k) if isinstance(v, str) else (s, key) for s, key in _strings(v))
    elif isinstance(value, list):
        for v in value:
            out.extend(_strings(v))
    return out


@settings(max_examples=200, deadline=None)
@given(document=JSON, ascii=st.booleans())
def test_longest_json_string_is_the_longest_literal_as_written(
    document: object, ascii: bool
) -> None:
    raw = json.dumps(document, ensure_ascii=ascii).encode()
    written = [len(json.dumps(s, ensure_ascii=ascii).encode()) - 2 for s, _ in _strings(document)]
    length, _ = longest_json_string(raw)
    assert length == max(written, default=0)


def test_the_longest_string_is_named_by_its_key() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": 'a"\\b' * 100}]}
    assert longest_json_string(json.dumps(body).encode()) == (600, "content")
    assert longest_json_string(b'["x", "yyyy"]') == (4, None)


def test_bounds_refuse_what_no_context_holds_and_pass_the_rest() -> None:
    tokenizer = byte_tokenizer()
    workers = TextWorkers(tokenizer=tokenizer, max_model_len=100)
    try:
        # The byte tokenizer's widest token is a special one ("</s>", 4 bytes).
        assert workers.max_token_bytes == 4
        workers.check_length("x" * 400, "prompt")
        with pytest.raises(RequestError, match="prompt: has 401 bytes"):
            workers.check_length("x" * 401, "prompt")
        workers.check_body(json.dumps({"prompt": "x" * 2400}).encode())
        with pytest.raises(RequestError, match="prompt: holds a string of 2401 bytes"):
            workers.check_body(json.dumps({"prompt": "x" * 2401}).encode())
        ids = json.dumps({"prompt": [[1] * 1000] * 10}).encode()  # long, but no string
        workers.check_body(ids)
    finally:
        workers.close()


def test_lone_surrogates_are_named_by_their_field() -> None:
    check_unicode({"messages": [{"content": "fine"}]}, "")
    with pytest.raises(RequestError, match=r"messages\.0\.content: is not valid Unicode"):
        check_unicode({"messages": [{"content": "a\ud800"}]}, "")
