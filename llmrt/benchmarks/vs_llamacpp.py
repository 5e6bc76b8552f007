"""The ``llamacpp`` workload: llmrt against llama.cpp on the recipe's own GGUF, one run.

Three measurements, each as a llmrt/llama.cpp ratio:

- single-stream inter-token latency: one 16-token prompt, 64 greedy tokens (llmrt: the
  median gap between tokens of ``LLM.generate``; llama.cpp: ``llama-bench`` ``tg64``, or
  the server's / ``llama_cpp``'s per-token timings);
- prompt processing: a 512-token prompt (llmrt: 512 / time to first token of
  ``LLM.generate``; llama.cpp: ``llama-bench`` ``pp512``, or the server's prompt timings);
- mixed throughput: the ``mixed`` workload's prompts (16-512 tokens, 64 new each, all
  submitted at once) through ``LLM.generate`` and through ``llama-server`` with one slot per
  concurrent client (16), output tokens/s.

llmrt runs first and is torn down before llama.cpp starts, so they never share the CPU.
Both use this process's torch thread count. Without llama.cpp the llmrt numbers are still
reported and the report says what to provide.
"""

from __future__ import annotations

import itertools
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from llmrt.benchmarks.llamacpp import (
    DIR_ENV,
    LlamaCpp,
    llama_server,
    python_single_stream,
    recipe_gguf,
    run_llama_bench,
    server_single_stream,
    server_throughput,
)
from llmrt.benchmarks.prompts import random_prompts, spread_lengths, token_pool
from llmrt.benchmarks.report import Report, Target
from llmrt.benchmarks.serving import (
    MIXED_MAX_LEN,
    MIXED_MIN_LEN,
    MIXED_NEW_TOKENS,
    MIXED_PROMPTS,
    greedy,
)
from llmrt.benchmarks.settings import BenchSettings
from llmrt.benchmarks.sizing import sized_recipe
from llmrt.benchmarks.timing import progress, ratio, rounded
from llmrt.errors import LLMRTError
from llmrt.recipe.loader import Recipe
from llmrt.serving.llm import LLM

ITL_PROMPT_LEN = 16
ITL_NEW_TOKENS = 64
PP_LEN = 512
REPEATS = 3
SERVER_SLOTS = 16


def _llmrt_side(settings: BenchSettings, recipe: Recipe, *, n: int, new: int) -> dict[str, Any]:
    with LLM.from_recipe(recipe) as llm:
        vocab = int(llm.engine.executor.lanes[0].decode.config.vocab_size)
        pool = token_pool(llm.tokenizer, model_vocab_size=vocab)
        max_len = llm.engine.scheduler.config.max_model_len
        high = min(MIXED_MAX_LEN, max_len - new)
        pp_len = min(PP_LEN, max_len - 1)
        lengths = spread_lengths(n, low=min(MIXED_MIN_LEN, high), high=high, seed=settings.seed)
        prompts = {
            "itl": random_prompts([ITL_PROMPT_LEN] * REPEATS, pool=pool, seed=settings.seed + 1),
            "pp": random_prompts([pp_len] * REPEATS, pool=pool, seed=settings.seed + 2),
            "mixed": random_prompts(lengths, pool=pool, seed=settings.seed),
        }
        warm = random_prompts([ITL_PROMPT_LEN, pp_len], pool=pool, seed=settings.seed + 7919)
        llm.generate(warm, greedy(2))
        gaps: list[float] = []
        for prompt in progress(prompts["itl"], desc="llmrt single stream"):
            (out,) = llm.generate([prompt], greedy(ITL_NEW_TOKENS))
            gaps.extend(b - a for a, b in itertools.pairwise(out.token_times))
        speeds: list[float] = []
        for prompt in progress(prompts["pp"], desc="llmrt prompt"):
            start = time.perf_counter()
            (out,) = llm.generate([prompt], greedy(1))
            speeds.append(len(prompt) / (out.token_times[0] - start))
        start = time.perf_counter()
        outputs = llm.generate(prompts["mixed"], greedy(new))
        wall = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outputs)
    return {
        "prompts": prompts,
        "stats": rounded(
            {
                "itl_s": statistics.median(gaps),
                "pp_tokens_per_s": statistics.median(speeds),
                "mixed_wall_s": wall,
                "mixed_output_tokens_per_s": ratio(produced, wall),
            }
        ),
        "config": {
            "itl_prompt_len": ITL_PROMPT_LEN,
            "itl_new_tokens": ITL_NEW_TOKENS,
            "pp_len": pp_len,
            "repeats": REPEATS,
            "mixed_prompts": n,
            "mixed_prompt_tokens": sum(lengths),
            "mixed_new_tokens": new,
            "server_slots": SERVER_SLOTS,
        },
    }


