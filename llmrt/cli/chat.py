"""``llmrt chat``: a multi-turn conversation in the terminal, streamed token by token.

Like ``llama-cli -cnv`` or ``ollama run``: each turn is rendered with the model's chat
template over the whole conversation (the prefix cache keeps earlier turns' KV, so a turn
prefills only what is new), the answer streams as it decodes, and a stats line (prompt
tokens, time to first token, tokens/s) follows it on stderr. ``/reset`` forgets the
conversation, ``/system TEXT`` sets the system prompt (and resets), ``/exit`` leaves (so do
Ctrl-D and end of input). Ctrl-C stops the answer being written, not the session. A
conversation that outgrows ``serving.max_model_len`` drops its oldest exchanges. When
stdin is not a terminal each line is one user turn, and only the answers go to stdout.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, TextIO

import attrs

from llmrt.sampling.params import SamplingParams
from llmrt.serving.llm import LLM

HELP = "/reset: forget the conversation · /system TEXT: set the system prompt · /exit: leave"
EXIT_COMMANDS = frozenset({"/exit", "/quit", "/bye"})


@attrs.frozen(kw_only=True)
class AnswerStats:
    """What one answer cost: ``ttft_s`` from submission to the first token, and the decode
    speed over the tokens after it."""

    prompt_tokens: int
    new_tokens: int
    ttft_s: float
    total_s: float
    finish_reason: str

    @property
    def tokens_per_s(self) -> float:
        decode_s = self.total_s - self.ttft_s
        if self.new_tokens > 1 and decode_s > 0:
            return (self.new_tokens - 1) / decode_s
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def line(self) -> str:
        stopped = {
            "interrupted": ", stopped",
            "length": ", cut at the token limit",
        }.get(self.finish_reason, "")
        return (
            f"[{self.new_tokens} tokens, {self.tokens_per_s:.1f} tokens/s, first token "
            f"{self.ttft_s * 1000:.0f} ms, prompt {self.prompt_tokens} tokens{stopped}]"
        )


class Conversation:
    """The messages so far and the system prompt; renders them with the chat template."""

    def __init__(self, *, system: str | None) -> None:
        self.system = system
        self.messages: list[dict[str, str]] = []

    def reset(self) -> None:
        self.messages = []

    def with_user(self, text: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.messages, {"role": "user", "content": text}]


class _Interrupts:
    """Ctrl-C while an answer streams sets ``stop`` instead of raising (the engine is never
    torn mid-step); elsewhere it raises ``KeyboardInterrupt`` as usual."""

    def __init__(self) -> None:
        self.stop = threading.Event()

    def answering(self) -> _Scope:
        return _Scope(self)


class _Scope:
    def __init__(self, owner: _Interrupts) -> None:
        self._owner = owner
        self._previous: Any = None

    def __enter__(self) -> threading.Event:
        self._owner.stop.clear()
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self._owner.stop

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._owner.stop.set()

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def answer(
    llm: LLM,
    prompt: list[int],
    params: SamplingParams,
    *,
    stop: threading.Event,
    write: Callable[[str], None],
) -> tuple[str, AnswerStats]:
    """Stream one answer to ``prompt`` (a rendered conversation's token ids) through
    ``write``; returns its text and stats."""
    start = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    reason = "interrupted"
    stream: Iterator[Any] = llm.stream([prompt], params)
    try:
        for event in stream:
            if first is None:
                first = time.perf_counter()
            pieces.append(event.text)
            write(event.text)
            if event.finished:
                reason = event.finish_reason or "stop"
            if stop.is_set():
                reason = "interrupted"
                break
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()  # aborts the request when it stopped early
    end = time.perf_counter()
    stats = AnswerStats(
        prompt_tokens=len(prompt),
        new_tokens=len(pieces),
        ttft_s=(first if first is not None else end) - start,
        total_s=end - start,
        finish_reason=reason,
    )
    return "".join(pieces), stats


def chat_loop(
    llm: LLM,
    params: SamplingParams,
    *,
    system: str | None,
    stdin: TextIO,
    stdout: TextIO,
    stderr: TextIO,
    interactive: bool,
    show_stats: bool = True,
) -> int:
    """Read turns from ``stdin`` until ``/exit`` or end of input; returns the exit status."""
    conversation = Conversation(system=system)
    interrupts = _Interrupts()
    if llm.tokenizer.chat_template is None:
        print(
            f"llmrt chat: {llm.recipe.name} has no chat template; use llmrt generate --prompt",
            file=stderr,
        )
        return 2
    if interactive:
        _enable_line_editing()
        print(f"llmrt chat: {llm.recipe.name} ({HELP}; Ctrl-C stops an answer)", file=stderr)

    def write(text: str) -> None:
        stdout.write(text)
        stdout.flush()

    while True:
        try:
            line = _read_turn(stdin, stdout, interactive=interactive)
        except KeyboardInterrupt as exc:
            if type(exc) is not KeyboardInterrupt:  # SIGTERM's subclass ends the session
                raise
            print("\n(/exit or Ctrl-D leaves)", file=stderr)
            continue
        if line is None:
            if interactive:
                print(file=stdout)
            return 0
        text = line.strip()
        if not text:
            continue
        if text in EXIT_COMMANDS:
            return 0
        if text == "/reset":
            conversation.reset()
            print("(conversation reset)", file=stderr)
            continue
        if text == "/system" or text.startswith("/system "):
            conversation.system = text.removeprefix("/system").strip() or None
            conversation.reset()
            done = "set" if conversation.system else "cleared"
            print(f"(system prompt {done}; conversation reset)", file=stderr)
            continue
        if text in ("/help", "/?"):
            print(HELP, file=stderr)
            continue
        if text.startswith("/") and " " not in text:
            print(f"unknown command {text} ({HELP})", file=stderr)
            continue
        fitted = _fit(llm, conversation, text, params, stderr=stderr)
        if fitted is None:
            continue
        messages, prompt = fitted
        with interrupts.answering() as stop:
            reply, stats = answer(llm, prompt, params, stop=stop, write=write)
        write("\n")
        conversation.messages = [*messages[1 if conversation.system else 0 :]]
        conversation.messages.append({"role": "assistant", "content": reply})
        if show_stats:
            print(stats.line(), file=stderr, flush=True)


def _fit(
    llm: LLM, conversation: Conversation, text: str, params: SamplingParams, *, stderr: TextIO
) -> tuple[list[dict[str, str]], list[int]] | None:
    """The turn's messages and their rendered prompt, its oldest exchanges dropped (and said
    so) until the prompt leaves room for an answer within ``serving.max_model_len`` (as
    ollama and llama-cli shift their context); None, said why, when the turn alone does not
    fit."""
    limit = llm.engine.scheduler.config.max_model_len
    room = min(params.max_tokens, max(1, limit // 4))
    dropped = 0
    while True:
        messages = conversation.with_user(text)
        rendered = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = llm.tokenizer.encode(rendered, add_special_tokens=False)
        tokens = len(prompt)
        if tokens + room <= limit:
            break
        if not conversation.messages:
            print(
                f"(this message alone is {tokens} tokens; with room for an answer it does not "
                f"fit max_model_len={limit}: shorten it)",
                file=stderr,
            )
            return None
        conversation.messages = conversation.messages[2:]  # the oldest user + assistant
        dropped += 1
    if dropped:
        print(
            f"(dropped the {dropped} oldest exchange(s) to fit max_model_len={limit})",
            file=stderr,
        )
    return messages, prompt


def _read_turn(stdin: TextIO, stdout: TextIO, *, interactive: bool) -> str | None:
    if interactive and stdin is sys.stdin:
        try:
            return input(">>> ")
        except EOFError:
            return None
    if interactive:
        stdout.write(">>> ")
        stdout.flush()
    line = stdin.readline()
    return None if line == "" else line


def _enable_line_editing() -> None:
    """Arrow keys and history for ``input`` where the readline module exists."""
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401
