"""The ``llmrt`` command: generate, serve, bench, recipes, warmup, audit, check."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import secrets
import signal
import sys
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from llmrt.errors import LLMRTError

DEFAULT_RECIPE = "smollm2-135m"
USER_ERRORS: tuple[type[BaseException], ...] = (
    LLMRTError,
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)


MODEL_HELP = (
    "the model: a GGUF file, a Hugging Face checkpoint directory, or a Hub id "
    "org/name[@revision] from the local Hugging Face cache; without a recipe, llmrt derives "
    "one (llmrt recipes show -m SOURCE prints it); with one, -m replaces its checkpoint"
)


def _add_model_args(p: argparse.ArgumentParser, *, help: str = MODEL_HELP) -> None:
    p.add_argument("-m", "--model", metavar="SOURCE", help=help)
    p.add_argument(
        "--gguf-file",
        metavar="NAME",
        help="the GGUF file to use from a directory or Hub repo holding several",
    )
    p.add_argument(
        "--download",
        action="store_true",
        help="allow fetching a Hub id missing from the local cache (never without this flag; "
        "HF_HUB_OFFLINE=1 forbids it)",
    )


def _add_recipe_args(p: argparse.ArgumentParser, *, default: str | None = DEFAULT_RECIPE) -> None:
    p.add_argument(
        "recipe",
        nargs="?",
        default=None,
        help=f"bundled recipe name, YAML path, or a model as for -m (default: {default}, or "
        "the recipe derived from -m)",
    )
    _add_model_args(p)
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe field by dotted path, e.g. --set trace.mode=all",
    )
    p.add_argument("--audit-log", metavar="FILE", help="write the lifecycle log as JSON lines")
    p.add_argument(
        "--log-level",
        default=None,
        choices=["debug", "info", "warning", "error"],
        help="log level (default: warning, with progress bars on a terminal; an explicit "
        "warning or error hides them too)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmrt", description="A declarative LLM inference runtime."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts with a recipe")
    _add_recipe_args(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a text prompt (repeat for several)")
    src.add_argument(
        "--prompt-ids",
        action="append",
        metavar="1,2,3",
        help="a prompt as comma-separated token ids (repeat for several)",
    )
    src.add_argument("--chat", help="one user message, formatted with the model's chat template")
    gen.description = (
        "Generate text for prompts. The run is sized to its prompts: decode slots per lane "
        "(decode.lane_capacity) shrink to the prompt count, so warmup covers only the batches "
        "the run can form; --set decode.lane_capacity=N keeps N. A run decoding fewer than "
        "512 tokens in all leaves the weights where they were built instead of moving them "
        "onto huge pages (a startup cost it would not earn back); --set device.huge_pages=true "
        "moves them anyway."
    )
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument(
        "--seed", type=int, default=None, help="sampling seed (default: a fresh one each run)"
    )
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt per line")

    chat = sub.add_parser(
        "chat",
        help="talk with a model in the terminal (streamed, multi-turn)",
        description="An interactive conversation with the model's chat template, streamed as "
        "it decodes, with a stats line (tokens/s, time to first token) after each answer. "
        "/reset forgets the conversation, /system TEXT sets the system prompt, /exit (or "
        "Ctrl-D) leaves; Ctrl-C stops an answer. A conversation outgrowing "
        "serving.max_model_len drops its oldest exchanges (said on stderr). Piped stdin: one "
        "user turn per line.",
    )
    _add_recipe_args(chat)
    chat.add_argument("--system", metavar="TEXT", help="the system prompt")
    chat.add_argument("--max-new-tokens", type=int, default=1024)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--top-k", type=int, default=0)
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument(
        "--seed", type=int, default=None, help="sampling seed (default: a fresh one each run)"
    )
    chat.add_argument("--ignore-eos", action="store_true", help="answer until --max-new-tokens")
    chat.add_argument("--no-stats", action="store_true", help="no stats line after answers")

    bench = sub.add_parser(
        "bench",
        help="measure throughput and latency on a workload",
        description="Run a workload and print its results as ratios against a baseline "
        "measured in the same run; the last line is the headline ratio.",
    )
    _add_recipe_args(bench)
    bench.add_argument(
        "--workload",
        choices=["mixed", "shared-prefix", "decode", "prefill", "oneshot", "llamacpp"],
        default="mixed",
        help="mixed: 32 prompts of 16-512 tokens, 64 new tokens each (default); "
        "shared-prefix: 16 prompts sharing a 512-token prefix, prefix caching on vs off; "
        "decode / prefill: llmrt vs transformers steps on the same weights (always); "
        "oneshot: a fresh `llmrt generate` process (16 tokens) vs `python -c 'import torch'`, "
        "wall ratio and peak RSS; llamacpp: single-stream latency, prompt speed and mixed "
        "throughput against llama.cpp on the recipe's GGUF",
    )
    bench.add_argument(
        "--baseline",
        choices=["hf", "none"],
        default="none",
        help="mixed: also run Hugging Face transformers generate on the same weights",
    )
    bench.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        metavar="N",
        help="scale the workload: prompts (mixed 32, shared-prefix 16) or timed repeats "
        "(decode 32, prefill 8, oneshot 3)",
    )
    bench.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        metavar="N",
        help="tokens generated per prompt (mixed 64, shared-prefix 32, oneshot 16)",
    )
    bench.add_argument(
        "--hf-batch-size",
        type=int,
        default=None,
        metavar="N",
        help="HF generate batch size (default: the recipe's decode.lane_capacity)",
    )
    bench.add_argument(
        "--planner-rows",
        default=None,
        metavar="1000,10000,100000",
        help="prefill: row counts for the planner cost per row",
    )
    bench.add_argument(
        "--llamacpp-dir",
        metavar="DIR",
        help="llamacpp: a llama.cpp build's bin directory holding llama-bench and llama-server "
        "(default: $LLMRT_LLAMACPP_DIR)",
    )
    bench.add_argument(
        "--llamacpp-bench",
        metavar="PATH",
        help="llamacpp: the llama-bench binary (default: $LLMRT_LLAMACPP_BENCH)",
    )
    bench.add_argument(
        "--llamacpp-server",
        metavar="PATH",
        help="llamacpp: the llama-server binary (default: $LLMRT_LLAMACPP_SERVER)",
    )
    bench.add_argument(
        "--server",
        nargs="?",
        const="",
        default=None,
        metavar="URL",
        help="the mixed prompts through llmrt serve (started by the bench, or the server "
        "running at URL) by concurrent streaming clients, against offline LLM.generate",
    )
    bench.add_argument(
        "--concurrency",
        type=int,
        default=None,
        metavar="N",
        help="--server: concurrent clients (default: one per prompt)",
    )
    bench.add_argument(
        "--schema",
        action="store_true",
        help="--server: also stream the prompts under a JSON-schema response_format and "
        "report structured over plain tokens/s (target >= 0.9)",
    )
    bench.add_argument(
        "--stall-check",
        action="store_true",
        help="--server: send a 10 MB request while 8 streams decode and report each "
        "stream's largest inter-chunk gap over its median (target <= 2), with a control run",
    )
    bench.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--plot", metavar="FILE.png", help="write a latency plot (needs matplotlib)")

    recipes = sub.add_parser("recipes", help="list, show or validate recipes")
    rsub = recipes.add_subparsers(dest="recipes_command", required=True)
    rsub.add_parser("list", help="bundled recipe names")
    for name in ("show", "validate"):
        rp = rsub.add_parser(name, help=f"{name} a recipe (name or path, or the one -m derives)")
        rp.add_argument("recipe", nargs="?", default=None)
        _add_model_args(rp)
        rp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    warm = sub.add_parser("warmup", help="build, warm and print the coverage manifest")
    _add_recipe_args(warm)
    warm.add_argument("--json", action="store_true")

    srv = sub.add_parser(
        "serve",
        help="serve the OpenAI API (completions, chat) over one continuous batch",
        description="Build and warm the runtime once, then serve OpenAI-compatible "
        "/v1/completions, /v1/chat/completions, /v1/models, /health and /metrics until "
        "SIGINT/SIGTERM.",
    )
    _add_recipe_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free)")
    srv.add_argument(
        "--api-key",
        default=os.environ.get("LLMRT_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes, /tokenize and /detokenize "
        "(default: $LLMRT_API_KEY)",
    )
    srv.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGINT/SIGTERM, let in-flight requests finish this long, then cut them (each "
        "stream ends with finish_reason abort and [DONE])",
    )
    srv.add_argument(
        "--max-request-bytes",
        type=int,
        default=16 * 1024 * 1024,
        metavar="N",
        help="refuse request bodies over N bytes with HTTP 413 (default 16 MiB)",
    )
    srv.add_argument(
        "--allowed-origins",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="answer CORS for this browser origin (repeat, or comma-separate; '*': any); "
        "default: CORS off",
    )

    audit = sub.add_parser("audit", help="check a JSON-lines lifecycle log against the contract")
    audit.add_argument("file")
    audit.add_argument("--json", action="store_true")

    check = sub.add_parser(
        "check",
        help="prove a family against transformers (needs transformers installed)",
        description="Build a small random instance of a recipe's architecture (or load a "
        "Hugging Face directory) in transformers and llmrt, run batched, chunked and "
        "prefix-cached prefills and greedy decode steps, print the largest logit difference "
        "per phase; exit 0 only within tolerance with equal greedy tokens.",
    )
    check.add_argument(
        "target", metavar="RECIPE|DIR", nargs="?", help="recipe name or path, or HF dir"
    )
    _add_model_args(
        check,
        help="the model: a Hugging Face checkpoint directory or a cached Hub id (a GGUF file "
        "has no transformers reference to compare with)",
    )
    check.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    check.add_argument(
        "--steps", type=_positive_int, default=32, help="greedy decode steps (default 32)"
    )
    check.add_argument(
        "--tolerance",
        type=_positive_float,
        default=1e-4,
        help="largest logit difference allowed (default 1e-4)",
    )
    check.add_argument(
        "--full-size", action="store_true", help="keep the recipe's geometry (default: shrink)"
    )
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is, so its teardown runs as for Ctrl-C (the
    default action would end the process with temporary files and build locks left)."""


