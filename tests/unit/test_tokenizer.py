"""The Tokenizer interface on the byte tokenizer: encode/decode, streaming, chat templates."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from llmrt.errors import CheckpointError, RequestError, UnsupportedError
from llmrt.weights import BYTE_VOCAB_SIZE, DetokenizerStream, Tokenizer, byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return byte_tokenizer()


def with_template(base: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer.create(
        backend=HFTokenizer.from_str(base.backend.to_str()),
        bos_token="<s>",
        eos_tokens=["</s>"],
        chat_template=template,
        item="test",
    )


def test_byte_ids_and_specials(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == BYTE_VOCAB_SIZE == 258
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids) == (256, (257,))
    text = "héllo 😀"
    raw = list(text.encode("utf-8"))
    assert tokenizer.encode(text, add_special_tokens=False) == raw
    assert tokenizer.encode(text) == [256, *raw]
    assert tokenizer.encode("<s>a</s>", add_special_tokens=False) == [256, 97, 257]
    assert tokenizer.decode([256, *raw, 257]) == text
    assert tokenizer.decode([256, *raw, 257], skip_special_tokens=False) == f"<s>{text}</s>"


@given(st.text(max_size=40))
def test_byte_round_trip(text: str) -> None:
    assume("<s>" not in text and "</s>" not in text)  # special tokens in text stay special
    tokenizer = byte_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


@given(st.text(max_size=30))
def test_stream_emits_only_complete_characters(text: str) -> None:
    assume("<s>" not in text and "</s>" not in text)
    tokenizer = byte_tokenizer()
    stream = tokenizer.stream()
    pieces = [stream.push(i) for i in tokenizer.encode(text)]
    assert "".join(pieces) + stream.flush() == text
    assert all("\ufffd" not in piece for piece in pieces if "\ufffd" not in text)


def test_stream_holds_back_a_split_character(tokenizer: Tokenizer) -> None:
    stream = DetokenizerStream(tokenizer=tokenizer)
    emoji = list("😀".encode())
    assert [stream.push(b) for b in emoji[:3]] == ["", "", ""]
    assert stream.push(emoji[3]) == "😀"
    assert stream.extend([ord("o"), ord("k")]) == "ok"
    assert stream.push(0xE6) == ""
    assert stream.flush() == "\ufffd"  # incomplete at the end: surfaced, not lost
    assert stream.push(ord("!")) == "!"


def test_stream_keeps_special_tokens_when_asked(tokenizer: Tokenizer) -> None:
    stream = tokenizer.stream(skip_special_tokens=False)
    assert stream.extend([256, 104, 105, 257]) == "<s>hi</s>"
    assert tokenizer.stream().extend([256, 104, 105, 257]) == "hi"


def test_chat_template(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tokenizer.apply_chat_template(messages) == "user: hi\nassistant: yo\nassistant: "
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == (
        "user: hi\nassistant: yo\n"
    )


def test_chat_template_variables_and_helpers(tokenizer: Tokenizer) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
        "{{ m | tojson }}{% generation %}|{% endgeneration %}{% endfor %}"
        "{{ eos_token }}{{ extra_flag }}"
    )
    chat = with_template(tokenizer, template)
    rendered = chat.apply_chat_template(
        [{"role": "user", "content": "<é>"}], extra={"extra_flag": "!"}
    )
    assert rendered == '<s>{"role": "user", "content": "<é>"}|</s>!'
    with pytest.raises(RequestError, match="bad role tool"):
        chat.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_sandbox_blocks_python_internals(tokenizer: Tokenizer) -> None:
    chat = with_template(tokenizer, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(RequestError):
        chat.apply_chat_template([{"role": "user", "content": "x"}])


def test_invalid_or_missing_template(tokenizer: Tokenizer) -> None:
    with pytest.raises(CheckpointError, match=r"test\.chat_template"):
        with_template(tokenizer, "{% for %}")
    bare = Tokenizer.create(
        backend=tokenizer.backend, bos_token=None, eos_tokens=[], chat_template=None, item="t"
    )
    with pytest.raises(UnsupportedError):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def test_unknown_special_token_is_named(tokenizer: Tokenizer) -> None:
    with pytest.raises(CheckpointError) as info:
        Tokenizer.create(
            backend=tokenizer.backend,
            bos_token="<bos>",
            eos_tokens=["</s>"],
            chat_template=None,
            item="tok",
        )
    assert info.value.item == "tok.bos_token"
    with pytest.raises(CheckpointError, match="eos_token_id"):
        Tokenizer.create(
            backend=tokenizer.backend,
            bos_token=None,
            eos_tokens=[],
            extra_eos_token_ids=[9999],
            chat_template=None,
            item="tok",
        )


def test_json_round_trip(tokenizer: Tokenizer) -> None:
    restored = Tokenizer.from_json(tokenizer.to_json(), item="cache")
    assert restored.encode("abc é") == tokenizer.encode("abc é")
    assert (restored.bos_token_id, restored.eos_token_ids) == (256, (257,))
    assert restored.apply_chat_template([{"role": "user", "content": "q"}]) == (
        tokenizer.apply_chat_template([{"role": "user", "content": "q"}])
    )
    with pytest.raises(CheckpointError, match="cache"):
        Tokenizer.from_json(tokenizer.to_json()[:100], item="cache")
