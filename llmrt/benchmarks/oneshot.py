"""The ``oneshot`` workload: a fresh ``llmrt generate`` process against ``import torch``.

What a user pays to get ``max_new_tokens`` tokens for one prompt from a cold process with
warm caches (the weight cache and the OS page cache are warmed by one untimed run of each
command first): wall time as a ratio to ``python -c "import torch"`` timed in the same run
(interleaved, medians of ``repeats``), and the generate process's own peak RSS. The same
one-shot through the Python API (``LLM.from_recipe``, the recipe as written: what programs
and ``llmrt serve`` build, where the CLI sizes a one-shot run down) runs with them, and for
a GGUF recipe both peaks are also given over the file's size. Python commands run with this
interpreter, so they share one environment. When found, the same one-shot through
``llama-cli`` on the recipe's GGUF, and (``--baseline hf``) through transformers loading that
GGUF, run interleaved with them as reference points.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

from llmrt.benchmarks.llamacpp import LlamaCpp, recipe_gguf
from llmrt.benchmarks.processes import ProcessRun, run_process
from llmrt.benchmarks.report import Report, Target
from llmrt.benchmarks.settings import BenchSettings
from llmrt.benchmarks.timing import progress, ratio, rounded
from llmrt.errors import ConfigError
from llmrt.recipe.loader import load_recipe

ONESHOT_REPEATS = 3
ONESHOT_NEW_TOKENS = 16
ONESHOT_PROMPT = "The capital of France is"
ONESHOT_TIMEOUT_S = 600.0
WALL_TARGET = 2.0  # generate wall / import torch wall
RSS_TARGET_GB = 1.2


def oneshot_model(settings: BenchSettings) -> Path | None:
    """The GGUF file the bench's recipe (with its overrides) serves, or None."""
    return recipe_gguf(load_recipe(settings.recipe, overrides=list(settings.overrides)))


def oneshot_commands(settings: BenchSettings, *, model: Path | None = None) -> dict[str, list[str]]:
    """The commands timed: the ``import torch`` baseline, the one-shot generate and its API
    twin, and the baselines that ``model`` (the recipe's GGUF) allows."""
    generate = [
        sys.executable,
        "-m",
        "llmrt.cli",
        "generate",
        settings.recipe,
        "--prompt",
        ONESHOT_PROMPT,
        "--max-new-tokens",
        str(settings.new_tokens(ONESHOT_NEW_TOKENS)),
    ]
    for override in settings.overrides:
        generate += ["--set", override]
    api = [
        sys.executable,
        "-m",
        "llmrt.benchmarks.api_oneshot",
        settings.recipe,
        ONESHOT_PROMPT,
        str(settings.new_tokens(ONESHOT_NEW_TOKENS)),
        *settings.overrides,
    ]
    commands = {
        "import_torch": [sys.executable, "-c", "import torch"],
        "llmrt_generate": generate,
        "llm_api": api,
    }
    found = LlamaCpp.locate(
        directory=settings.llamacpp_dir,
        bench=settings.llamacpp_bench,
        server=settings.llamacpp_server,
    )
    if found.cli is not None and model is not None:
        commands["llamacpp_cli"] = [
            str(found.cli),
            "-m", str(model),
            "-p", ONESHOT_PROMPT,
            "-n", str(settings.new_tokens(ONESHOT_NEW_TOKENS)),
            "-t", str(torch.get_num_threads()),
            "--temp", "0",
            "-st",
            "--no-display-prompt",
        ]  # fmt: skip
    if settings.baseline == "hf" and model is not None:
        commands["hf_generate"] = [
            sys.executable,
            "-m",
            "llmrt.benchmarks.hf_oneshot",
            str(model),
            ONESHOT_PROMPT,
            str(settings.new_tokens(ONESHOT_NEW_TOKENS)),
        ]
    return commands


def _checked(name: str, run: ProcessRun) -> ProcessRun:
    if not run.ok:
        why = "timed out" if run.timed_out else f"exited {run.returncode}"
        raise ConfigError(
            f"oneshot {name}",
            " ".join(run.argv),
            f"{why}: {run.stderr_tail.strip()[-500:] or 'no stderr'}",
        )
    return run


def oneshot(settings: BenchSettings) -> Report:
    repeats = settings.count(ONESHOT_REPEATS)
    model = oneshot_model(settings)
    commands = oneshot_commands(settings, model=model)
    report = Report(workload="oneshot", recipe=settings.recipe)
    report.section(
        "config",
        {
            "repeats": repeats,
            "max_new_tokens": settings.new_tokens(ONESHOT_NEW_TOKENS),
            "prompt": ONESHOT_PROMPT,
            "generate_argv": commands["llmrt_generate"][1:],
        },
    )
    for name, argv in commands.items():  # warm the weight cache and the page cache
        _checked(name, run_process(argv, timeout_s=ONESHOT_TIMEOUT_S))
    runs: dict[str, list[ProcessRun]] = {name: [] for name in commands}
    for _ in progress(range(repeats), desc="oneshot"):
        for name, argv in commands.items():
            runs[name].append(_checked(name, run_process(argv, timeout_s=ONESHOT_TIMEOUT_S)))
    wall = {name: statistics.median(r.wall_s for r in rs) for name, rs in runs.items()}
    peak = {name: max(r.peak_rss_bytes for r in rs) / 1e9 for name, rs in runs.items()}
    report.section(
        "wall_s",
        rounded({**wall, **{f"{n}_min": min(r.wall_s for r in rs) for n, rs in runs.items()}}),
    )
    report.section("peak_rss_gb", rounded(peak))
    if model is not None and model.is_file():
        size = model.stat().st_size / 1e9
        report.section("peak_rss_over_file", rounded({
            name: peak[name] / size for name in ("llmrt_generate", "llm_api") if name in peak
        }))  # fmt: skip
    report.series = {f"{name} wall": [r.wall_s for r in rs] for name, rs in runs.items()}
    report.ratio(
        "generate_peak_rss_gb",
        peak["llmrt_generate"],
        label="llmrt generate peak RSS",
        target=Target(op="<=", bound=RSS_TARGET_GB),
        suffix=" GB",
    )
    for other, label in (("llamacpp_cli", "llama-cli"), ("hf_generate", "transformers")):
        if other in wall:
            report.ratio(
                f"generate_over_{other}_wall",
                ratio(wall["llmrt_generate"], wall[other]),
                label=f"llmrt generate / {label} one-shot wall",
            )
    if "llamacpp_cli" not in wall:
        report.note(
            "llama.cpp one-shot: not run (needs llama-cli via --llamacpp-dir or "
            "$LLMRT_LLAMACPP_CLI, and a GGUF recipe)"
        )
    report.ratio(
        "generate_over_import_torch_wall",
        ratio(wall["llmrt_generate"], wall["import_torch"]),
        label="llmrt generate / import torch wall",
        target=Target(op="<=", bound=WALL_TARGET),
        headline=True,
    )
    return report