def _llamacpp_side(
    found: LlamaCpp, *, model: Path, prompts: dict[str, list[list[int]]], new: int
) -> tuple[dict[str, Any], list[str]]:
    """llama.cpp's numbers and notes on what could not be measured."""
    threads = torch.get_num_threads()
    pp_len = len(prompts["pp"][0])
    stats: dict[str, Any] = {"threads": threads}
    notes: list[str] = []
    if found.bench is not None:
        speeds = run_llama_bench(
            found.bench,
            model=model,
            threads=threads,
            prompt=pp_len,
            generate=ITL_NEW_TOKENS,
            repeats=REPEATS,
        )
        stats.update(
            single_stream_source="llama-bench",
            itl_s=1.0 / speeds["tg_tokens_per_s"],
            pp_tokens_per_s=speeds["pp_tokens_per_s"],
        )
    elif found.python:
        stats.update(
            single_stream_source="llama_cpp",
            **python_single_stream(
                model=model,
                threads=threads,
                itl_prompts=prompts["itl"],
                max_tokens=ITL_NEW_TOKENS,
                pp_prompts=prompts["pp"],
            ),
        )
    if found.server is None:
        notes.append(
            "llama.cpp mixed: needs llama-server (--llamacpp-server PATH or --llamacpp-dir DIR)"
        )
        return stats, notes
    longest = max(len(p) for p in prompts["mixed"] + prompts["pp"])
    with llama_server(
        found.server,
        model=model,
        threads=threads,
        slots=SERVER_SLOTS,
        context_per_slot=longest + max(new, ITL_NEW_TOKENS) + 16,
    ) as url:
        if "itl_s" not in stats:
            single = server_single_stream(url, prompts=prompts["itl"], max_tokens=ITL_NEW_TOKENS)
            prompt = server_single_stream(url, prompts=prompts["pp"], max_tokens=1)
            stats.update(
                single_stream_source="llama-server timings",
                itl_s=single["itl_s"],
                pp_tokens_per_s=prompt["pp_tokens_per_s"],
            )
        server_throughput(url, prompts=prompts["itl"][:1], max_tokens=2, clients=1)  # warm
        mixed = server_throughput(
            url, prompts=prompts["mixed"], max_tokens=new, clients=SERVER_SLOTS
        )
    stats.update(
        mixed_wall_s=mixed["wall_s"],
        mixed_output_tokens=mixed["output_tokens"],
        mixed_output_tokens_per_s=mixed["output_tokens_per_s"],
    )
    return rounded(stats), notes


def vs_llamacpp(settings: BenchSettings) -> Report:
    n = settings.count(MIXED_PROMPTS)
    new = settings.new_tokens(MIXED_NEW_TOKENS)
    sized = sized_recipe(
        settings.recipe,
        user_overrides=settings.overrides,
        tokens_per_request=max(MIXED_MAX_LEN, PP_LEN) + max(new, ITL_NEW_TOKENS),
    )
    recipe = sized.recipe
    report = Report(workload="llamacpp", recipe=recipe.name)
    found = LlamaCpp.locate(
        directory=settings.llamacpp_dir,
        bench=settings.llamacpp_bench,
        server=settings.llamacpp_server,
    )
    model = recipe_gguf(recipe)
    ours = _llmrt_side(settings, recipe, n=n, new=new)
    report.section("config", {**ours["config"], "bench_overrides": list(sized.bench_overrides)})
    report.section("llmrt", ours["stats"])
    missing = None
    if model is None:
        missing = f"the recipe's checkpoint is {recipe.checkpoint.format}, not a GGUF"
    elif not found.available:
        missing = (
            f"no llama-bench, llama-server or llama_cpp module (give --llamacpp-dir DIR, "
            f"--llamacpp-bench PATH, --llamacpp-server PATH, or set ${DIR_ENV})"
        )
    if missing is not None or model is None:
        report.note(f"llama.cpp: not available: {missing}")
        report.headline = f"llama.cpp baseline not available: {missing}"
        return report
    try:
        theirs, notes = _llamacpp_side(found, model=model, prompts=ours["prompts"], new=new)
    except LLMRTError as exc:
        report.note(f"llama.cpp: failed: {exc}")
        report.headline = f"llama.cpp baseline failed: {exc}"
        return report
    report.section("llamacpp", {"found": found.describe(), "model": str(model), **theirs})
    for note in notes:
        report.note(note)
    mine = ours["stats"]
    if "itl_s" in theirs:
        report.ratio(
            "itl_llmrt_over_llamacpp",
            ratio(mine["itl_s"], theirs["itl_s"]),
            label="single-stream inter-token latency llmrt/llama.cpp",
            target=Target(op="<=", bound=1.0),
        )
        report.ratio(
            "pp_llmrt_over_llamacpp",
            ratio(mine["pp_tokens_per_s"], theirs["pp_tokens_per_s"]),
            label=f"prompt tokens/s (pp{ours['config']['pp_len']}) llmrt/llama.cpp",
            target=Target(op=">=", bound=2.0),
        )
    if "mixed_output_tokens_per_s" in theirs:
        report.ratio(
            "mixed_llmrt_over_llamacpp_server",
            ratio(mine["mixed_output_tokens_per_s"], theirs["mixed_output_tokens_per_s"]),
            label="mixed output tokens/s llmrt/llama-server",
            target=Target(op=">=", bound=2.0),
            headline=True,
        )
    else:
        report.headline = "llama.cpp mixed throughput not measured: " + "; ".join(notes)
    return report