def _terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def _warning_line(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: Any = None
) -> str:
    return f"llmrt: warning: {message}\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        previous_term = signal.signal(signal.SIGTERM, _terminated)
    else:
        previous_term = None
    previous_format = warnings.formatwarning
    warnings.formatwarning = _warning_line  # one line a user can read, not a source excerpt
    try:
        return _dispatch(args)
    except USER_ERRORS as exc:
        print(f"llmrt: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except Terminated:
        print("llmrt: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("llmrt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader left (``llmrt warmup | head``); everything was already torn down on the
        # way out. Point stdout at devnull so the interpreter's final flush cannot fail again.
        with contextlib.suppress(OSError, ValueError):  # stdout may have no descriptor
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    finally:
        warnings.formatwarning = previous_format
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)


def console_main() -> NoReturn:
    """The ``llmrt`` executable: ``main``, then exit without finalizing the interpreter.

    Every command tears down what it built before ``main`` returns (scopes, KV, traces), so
    what interpreter finalization would still do is deallocate every module's objects and
    torch's: 0.6-1 s here, as long as the rest of a one-shot ``generate``. Exit handlers still
    run (logging flushes its files) and stdio is flushed; a command that left a thread running
    exits the ordinary way, which waits for it.
    """
    code = main()
    if threading.active_count() > 1:
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: what the interpreter's flush would hit
            code = code or 120
    os._exit(code)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _resolve_model(args: argparse.Namespace, *, default: str | None) -> None:
    """Fold ``-m SOURCE`` into ``args.recipe`` and ``args.overrides`` (the model's overrides
    first, the user's ``--set`` after), so every command reads one recipe and its overrides."""
    model = getattr(args, "model", None)
    if model is None and args.recipe is not None:
        from llmrt.recipe.loader import derived_recipe_args, model_in_place_of_recipe

        source = model_in_place_of_recipe(args.recipe)  # ``llmrt generate model.gguf``
        if source is not None:
            args.recipe, derived = derived_recipe_args(source)
            args.overrides = [*derived, *args.overrides]
            return
    if model is None:
        if getattr(args, "gguf_file", None) is not None:
            from llmrt.errors import ConfigError

            raise ConfigError("--gguf-file", args.gguf_file, "needs -m SOURCE")
        if args.recipe is None:
            if default is None:
                from llmrt.errors import MISSING, ConfigError

                raise ConfigError("recipe", MISSING, "give a recipe or -m SOURCE")
            args.recipe = default
        return
    from llmrt.recipe.derived import model_recipe_args

    recipe, model_overrides = model_recipe_args(
        model, recipe=args.recipe, gguf_file=args.gguf_file, download=args.download
    )
    args.recipe = recipe
    args.overrides = [*model_overrides, *args.overrides]


def _dispatch(args: argparse.Namespace) -> int:
    if args.command in ("generate", "chat", "bench", "warmup", "serve"):
        _resolve_model(args, default=DEFAULT_RECIPE)
    elif args.command == "recipes" and args.recipes_command != "list":
        _resolve_model(args, default=None)
    elif args.command == "check":
        args.recipe = args.target
        _resolve_model(args, default=None)
        args.target = args.recipe
    if args.command == "recipes":
        return _recipes(args)
    if args.command == "audit":
        from llmrt.lifecycle.audit import audit_file

        return audit_file(args.file, as_json=args.json)
    if args.command == "serve":
        # Bind before anything heavy is imported: clients connect at once, and a port in
        # use or a bad host is one line before seconds of start-up.
        from llmrt.server.listen import StartingResponder, bind_socket

        sock = bind_socket(args.host, args.port)
        starting = StartingResponder(sock).start()
    if args.command == "check":
        from llmrt.cli.check import check_target

        report = check_target(
            args.target,
            overrides=args.overrides,
            steps=args.steps,
            tolerance=args.tolerance,
            full_size=args.full_size,
        )
        print(report.table())
        return 0 if report.ok else 1
    from llmrt.lifecycle.events import configure_logging
    from llmrt.lifecycle.progress import ENV as PROGRESS_ENV

    if args.log_level in ("warning", "error"):
        os.environ.setdefault(PROGRESS_ENV, "0")
    args.log_level = args.log_level or "warning"
    configure_logging(level=args.log_level, audit_path=args.audit_log)
    if args.command == "generate":
        return _generate(args)
    if args.command == "chat":
        return _chat(args)
    if args.command == "bench":
        from llmrt.cli.bench import run_bench

        return run_bench(args)
    if args.command == "warmup":
        return _warmup(args)
    if args.command == "serve":
        from llmrt.server.serve import serve

        return serve(
            recipe=args.recipe,
            overrides=args.overrides,
            host=args.host,
            port=args.port,
            sock=sock,
            starting=starting,
            api_key=args.api_key,
            shutdown_timeout=args.shutdown_timeout,
            log_level=args.log_level,
            max_request_bytes=args.max_request_bytes,
            allowed_origins=[o.strip() for v in args.allowed_origins for o in v.split(",") if o],
        )
    raise AssertionError(args.command)


def _recipes(args: argparse.Namespace) -> int:
    from llmrt.recipe.loader import dump_recipe_yaml, list_recipes, load_recipe

    if args.recipes_command == "list":
        for name in list_recipes():
            print(f"{name:24s} {_description(name)}")
        return 0
    recipe = load_recipe(args.recipe, overrides=args.overrides)
    if args.recipes_command == "show":
        print(dump_recipe_yaml(recipe), end="")
    else:
        family = "parts (model.parts)" if recipe.declared_parts else _validated_family(recipe)
        print(f"{args.recipe}: ok ({recipe.name}, family {family})")
    return 0


def _validated_family(recipe: Any) -> str:
    """The family that will build the recipe's model: for a checkpoint directory, the one
    its ``config.json`` ``model_type`` resolves to (``FamilyError`` when no family handles
    it), so ``validate`` does not pass a directory the load would refuse."""
    from llmrt.errors import CheckpointError

    spec = recipe.checkpoint
    if spec.format != "safetensors" or not spec.path:
        return str(recipe.family)
    config_path = Path(spec.path).expanduser() / "config.json"
    try:
        model_type = json.loads(config_path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointError(str(config_path), f"cannot read the model_type: {exc}") from exc
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError(f"{config_path}: model_type", "missing field")
    family = recipe.family_for(model_type)
    if model_type not in family.model_types:
        raise CheckpointError(
            f"{config_path}: model_type",
            f"{model_type!r} is not handled by family {family.name} "
            f"(it handles {', '.join(family.model_types)})",
        )
    return f"{family.name}, model_type {model_type}"


def _description(name: str) -> str:
    """A bundled recipe's description, read without validating it (``hf`` needs a path)."""
    from llmrt.recipe.loader import _parse_yaml, _read_source

    source, text = _read_source(name)
    description = _parse_yaml(text, source).get("description", "")
    return description if isinstance(description, str) else ""


def _sampling(args: argparse.Namespace, *, prompts: int = 1) -> Any:
    """The command's sampling params, one per prompt. Without ``--seed`` a sampled run
    (temperature > 0) draws a fresh seed, so two runs differ as a user expects (the engine's
    own unseeded stream starts from seed 0 in every process, as vLLM's); prompt i gets seed
    + i, so identical prompts of one run still differ."""
    from llmrt.sampling.params import SamplingParams

    seed = args.seed
    if seed is None and args.temperature > 0:
        seed = secrets.randbelow(2**31)
    return [
        SamplingParams(
            max_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=None if seed is None else seed + i,
            ignore_eos=getattr(args, "ignore_eos", False),
        )
        for i in range(prompts)
    ]


def _prompt_ids(values: Sequence[str]) -> list[list[int]]:
    from llmrt.errors import RequestError

    prompts = []
    for i, value in enumerate(values):
        try:
            prompts.append([int(t) for t in value.split(",") if t.strip()])
        except ValueError:
            raise RequestError(
                "--prompt-ids", "must be comma-separated integers", row=i, value=value
            ) from None
    return prompts


def _generate(args: argparse.Namespace) -> int:
    from llmrt.recipe.loader import load_recipe
    from llmrt.recipe.sizing import request_overrides
    from llmrt.serving.llm import LLM

    requests = 1 if args.chat is not None else len(args.prompt_ids or args.prompt)
    params = _sampling(args, prompts=requests)
    base = load_recipe(args.recipe, overrides=args.overrides)
    given = {o.split("=", 1)[0].strip() for o in args.overrides}
    sized = request_overrides(base, requests=requests, given=given, new_tokens=args.max_new_tokens)
    recipe = load_recipe(args.recipe, overrides=[*sized, *args.overrides]) if sized else base
    with LLM.from_recipe(recipe) as llm:
        if args.chat is not None:
            prompts: list[Any] = [
                llm.tokenizer.encode(
                    llm.tokenizer.apply_chat_template([{"role": "user", "content": args.chat}]),
                    add_special_tokens=False,
                )
            ]
        elif args.prompt_ids:
            prompts = _prompt_ids(args.prompt_ids)
        else:
            prompts = list(args.prompt)
        if args.json:
            for out in llm.generate(prompts, params):
                print(json.dumps(out.to_json(), ensure_ascii=False), flush=True)
            return 0
        stream_text = sys.stdout.isatty() and len(prompts) == 1
        if stream_text:
            for event in llm.stream(prompts, params):
                print(event.text, end="", flush=True)
            print()
            return 0
        for out in llm.generate(prompts, params):
            if len(prompts) > 1:
                print(f"--- prompt {out.index} ({out.finish_reason})")
            print(out.text, flush=True)
    return 0


def _chat(args: argparse.Namespace) -> int:
    from llmrt.cli.chat import chat_loop
    from llmrt.recipe.loader import load_recipe
    from llmrt.recipe.sizing import request_overrides
    from llmrt.serving.llm import LLM

    (params,) = _sampling(args)
    base = load_recipe(args.recipe, overrides=args.overrides)
    given = {o.split("=", 1)[0].strip() for o in args.overrides}
    sized = request_overrides(base, requests=1, given=given)
    recipe = load_recipe(args.recipe, overrides=[*sized, *args.overrides]) if sized else base
    with LLM.from_recipe(recipe) as llm:
        return chat_loop(
            llm,
            params,
            system=args.system,
            stdin=sys.stdin,
            stdout=sys.stdout,
            stderr=sys.stderr,
            interactive=sys.stdin.isatty() and sys.stdout.isatty(),
            show_stats=not args.no_stats,
        )


def _warmup(args: argparse.Namespace) -> int:
    from llmrt.serving.llm import LLM

    with LLM.from_recipe(args.recipe, overrides=args.overrides) as llm:
        manifests = [lane.manifest() for lane in llm.engine.executor.lanes]
        if args.json:
            lanes = [m.to_dict() for m in manifests]
            print(json.dumps({"recipe": llm.recipe.name, "lanes": lanes}, indent=2))
            return 0
        for lane, manifest in enumerate(manifests):
            print(
                f"lane {lane}: {len(manifest.eager_programs)} programs, "
                f"{len(manifest.trace_signatures)} traces "
                f"(schema {manifest.schema_fingerprint}, "
                f"workspace {manifest.workspace_fingerprint})"
            )
            for description, key in manifest.eager_programs:
                traced = "traced" if key in manifest.traced_programs else "eager"
                print(f"  {description:40s} {traced:6s} {key[:16]}")
    return 0
