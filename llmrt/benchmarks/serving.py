"""Serving workloads through ``LLM.generate``: ``mixed`` and ``shared-prefix``.

``mixed``: prompts of 16-512 tokens (evenly spread, seeded order), every request
generating exactly ``max_new_tokens`` greedy tokens (``ignore_eos``); optionally the same
prompts through Hugging Face ``generate`` on the same weights (left-padded batches of the
lane capacity). ``shared-prefix``: prompts sharing one long prefix, run with prefix
caching on and then off (a second ``LLM`` built after the first is closed).
TTFT is measured from submission (every prompt is submitted at once).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from llmrt.benchmarks.hf import build_hf_model, hf_generate
from llmrt.benchmarks.prompts import (
    random_prompts,
    shared_prefix_prompts,
    spread_lengths,
    token_pool,
)
from llmrt.benchmarks.report import Report, Target
from llmrt.benchmarks.settings import BenchSettings
from llmrt.benchmarks.sizing import sized_recipe
from llmrt.benchmarks.timing import mean, percentile, progress, ratio, rounded
from llmrt.errors import ConfigError, UnsupportedError
from llmrt.sampling.params import SamplingParams
from llmrt.serving.llm import LLM

MIXED_PROMPTS = 32
MIXED_MIN_LEN = 16
MIXED_MAX_LEN = 512
MIXED_NEW_TOKENS = 64
SHARED_PROMPTS = 16
SHARED_PREFIX_LEN = 512
SHARED_SUFFIX_LEN = 32
SHARED_NEW_TOKENS = 32
WARMUP_LEN = 16

#: Target of the mixed workload against transformers ``generate`` on the same weights (#14).
HF_TOKENS_PER_S_BOUND = 3.0


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def latency_stats(
    *,
    start: float,
    wall_s: float,
    token_times: Sequence[Sequence[float]],
    prompt_tokens: int,
) -> dict[str, Any]:
    """Throughput and latency from each request's token timestamps (``perf_counter``)."""
    output_tokens = sum(len(t) for t in token_times)
    ttft = [t[0] - start for t in token_times if t]
    itl = [b - a for t in token_times for a, b in itertools.pairwise(t)]
    return rounded(
        {
            "wall_s": wall_s,
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "output_tokens_per_s": ratio(output_tokens, wall_s),
            "total_tokens_per_s": ratio(output_tokens + prompt_tokens, wall_s),
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99),
            "ttft_mean_s": mean(ttft),
            "itl_p50_s": percentile(itl, 50),
            "itl_p99_s": percentile(itl, 99),
        }
    )


def _vocab(llm: LLM) -> int:
    return int(llm.engine.executor.lanes[0].decode.config.vocab_size)


def warm_prompts(pool: Sequence[int], *, longest: int, seed: int) -> list[list[int]]:
    """Unrelated short and ``longest``-token prompts: first-call costs stay out of the run.

    They share no prefix with the workload's (a different seed), so the prefix cache gains
    nothing from them.
    """
    lengths = sorted({min(WARMUP_LEN, longest), longest})
    return random_prompts(lengths, pool=pool, seed=seed + 7919)


def _warm(llm: LLM, pool: Sequence[int], *, longest: int, seed: int) -> None:
    llm.generate(warm_prompts(pool, longest=longest, seed=seed), greedy(2))


class MixedPrompts(NamedTuple):
    pool: list[int]
    lengths: list[int]
    prompts: list[list[int]]


def mixed_prompts(llm: LLM, *, num_prompts: int, new_tokens: int, seed: int) -> MixedPrompts:
    """The ``mixed`` workload's prompts for ``llm``: ``num_prompts`` lengths spread over
    16-512 tokens (less where ``max_model_len`` must also hold ``new_tokens``), drawn from
    the ids both the tokenizer and the model know."""
    max_len = llm.engine.scheduler.config.max_model_len
    high = min(MIXED_MAX_LEN, max_len - new_tokens)
    if high < 1:
        raise ConfigError(
            "--max-new-tokens", new_tokens, f"leaves no prompt room in max_model_len={max_len}"
        )
    pool = token_pool(llm.tokenizer, model_vocab_size=_vocab(llm))
    lengths = spread_lengths(num_prompts, low=min(MIXED_MIN_LEN, high), high=high, seed=seed)
    return MixedPrompts(pool, lengths, random_prompts(lengths, pool=pool, seed=seed))


