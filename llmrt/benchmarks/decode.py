"""The ``decode`` workload: llmrt's decode step against transformers' on the same weights.

The bare model step (the lane's ``decode_forward``, compiled under ``device.compile:
inductor``, over the lane's preallocated paged KV)
vs transformers' step over a prefilled ``DynamicCache`` (cropped back after every step)
at batch 1 and 8, context ~128 tokens; traced vs eager lane steps at the lane capacity;
the host work of one lane step (prepare, stage, finish, consume; not the model forward)
as a fraction of the step. Calls are timed interleaved; ratios use the median of repeats
(minimums are in ``min_s``). The host-overhead fraction sums directly timed parts (robust
on a loaded machine); ``fraction_by_difference`` (step minus model forward) sits beside it.

The bandwidth floor of the batch-1 step is the bytes it must read (every linear weight in its
stored format, plus the KV context) over the machine's streaming read rate, measured in the
same run and interleaved with the steps (a sum over ``STREAM_BYTES`` with torch's threads,
from 4 KiB pages for the target and, where the kernel allows, from huge pages as well);
the step's ratio to it is the headroom a kernel has left. The step put against it is one of
a decode loop (``LOOP_STEPS`` back to back per sample, as generation runs them); the single
step timed right after the 1 GiB read is reported beside it. The cores' clock is sampled the
same way (dependent adds, one per cycle), and the step reported in core cycles per byte: on
a shared host a step's cycles per byte move with other tenants' load on the same cores even
where the clock and the read rate hold still.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from llmrt.benchmarks.hf import build_hf_model, hf_decode_call
from llmrt.benchmarks.lanes import GREEDY, WARMUP, block_table, context_tokens, first_lane
from llmrt.benchmarks.report import Report, Target
from llmrt.benchmarks.settings import BenchSettings
from llmrt.benchmarks.sizing import sized_recipe
from llmrt.benchmarks.timing import Timed, device_sync, interleaved_times, ratio, rounded
from llmrt.device.huge_pages import advised_mapping, huge_pages_unavailable
from llmrt.families.layers import linear_weight_bytes
from llmrt.kernels.native import kernels_available
from llmrt.recipe.loader import load_recipe
from llmrt.runtime.compiled_step import DecodeStep
from llmrt.runtime.model_executor import ModelExecutor
from llmrt.runtime.prefill.plan import PrefillRow
from llmrt.serving.llm import LLM

DECODE_CONTEXT = 128
DECODE_BATCHES = (1, 8)
DECODE_SPAN = 32  # lane steps advance positions through this many tokens, then wrap
DECODE_REPEATS = 32
STREAM_BYTES = 1 << 30
#: Consecutive batch-1 steps per timed sample of a decode loop (``llmrt_b1_loop``).
LOOP_STEPS = 8
#: Target: the batch-1 step within this factor of its bandwidth floor.
FLOOR_BOUND = 1.3
#: Dependent adds per core-clock sample (~15-25 ms at 2-3.5 GHz).
CLOCK_ADDS = 50_000_000


def decode(settings: BenchSettings) -> Report:
    repeats = settings.count(DECODE_REPEATS)
    base = load_recipe(settings.recipe, overrides=list(settings.overrides))
    cap = base.decode.lane_capacity
    rows = max(*DECODE_BATCHES, cap)
    sized = sized_recipe(
        settings.recipe,
        user_overrides=settings.overrides,
        tokens_per_request=DECODE_CONTEXT + DECODE_SPAN + 1,
        requests=rows,
    )
    report = Report(workload="decode", recipe=sized.recipe.name)
    # Targets: eager float32 within 10% of transformers; a compiled recipe at most 0.4x.
    bound = 0.4 if sized.recipe.device.compile == "inductor" else 1.1
    start = time.perf_counter()
    with LLM.from_recipe(sized.recipe) as llm:
        build_s = time.perf_counter() - start
        lane = first_lane(llm)
        model = lane.decode.config.model
        device = lane.decode.config.device.torch_device
        sync = device_sync(device)
        layout = lane.layout
        table = block_table(
            rows=rows,
            tokens=DECODE_CONTEXT + DECODE_SPAN + 1,
            block_size=layout.block_size,
            width=layout.width,
        )
        context = context_tokens(llm, rows=rows, length=DECODE_CONTEXT, seed=settings.seed)
        if sized.recipe.device.backend == "ttnn":
            _ttnn_decode(report, lane, context=context, table=table, repeats=repeats, sync=sync)
            return report
        model.prefill_forward(
            tokens=context.to(device),
            start_pos=torch.zeros(rows, dtype=torch.int32, device=device),
            seq_lens=torch.full((rows,), DECODE_CONTEXT, dtype=torch.int32, device=device),
            page_table=table.to(device),
            last_token_index=torch.full((rows,), DECODE_CONTEXT - 1, device=device),
        )
        report.section(
            "config",
            {
                "context_len": DECODE_CONTEXT,
                "batches": list(DECODE_BATCHES),
                "lane_capacity": cap,
                "repeats": repeats,
                "trace_mode": sized.recipe.trace.mode,
                "compile": sized.recipe.device.compile,
                "decode_kernel": _decode_kernel(model),
                "llm_build_s": round(build_s, 3),
                "bench_overrides": list(sized.bench_overrides),
            },
        )
        hf = build_hf_model(llm.container.model.weights(), device=device)
        step_tokens = context[:, -1].to(device)
        positions = torch.full((rows,), DECODE_CONTEXT, dtype=torch.int32, device=device)
        dev_table = table.to(device)
        calls: dict[str, Timed] = {}
        for b in DECODE_BATCHES:
            calls[f"llmrt_b{b}"] = _bare_decode(
                lane.decode.model_step,
                tokens=step_tokens[:b],
                positions=positions[:b],
                table=dev_table[:b],
            )
            calls[f"hf_b{b}"] = hf_decode_call(hf, context=context[:b].to(device))
        clock_rates: list[float] = []  # the probe's own readings, one per sample
        calls["llmrt_b1_loop"] = _bare_decode(
            lane.decode.model_step,
            tokens=step_tokens[:1],
            positions=positions[:1],
            table=dev_table[:1],
            steps=LOOP_STEPS,
        )
        if torch.device(device).type == "cpu":
            calls["stream_read"] = _stream_read(STREAM_BYTES, huge=False)
            if huge_pages_unavailable() is None:
                calls["stream_read_huge"] = _stream_read(STREAM_BYTES, huge=True)
            if kernels_available()[0]:
                calls["core_clock"] = _core_clock(CLOCK_ADDS, rates=clock_rates)
        timings = interleaved_times(
            calls, warmup=WARMUP, repeats=repeats, sync=sync, desc="decode llmrt vs hf"
        )
        del calls, hf
        for table_ in (timings.median, timings.minimum):
            table_["llmrt_b1_loop"] /= LOOP_STEPS
        bare = timings.median
        report.section("step_s", rounded(bare))
        report.section("min_s", rounded(timings.minimum))
        ratios = {b: ratio(bare[f"llmrt_b{b}"], bare[f"hf_b{b}"]) for b in DECODE_BATCHES}
        for b, value in ratios.items():
            report.ratio(
                f"llmrt_over_hf_step_b{b}",
                value,
                label=f"llmrt/hf decode step time (batch {b})",
                target=Target(op="<=", bound=bound),
            )
        if "stream_read" in bare:
            _bandwidth_floor(
                report,
                model,
                kv_dtypes=[k.dtype for k in lane.kv_cache.context.keys],
                step_s=bare["llmrt_b1_loop"],
                cold_step_s=bare["llmrt_b1"],
                stream_s=bare["stream_read"],
                huge_stream_s=bare.get("stream_read_huge"),
                clock_hz=statistics.median(clock_rates) if clock_rates else None,
            )
        values = list(ratios.values())
        worst = math.nan if any(math.isnan(v) for v in values) else max(values)
        _lane_steps(report, lane, context=context, table=table, repeats=repeats, sync=sync)
        report.ratio(
            "llmrt_over_hf_step_worst",
            worst,
            label="llmrt/hf decode step time ratio (worse of batch "
            + " and ".join(map(str, DECODE_BATCHES))
            + ")",
            target=Target(op="<=", bound=bound),
            headline=True,
        )
    return report


def _decode_kernel(model: Any) -> str:
    """``fused`` when CPU decode steps run the fused layer op, else ``ops (why)``."""
    status = getattr(getattr(model, "backbone", None), "fused_decode_status", None)
    why = status() if status is not None else "no fused path"
    return "fused" if why is None else f"ops ({why})"


def step_bytes(model: Any, *, context: int, kv_dtypes: Sequence[torch.dtype]) -> dict[str, int]:
    """Bytes one batch-1 decode step must read: linear weights as stored, and the KV context
    in the dtypes the bound cache holds (``kv_dtypes``, one per layer; ``kv_cache.dtype``
    sets them, not the model's compute dtype)."""
    meta = model.attention_metadata()
    kv = sum(2 * context * meta.num_kv_heads * meta.head_dim * d.itemsize for d in kv_dtypes)
    return {"weights": linear_weight_bytes(model), "kv_context": kv}


def _stream_read(nbytes: int, *, huge: bool) -> Timed:
    """A sum over ``nbytes`` of float32 (torch's threads): the streaming read rate, from
    4 KiB pages (torch's own allocation) or from a mapping advised onto huge pages."""
    if huge:
        buffer = torch.frombuffer(advised_mapping(nbytes, huge=True), dtype=torch.float32)
        buffer.fill_(1.0)
    else:
        buffer = torch.ones(nbytes // 4, dtype=torch.float32)

    def run() -> None:
        buffer.sum()

    return Timed(run=run)


def _bandwidth_floor(
    report: Report,
    model: Any,
    *,
    kv_dtypes: Sequence[torch.dtype],
    step_s: float,
    cold_step_s: float,
    stream_s: float,
    huge_stream_s: float | None,
    clock_hz: float | None = None,
) -> None:
    """The batch-1 step against bytes read / streaming read rate (both from this run).

    The target's step is one of a decode loop (``LOOP_STEPS`` consecutive steps per sample,
    as generation runs them); the cold step, timed right after the 1 GiB read (which evicts
    caches a decode loop keeps warm), is reported beside it. The target's
    rate is a read from 4 KiB pages (a plain torch buffer); CPU weights sit on huge pages
    (``device.huge_pages``), so the loop's step is also put against the huge-page read.
    ``clock_hz`` (the median of ``_core_clock``'s readings) adds the cores' clock in the same
    run and the step in core cycles per byte read, which separates a host's clock changes
    from contention for the cores (the clock holds, the cycles per byte grow)."""
    read = step_bytes(model, context=DECODE_CONTEXT, kv_dtypes=kv_dtypes)
    total = sum(read.values())
    rate = STREAM_BYTES / stream_s
    floor_s = total / rate
    section: dict[str, Any] = {
        "stream_read_GBps": round(rate / 1e9, 2),
        "weight_bytes": read["weights"],
        "kv_context_bytes": read["kv_context"],
        "floor_s": floor_s,
        "llmrt_b1_loop_s": step_s,
        "llmrt_b1_cold_s": cold_step_s,
    }
    huge_floor_s = None
    if huge_stream_s is not None:
        huge_rate = STREAM_BYTES / huge_stream_s
        huge_floor_s = total / huge_rate
        section["huge_page_stream_read_GBps"] = round(huge_rate / 1e9, 2)
        section["huge_page_floor_s"] = huge_floor_s
    if clock_hz is not None:
        section["core_clock_GHz"] = round(clock_hz / 1e9, 2)
        section["step_cycles_per_byte"] = round(step_s * clock_hz / total, 3)
    report.section("bandwidth", rounded(section))
    report.ratio(
        "llmrt_b1_over_bandwidth_floor",
        ratio(step_s, floor_s),
        label="llmrt batch-1 decode step in a decode loop / bandwidth floor"
        " (bytes read / streaming read rate)",
        target=Target(op="<=", bound=FLOOR_BOUND),
    )
    report.ratio(
        "llmrt_b1_cold_over_bandwidth_floor",
        ratio(cold_step_s, floor_s),
        label="llmrt batch-1 decode step right after a 1 GiB read / bandwidth floor",
    )
    if huge_floor_s is not None:
        report.ratio(
            "llmrt_b1_over_huge_page_floor",
            ratio(step_s, huge_floor_s),
            label="llmrt batch-1 decode step / floor at the huge-page streaming read rate",
        )


def _core_clock(adds: int, *, rates: list[float]) -> Timed:
    """``adds`` dependent adds on every torch thread (``dependent_adds_per_second``, compiled
    kernels), timed on each thread: one add per core cycle, so each sample appends the
    slowest core's clock to ``rates``, time lost to other tenants included."""
    probe = torch.ops.llmrt_kernels.dependent_adds_per_second

    def run() -> None:
        rates.append(float(probe(adds)))

    return Timed(run=run)


def _bare_decode(
    step: DecodeStep,
    *,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    table: torch.Tensor,
    steps: int = 1,
) -> Timed:
    """The lane's model step (compiled under ``device.compile: inductor``), no runtime around
    it; ``steps`` back to back per run (the caller divides)."""

    def run() -> None:
        for _ in range(steps):
            step(tokens=tokens, positions=positions, page_table=table)

    return Timed(run=run)


def _ttnn_decode(
    report: Report,
    lane: ModelExecutor,
    *,
    context: torch.Tensor,
    table: torch.Tensor,
    repeats: int,
    sync: Any,
) -> None:
    """On ttnn: the lane's rows prefilled through the lane (the model's forwards take ttnn
    tensors, and there is no transformers step on the chip to put beside it), then traced vs
    eager lane steps and the host overhead."""
    cap = lane.lane_capacity
    block_size = lane.layout.block_size
    used = -(-DECODE_CONTEXT // block_size)
    rows = [
        PrefillRow(
            source_row=r,
            tokens=context[r],
            slot=r,
            block_ids=tuple(int(b) for b in table[r, :used]),
        )
        for r in range(min(cap, context.shape[0]))
    ]
    lane.prefill_forward(rows=rows, sampling_params=[GREEDY] * len(rows))
    report.note("ttnn: no transformers baseline or bandwidth floor; lane steps only")
    _lane_steps(
        report, lane, context=context, table=table, repeats=repeats, sync=sync, bare=False
    )
    ratios = report.results.get("ratios", {})
    report.promote(
        "traced_over_eager_step" if "traced_over_eager_step" in ratios else "host_overhead_fraction"
    )


def _lane_steps(
    report: Report,
    lane: ModelExecutor,
    *,
    context: torch.Tensor,
    table: torch.Tensor,
    repeats: int,
    sync: Any,
    bare: bool = True,
) -> None:
    """Traced vs eager lane steps at the lane capacity; host overhead at batch 8 (or less).
    ``bare``: also time the model step alone (on torch tensors; not on ttnn)."""
    cap = lane.lane_capacity
    runtime = lane.decode
    tokens = context[:, -1]
    steps = [torch.full((cap,), DECODE_CONTEXT + i, dtype=torch.int32) for i in range(DECODE_SPAN)]
    rows = min(max(DECODE_BATCHES), cap)

    def lane_step(n: int, trace: bool | None) -> Timed:
        cycle = itertools.cycle(steps)

        def run() -> None:
            lane.decode_forward(
                tokens=tokens[:n],
                start_pos=next(cycle)[:n],
                page_table=table[:n],
                sampling_params=[GREEDY] * n,
                enable_trace=trace,
            )

        return Timed(run=run)

    prepared = [
        runtime.prepare(
            tokens=tokens[:rows],
            start_pos=s[:rows],
            page_table=table[:rows],
            sampling_params=[GREEDY] * rows,
        )
        for s in steps
    ]
    device = runtime.config.device.torch_device
    model_step = runtime.model_step
    staged = [
        (p.tokens.to(device), p.positions.to(device), p.page_table.to(device))
        for p in (prepared if bare else ())
    ]
    if bare:
        raw = {
            "logits": model_step(
                tokens=staged[0][0], positions=staged[0][1], page_table=staged[0][2]
            )
        }
    else:
        raw = runtime.body_once(prepared[0])
    forward_cycle = itertools.cycle(staged)

    def forward() -> None:
        t, p, pt = next(forward_cycle)
        model_step(tokens=t, positions=p, page_table=pt)

    def stage() -> None:
        inputs = runtime.stage(prepared[0])
        for tensor in inputs.owned_tensors():
            runtime.config.device.deallocate(tensor)

    calls: dict[str, Timed] = {
        "lane_step": lane_step(rows, None),
        "stage": Timed(run=stage),
        "prepare": Timed(
            run=lambda: runtime.prepare(
                tokens=tokens[:rows],
                start_pos=steps[0][:rows],
                page_table=table[:rows],
                sampling_params=[GREEDY] * rows,
            )
        ),
    }
    if bare:
        finished = runtime.finish(prepared[0], raw)
        calls["finish"] = Timed(run=lambda: runtime.finish(prepared[0], raw))
        calls["consume"] = Timed(run=lambda: runtime.consume(finished, prepared[0]))
    else:  # a ttnn finish submits a host read that only its consume completes
        calls["finish_consume"] = Timed(
            run=lambda: runtime.consume(runtime.finish(prepared[0], raw), prepared[0])
        )
    if bare:
        calls["model_forward"] = Timed(run=forward)
    traced = lane.traced is not None and lane.traced.trace_config.decode_enabled
    if traced:
        calls["traced"] = lane_step(cap, True)
        calls["eager"] = lane_step(cap, False)
    timings = interleaved_times(
        calls, warmup=WARMUP, repeats=repeats, sync=sync, desc="decode lane steps"
    )
    times = timings.median
    report.section("min_s", rounded(timings.minimum))
    finish_consume = times.get("finish_consume", math.nan)
    if bare:
        finish_consume = times["finish"] + times["consume"]
    parts = times["prepare"] + times["stage"] + finish_consume
    step = times["lane_step"]
    report.section(
        "host_overhead",
        rounded(
            {
                "rows": rows,
                "lane_step_s": step,
                "model_forward_s": times.get("model_forward", math.nan),
                "prepare_s": times["prepare"],
                "stage_s": times["stage"],
                "finish_s": times.get("finish", math.nan),
                "consume_s": times.get("consume", math.nan),
                "finish_consume_s": finish_consume,
                "fraction_by_difference": ratio(
                    step - times.get("model_forward", math.nan), step
                ),
            }
        ),
    )
    report.ratio(
        "host_overhead_fraction",
        ratio(parts, step),
        label=f"host overhead / lane decode step (batch {rows}; prepare+stage+finish+consume)",
        target=Target(op="<=", bound=0.05),
        suffix="",
        digits=3,
    )
    if not traced:
        report.note("traced/eager: skipped (trace.mode has no decode traces)")
        return
    report.section(
        "trace", rounded({"traced_step_s": times["traced"], "eager_step_s": times["eager"]})
    )
    report.ratio(
        "traced_over_eager_step",
        ratio(times["traced"], times["eager"]),
        label=f"traced/eager decode step time (batch {cap})",
        target=Target(op="<=", bound=1.02),
    )
