"""The ``prefill`` workload: prompt processing against transformers and across plans.

One 512-token prompt through the bare model vs transformers' forward; a batched wave of
8x100-token prompts vs the same rows planned one by one (``DISABLE_BATCHED_PREFILL``),
through the lane group; ``plan_prefill`` cost per row at growing row counts. Pairs are
timed interleaved; ratios use the median of repeats (minimums are in ``min_s``).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from llmrt.benchmarks.hf import build_hf_model, hf_prefill_call
from llmrt.benchmarks.lanes import GREEDY, block_table, context_tokens, first_lane
from llmrt.benchmarks.report import Report, Target
from llmrt.benchmarks.settings import BenchSettings
from llmrt.benchmarks.sizing import sized_recipe
from llmrt.benchmarks.timing import (
    Timed,
    device_sync,
    interleaved_times,
    progress,
    ratio,
    rounded,
)
from llmrt.recipe.loader import load_recipe
from llmrt.runtime.config import PREFILL_BATCH_SIZES
from llmrt.runtime.prefill.buckets import SeqLenBuckets
from llmrt.runtime.prefill.plan import (
    DISABLE_BATCHED_PREFILL_ENV,
    PrefillPlanPolicy,
    PrefillRow,
    plan_prefill,
)
from llmrt.serving.llm import LLM

PREFILL_LONG = 512
PREFILL_WAVE_ROWS = 8
PREFILL_WAVE_LEN = 100
PREFILL_REPEATS = 8


@contextlib.contextmanager
def batched_prefill_disabled() -> Iterator[None]:
    """Set ``DISABLE_BATCHED_PREFILL`` for the block, then restore the previous value."""
    previous = os.environ.get(DISABLE_BATCHED_PREFILL_ENV)
    os.environ[DISABLE_BATCHED_PREFILL_ENV] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(DISABLE_BATCHED_PREFILL_ENV, None)
        else:
            os.environ[DISABLE_BATCHED_PREFILL_ENV] = previous


def prefill(settings: BenchSettings) -> Report:
    repeats = settings.count(PREFILL_REPEATS)
    base = load_recipe(settings.recipe, overrides=list(settings.overrides))
    spec = base.prefill
    wave = min(PREFILL_WAVE_ROWS, spec.max_batch_size, base.decode.lane_capacity)
    wave_len = min(PREFILL_WAVE_LEN, spec.max_chunk_size)
    bucket = spec.buckets().pad(wave_len)
    sizes = [b for b in PREFILL_BATCH_SIZES if b <= wave]
    # The long prompt within the recipe's context (toy models hold fewer than 512 tokens).
    long_len = min(PREFILL_LONG, base.max_model_len)
    sized = sized_recipe(
        settings.recipe,
        user_overrides=settings.overrides,
        tokens_per_request=long_len,
        requests=wave,
        extra=[
            f"warmup.prefill_seq_lens=[{bucket}]",
            f"warmup.prefill_batch_sizes=[{', '.join(map(str, sizes))}]",
        ],
    )
    report = Report(workload="prefill", recipe=sized.recipe.name)
    with LLM.from_recipe(sized.recipe) as llm:
        lane = first_lane(llm)
        device = lane.decode.config.device.torch_device
        sync = device_sync(device)
        layout = lane.layout
        report.section(
            "config",
            {
                "long_prompt_len": long_len,
                "wave_rows": wave,
                "wave_prompt_len": wave_len,
                "repeats": repeats,
                "bench_overrides": list(sized.bench_overrides),
            },
        )
        long = context_tokens(llm, rows=1, length=long_len, seed=settings.seed)
        table = block_table(
            rows=1, tokens=long_len, block_size=layout.block_size, width=layout.width
        ).to(device)
        model = lane.decode.config.model
        hf = build_hf_model(llm.container.model.weights(), device=device)

        def ours() -> None:
            model.prefill_forward(
                tokens=long.to(device),
                start_pos=torch.zeros(1, dtype=torch.int32, device=device),
                seq_lens=torch.full((1,), long_len, dtype=torch.int32, device=device),
                page_table=table,
                last_token_index=torch.full((1,), long_len - 1, device=device),
            )

        long_timings = interleaved_times(
            {"llmrt": Timed(run=ours), "hf": hf_prefill_call(hf, tokens=long.to(device))},
            warmup=1,
            repeats=repeats,
            sync=sync,
            desc="prefill 512 llmrt vs hf",
        )
        del hf
        long_times = long_timings.median
        report.section("long_prompt_s", rounded(long_times))
        report.section("min_s", rounded(long_timings.minimum))
        _waves(
            report, llm, wave=wave, length=wave_len, repeats=repeats, seed=settings.seed, sync=sync
        )
        report.ratio(
            "llmrt_over_hf_prefill_long",
            ratio(long_times["llmrt"], long_times["hf"]),
            label=f"llmrt/hf prefill time ({long_len}-token prompt)",
            target=Target(op="<=", bound=1.1),
            headline=True,
        )
    _planner(report, sizes=settings.planner_rows, seed=settings.seed)
    # The headline stays last even though the planner section was added after it.
    return report


def _waves(
    report: Report, llm: LLM, *, wave: int, length: int, repeats: int, seed: int, sync: Any
) -> None:
    """One padded wave of ``wave`` prompts vs the same rows planned one by one."""
    lane = first_lane(llm)
    group = llm.engine.executor
    layout = lane.layout
    prompts = context_tokens(llm, rows=wave, length=length, seed=seed + 1)
    table = block_table(rows=wave, tokens=length, block_size=layout.block_size, width=layout.width)
    rows = [
        PrefillRow(
            source_row=i,
            tokens=prompts[i],
            slot=i,
            block_ids=tuple(int(b) for b in table[i] if b >= 0),
        )
        for i in range(wave)
    ]
    params = [GREEDY] * wave
    batched_plan = lane.prefill.prepare(rows=rows, sampling_params=params).plan
    with batched_prefill_disabled():
        sequential_plan = lane.prefill.prepare(rows=rows, sampling_params=params).plan
    outputs: dict[str, list[int]] = {}

    def run(name: str, disabled: bool) -> Timed:
        def call() -> None:
            with batched_prefill_disabled() if disabled else contextlib.nullcontext():
                out = group.prefill_forward(rows=rows, sampling_params=params)
            if out.tokens is not None:
                outputs[name] = [int(t) for t in out.tokens]

        return Timed(run=call)

    timings = interleaved_times(
        {"batched": run("batched", False), "sequential": run("sequential", True)},
        warmup=1,
        repeats=repeats,
        sync=sync,
        desc="prefill waves",
    )
    times = timings.median
    report.section("min_s", rounded(timings.minimum))
    report.section(
        "waves",
        rounded(
            {
                "batched_s": times["batched"],
                "sequential_s": times["sequential"],
                "batched_plan_requests": len(batched_plan.requests),
                "sequential_plan_requests": len(sequential_plan.requests),
                "first_tokens_identical": outputs.get("batched") == outputs.get("sequential"),
            }
        ),
    )
    report.ratio(
        "sequential_over_batched_prefill",
        ratio(times["sequential"], times["batched"]),
        label=f"batched prefill speedup ({wave}x{length} tokens, sequential/batched)",
        target=Target(op=">=", bound=1.5),
    )


def planner_cost(n_rows: int, *, seed: int, repeat: int = 3) -> float:
    """Best-of-``repeat`` CPU seconds per row for ``plan_prefill`` over ``n_rows`` rows.

    Prompts of 1-256 tokens (half longer than the 128-token chunk), ~10% with a cached
    prefix, in shuffled order; the policy allows waves up to 32 rows.
    """
    rng = random.Random(seed)
    block = 16
    policy = PrefillPlanPolicy(
        block_size=block,
        page_table_width=32,
        num_blocks=n_rows * 16 + 16,
        max_sequence_length=512,
        max_chunk_size=128,
        batching_supported=True,
        batching_enabled=True,
        max_batch_size=32,
        lane_capacity=n_rows,
        buckets=SeqLenBuckets.fine(max_len=128, step=32),
        model_extracts_batched_outputs=True,
    )
    rows: list[PrefillRow] = []
    next_block = 0
    for i in range(n_rows):
        n = rng.randint(1, 256)
        need = math.ceil(n / block)
        cached = block * rng.randint(0, (n - 1) // block) if rng.random() < 0.1 else 0
        rows.append(
            PrefillRow(
                source_row=i,
                tokens=torch.randint(0, 1000, (n,)),
                cached_tokens=cached,
                slot=i,
                block_ids=tuple(range(next_block, next_block + need)),
            )
        )
        next_block += need
    rng.shuffle(rows)
    plan_prefill(rows=rows[:64], policy=policy, env={})
    best = math.inf
    for _ in range(repeat):
        start = time.process_time()
        plan_prefill(rows=rows, policy=policy, env={})
        best = min(best, time.process_time() - start)
    return best / n_rows


def _planner(report: Report, *, sizes: Sequence[int], seed: int) -> None:
    costs = {
        n: planner_cost(n, seed=seed) for n in progress(sizes, desc="planner", total=len(sizes))
    }
    report.section("planner_us_per_row", rounded({str(n): c * 1e6 for n, c in costs.items()}))
    small, large = min(costs), max(costs)
    report.ratio(
        "planner_cost_per_row_largest_over_smallest",
        ratio(costs[large], costs[small]),
        label=f"planner cost per row, {large} rows / {small} rows (flat is ~1x)",
    )