def prompt_summary(lengths: Sequence[int], *, new_tokens: int) -> dict[str, int]:
    """A workload's prompts as a report's ``config`` entries (counts and lengths)."""
    return {
        "num_prompts": len(lengths),
        "prompt_len_min": min(lengths),
        "prompt_len_max": max(lengths),
        "prompt_tokens": sum(lengths),
        "max_new_tokens": new_tokens,
    }


def mixed(settings: BenchSettings) -> Report:
    n = settings.count(MIXED_PROMPTS)
    new = settings.new_tokens(MIXED_NEW_TOKENS)
    sized = sized_recipe(
        settings.recipe,
        user_overrides=settings.overrides,
        tokens_per_request=MIXED_MAX_LEN + new,
    )
    recipe = sized.recipe
    report = Report(workload="mixed", recipe=recipe.name)
    with LLM.from_recipe(recipe) as llm:
        pool, lengths, prompts = mixed_prompts(
            llm, num_prompts=n, new_tokens=new, seed=settings.seed
        )
        hf_batch = settings.hf_batch_size or recipe.decode.lane_capacity
        report.section(
            "config",
            {
                **prompt_summary(lengths, new_tokens=new),
                "lanes": recipe.lanes,
                "lane_capacity": recipe.decode.lane_capacity,
                "hf_batch_size": hf_batch if settings.baseline == "hf" else None,
                "bench_overrides": list(sized.bench_overrides),
            },
        )
        _warm(llm, pool, longest=max(lengths), seed=settings.seed)
        for _ in progress(range(1), desc="llmrt generate"):
            start = time.perf_counter()
            outputs = llm.generate(prompts, greedy(new))
            wall = time.perf_counter() - start
        times = [o.token_times for o in outputs]
        ours = latency_stats(
            start=start, wall_s=wall, token_times=times, prompt_tokens=sum(lengths)
        )
        report.section("llmrt", ours)
        report.series["llmrt ttft"] = [t[0] - start for t in times if t]
        report.series["llmrt itl"] = _gaps(times)
        if settings.baseline != "hf":
            report.headline = (
                f"llmrt output tokens/s: {ours['output_tokens_per_s']:.1f} "
                "(--baseline hf adds the llmrt/hf ratio)"
            )
            return report
        device = llm.engine.executor.lanes[0].decode.config.device.torch_device
        try:
            model = build_hf_model(llm.container.model.weights(), device=device)
        except UnsupportedError as exc:  # llmrt's numbers stand; the ratio cannot be had
            report.note(f"no HF baseline: {exc}")
            report.headline = f"llmrt output tokens/s: {ours['output_tokens_per_s']:.1f}"
            return report
        pad = pool[0]
        hf_generate(model, prompts[:1], max_new_tokens=2, batch_size=1, pad_token_id=pad)
        run = hf_generate(model, prompts, max_new_tokens=new, batch_size=hf_batch, pad_token_id=pad)
        theirs = latency_stats(
            start=run.start,
            wall_s=run.wall_s,
            token_times=run.token_times,
            prompt_tokens=sum(lengths),
        )
        identical = sum(
            tuple(o.token_ids) == hf for o, hf in zip(outputs, run.token_ids, strict=True)
        )
        report.section("hf", {**theirs, "greedy_rows_identical": identical, "greedy_rows": n})
        report.series["hf ttft"] = [t[0] - run.start for t in run.token_times if t]
        report.series["hf itl"] = _gaps(run.token_times)
        report.ratio(
            "ttft_p50_hf_over_llmrt",
            ratio(theirs["ttft_p50_s"], ours["ttft_p50_s"]),
            label="hf/llmrt TTFT p50 ratio",
        )
        report.ratio(
            "llmrt_over_hf_tokens_per_s",
            ratio(ours["output_tokens_per_s"], theirs["output_tokens_per_s"]),
            label="llmrt/hf tokens/s ratio",
            target=Target(op=">=", bound=HF_TOKENS_PER_S_BOUND),
            headline=True,
        )
    return report


