"""``llmrt chat`` as a user runs it: through a pipe, and in a terminal (a pty) where Ctrl-C
stops an answer but not the session."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from model_files import tiny_llama, train_bpe, write_llama_gguf

from llmrt.sampling.params import SamplingParams
from llmrt.serving.llm import LLM

pytest.importorskip("transformers")

SMALL = ["decode.lane_capacity=1", "kv_cache.num_blocks=160", "trace.mode=none"]
SETS = [x for o in SMALL for x in ("--set", o)]
STATS = re.compile(
    r"^\[(\d+) tokens, [\d.]+ tokens/s, first token \d+ ms, prompt (\d+) tokens"
    r"(, stopped|, cut at the token limit)?\]$"
)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("chat")
    bpe = train_bpe()
    return write_llama_gguf(
        root / "chatty.gguf", tiny_llama(bpe.get_vocab_size(), context=4096), bpe
    )


def llmrt_command() -> list[str]:
    return [sys.executable, "-m", "llmrt.cli"]


def env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "LLMRT_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}


def expected_answers(model_file: Path, turns: list[list[dict[str, str]]], n: int) -> list[str]:
    torch.set_num_threads(1)
    with LLM(model=str(model_file), overrides=SMALL) as llm:
        return [
            out.text
            for out in (
                llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=n))[0]
                for messages in turns
            )
        ]


def test_piped_turns_answer_like_llm_chat_with_history_reset_and_system(
    model_file: Path, tmp_path: Path
) -> None:
    lines = ["hello there", "and then?", "/reset", "hello there", "/system be brief", "hi", "/exit"]
    done = subprocess.run(
        [*llmrt_command(), "chat", "-m", str(model_file), "--max-new-tokens", "12", *SETS],
        input="\n".join([*lines, "never read"]) + "\n",
        capture_output=True,
        text=True,
        env=env(tmp_path),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    hello = [{"role": "user", "content": "hello there"}]
    (first,) = expected_answers(model_file, [hello], 12)
    # The second turn sees the first answer in its prompt.
    history = [*hello, {"role": "assistant", "content": first}]
    history.append({"role": "user", "content": "and then?"})
    brief = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    second, system = expected_answers(model_file, [history, brief], 12)
    assert done.stdout == f"{first}\n{second}\n{first}\n{system}\n"
    stats = [STATS.match(line) for line in done.stderr.splitlines() if line.startswith("[")]
    assert len(stats) == 4 and all(stats), done.stderr
    prompts = [int(m.group(2)) for m in stats if m]
    assert prompts[1] > prompts[0] == prompts[2]  # history, then reset
    assert "(conversation reset)" in done.stderr


def test_a_conversation_past_the_context_drops_its_oldest_exchanges_and_goes_on(
    model_file: Path, tmp_path: Path
) -> None:
    """The session outlives its context: old exchanges make room (said on stderr), a turn
    too long on its own is refused with a reason, and the session carries on."""
    lines = ["tell me a story", "go on", "and more", "x " * 400, "last one", "/exit"]
    done = subprocess.run(
        [
            *llmrt_command(), "chat", "-m", str(model_file), "--max-new-tokens", "40",
            "--ignore-eos", *SETS, "--set", "serving.max_model_len=160",
        ],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        env=env(tmp_path),
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    stats = [STATS.match(line) for line in done.stderr.splitlines() if line.startswith("[")]
    assert len(stats) == 4 and all(stats), done.stderr  # every turn but the long one answered
    assert all(m.group(3) == ", cut at the token limit" for m in stats if m), done.stderr
    assert all(int(m.group(2)) + 40 <= 160 for m in stats if m), done.stderr
    assert "oldest exchange(s) to fit max_model_len=160" in done.stderr, done.stderr
    assert "does not fit max_model_len=160: shorten it" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def _read_until(fd: int, pattern: re.Pattern[str], *, seen: list[str], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = "".join(seen)
        if pattern.search(text):
            return text
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                seen.append(os.read(fd, 4096).decode("utf-8", "replace"))
            except OSError:
                break
    raise AssertionError(f"no {pattern.pattern!r} in {''.join(seen)[-2000:]!r}")


def test_in_a_terminal_ctrl_c_stops_the_answer_not_the_session(
    model_file: Path, tmp_path: Path
) -> None:
    argv = [
        *llmrt_command(),
        "chat",
        "-m",
        str(model_file),
        "--max-new-tokens",
        "3000",
        "--ignore-eos",
        *SETS,
    ]
    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal
        os.execve(sys.executable, argv, env(tmp_path))
    seen: list[str] = []
    try:
        _read_until(fd, re.compile(r">>> "), seen=seen, timeout=240)
        os.write(fd, b"tell me everything\r")
        # Some of the answer has streamed: Ctrl-C, as a user types it.
        _read_until(fd, re.compile(r"tell me everything\r?\n.{40,}", re.S), seen=seen, timeout=60)
        os.write(fd, b"\x03")
        stopped = _read_until(fd, re.compile(r"tokens, stopped\]"), seen=seen, timeout=60)
        match = re.search(r"\[(\d+) tokens, [\d.]+ tokens/s, first token \d+ ms", stopped)
        assert match is not None and 0 < int(match.group(1)) < 3000
        # The session goes on: another turn is answered, then /exit leaves cleanly.
        os.write(fd, b"/reset\r")
        _read_until(fd, re.compile(r"conversation reset\)"), seen=seen, timeout=30)
        before = len("".join(seen))
        os.write(fd, b"again\r")
        _read_until(fd, re.compile(r"again\r?\n.*\n.*>>> ", re.S), seen=seen, timeout=60)
        assert "Traceback" not in "".join(seen)[before:]
        os.write(fd, b"/exit\r")
        _, status = os.waitpid(pid, 0)
        pid = 0
        assert os.waitstatus_to_exitcode(status) == 0, "".join(seen)[-2000:]
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)


def test_sigterm_at_the_prompt_ends_the_session_while_ctrl_c_does_not() -> None:
    """Ctrl-C at the prompt only reminds how to leave; SIGTERM (the CLI's Terminated, a
    KeyboardInterrupt subclass so teardowns treat it alike) ends the session."""
    import io
    from types import SimpleNamespace

    from llmrt.cli.chat import chat_loop
    from llmrt.cli.main import Terminated

    class Interrupting(io.StringIO):
        def __init__(self, *raised: BaseException) -> None:
            super().__init__()
            self.raised = list(raised)

        def readline(self, *args: object) -> str:
            if self.raised:
                raise self.raised.pop(0)
            return ""

    llm: Any = SimpleNamespace(
        tokenizer=SimpleNamespace(chat_template="{{ x }}"), recipe=SimpleNamespace(name="m")
    )
    err = io.StringIO()
    params = SamplingParams()
    assert chat_loop(
        llm, params, system=None, stdin=Interrupting(KeyboardInterrupt()), stdout=io.StringIO(),
        stderr=err, interactive=False,
    ) == 0  # fmt: skip
    assert "(/exit or Ctrl-D leaves)" in err.getvalue()
    with pytest.raises(Terminated):
        chat_loop(
            llm, params, system=None, stdin=Interrupting(Terminated()), stdout=io.StringIO(),
            stderr=io.StringIO(), interactive=False,
        )  # fmt: skip