def _gaps(token_times: Sequence[Sequence[float]]) -> list[float]:
    return [b - a for t in token_times for a, b in itertools.pairwise(t)]


def shared_prefix(settings: BenchSettings) -> Report:
    n = settings.count(SHARED_PROMPTS)
    new = settings.new_tokens(SHARED_NEW_TOKENS)
    report = Report(workload="shared-prefix", recipe=settings.recipe)
    prompts: list[list[int]] | None = None
    runs: dict[str, dict[str, Any]] = {}
    tokens: dict[str, list[tuple[int, ...]]] = {}
    for mode, caching in (("caching_on", "true"), ("caching_off", "false")):
        sized = sized_recipe(
            settings.recipe,
            user_overrides=[*settings.overrides, f"serving.prefix_caching={caching}"],
            tokens_per_request=SHARED_PREFIX_LEN + SHARED_SUFFIX_LEN + new,
        )
        report.recipe = sized.recipe.name
        with LLM.from_recipe(sized.recipe) as llm:
            pool = token_pool(llm.tokenizer, model_vocab_size=_vocab(llm))
            if prompts is None:
                max_len = llm.engine.scheduler.config.max_model_len
                prefix = min(SHARED_PREFIX_LEN, max_len - SHARED_SUFFIX_LEN - new)
                if prefix < 1:
                    raise ConfigError(
                        "--max-new-tokens", new, f"leaves no prefix room in max_model_len={max_len}"
                    )
                prompts = shared_prefix_prompts(
                    n,
                    prefix_len=prefix,
                    suffix_len=SHARED_SUFFIX_LEN,
                    pool=pool,
                    seed=settings.seed,
                )
                report.section(
                    "config",
                    {
                        "num_prompts": n,
                        "prefix_len": prefix,
                        "suffix_len": SHARED_SUFFIX_LEN,
                        "max_new_tokens": new,
                        "bench_overrides": list(sized.bench_overrides),
                    },
                )
            _warm(llm, pool, longest=len(prompts[0]), seed=settings.seed)
            before = llm.stats()
            for _ in progress(range(1), desc=f"llmrt {mode.replace('_', ' ')}"):
                start = time.perf_counter()
                outputs = llm.generate(prompts, greedy(new))
                wall = time.perf_counter() - start
            after = llm.stats()
        ttft = [o.token_times[0] - start for o in outputs if o.token_times]
        report.series[f"{mode} ttft"] = ttft
        tokens[mode] = [tuple(o.token_ids) for o in outputs]
        runs[mode] = rounded(
            {
                "prefill_tokens_computed": after.prefill_tokens_computed
                - before.prefill_tokens_computed,
                "prefix_hit_tokens": after.prefix_hit_tokens - before.prefix_hit_tokens,
                "mean_ttft_s": mean(ttft),
                "wall_s": wall,
            }
        )
        report.section(mode, runs[mode])
    on, off = runs["caching_on"], runs["caching_off"]
    report.section("check", {"outputs_identical": tokens["caching_on"] == tokens["caching_off"]})
    report.ratio(
        "prefill_tokens_off_over_on",
        ratio(off["prefill_tokens_computed"], on["prefill_tokens_computed"]),
        label="prefill tokens off/on",
        target=Target(op=">=", bound=8.0),
    )
    report.ratio(
        "mean_ttft_off_over_on",
        ratio(off["mean_ttft_s"], on["mean_ttft_s"]),
        label="mean TTFT off/on",
        target=Target(op=">=", bound=4.0),
        headline=True,
    )
    return report
