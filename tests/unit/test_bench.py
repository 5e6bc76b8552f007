"""``llmrt bench`` on tiny-llama: every workload end to end, its JSON keys, headline last,
and the Hugging Face baseline computing the same greedy tokens as llmrt.

Numbers are never asserted here (performance targets live in the bench's own output).
"""

from __future__ import annotations

import io
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from llmrt.benchmarks.plot import write_plot
from llmrt.benchmarks.prefill import planner_cost
from llmrt.benchmarks.report import Report, Target
from llmrt.benchmarks.settings import BenchSettings
from llmrt.cli.bench import bench_report
from llmrt.cli.main import main

pytest.importorskip("transformers")

RECIPE = "tiny-llama"
RATIO_LINE = re.compile(r"^[^\n]+: (\d+\.\d+|nan|inf)x( \(target [<>]= [\d.]+: (met|missed)\))?$")

SMALL: dict[str, dict[str, Any]] = {
    # Five prompts: one full HF batch of the lane capacity (4) and a partial one.
    "mixed": {"num_prompts": 5, "baseline": "hf"},
    "shared-prefix": {"num_prompts": 3, "max_new_tokens": 4},
    "decode": {"num_prompts": 2},
    "prefill": {"num_prompts": 1, "planner_rows": (64, 256)},
}
STAT_KEYS = {
    "wall_s",
    "output_tokens_per_s",
    "total_tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
}
SECTIONS: dict[str, dict[str, set[str]]] = {
    "mixed": {
        "config": {"num_prompts", "prompt_len_min", "prompt_len_max", "max_new_tokens"},
        "llmrt": STAT_KEYS,
        "hf": STAT_KEYS | {"greedy_rows_identical", "greedy_rows"},
        "ratios": {"llmrt_over_hf_tokens_per_s"},
        "targets": {"llmrt_over_hf_tokens_per_s"},
    },
    "shared-prefix": {
        "config": {"num_prompts", "prefix_len", "suffix_len", "max_new_tokens"},
        "caching_on": {"prefill_tokens_computed", "mean_ttft_s"},
        "caching_off": {"prefill_tokens_computed", "mean_ttft_s"},
        "check": {"outputs_identical"},
        "ratios": {"prefill_tokens_off_over_on", "mean_ttft_off_over_on"},
    },
    "decode": {
        "config": {"context_len", "lane_capacity", "repeats"},
        "step_s": {"llmrt_b1", "llmrt_b1_loop", "hf_b1", "llmrt_b8", "hf_b8"},
        "min_s": {"llmrt_b1", "hf_b8", "lane_step", "model_forward", "traced", "eager"},
        "host_overhead": {"lane_step_s", "model_forward_s", "prepare_s", "stage_s", "consume_s"},
        "trace": {"traced_step_s", "eager_step_s"},
        "bandwidth": {
            "stream_read_GBps",
            "weight_bytes",
            "kv_context_bytes",
            "floor_s",
            "llmrt_b1_loop_s",
            "llmrt_b1_cold_s",
            "core_clock_GHz",
            "step_cycles_per_byte",
        },
        "ratios": {
            "llmrt_b1_over_bandwidth_floor",
            "llmrt_b1_cold_over_bandwidth_floor",
            "llmrt_over_hf_step_b1",
            "llmrt_over_hf_step_b8",
            "llmrt_over_hf_step_worst",
            "traced_over_eager_step",
            "host_overhead_fraction",
        },
    },
    "prefill": {
        "config": {"long_prompt_len", "wave_rows", "wave_prompt_len"},
        "long_prompt_s": {"llmrt", "hf"},
        "min_s": {"llmrt", "hf", "batched", "sequential"},
        "waves": {"batched_s", "sequential_s", "batched_plan_requests", "first_tokens_identical"},
        "planner_us_per_row": {"64", "256"},
        "ratios": {
            "llmrt_over_hf_prefill_long",
            "sequential_over_batched_prefill",
            "planner_cost_per_row_largest_over_smallest",
        },
    },
}
#: Rows of the default mixed workload (seed 0) of mixed lengths; row 6's greedy output holds EOS.
EOS_ROWS = (6, 0, 1, 2, 3)
HEADLINE_KEYS = {
    "mixed": "llmrt_over_hf_tokens_per_s",
    "shared-prefix": "mean_ttft_off_over_on",
    "decode": "llmrt_over_hf_step_worst",
    "prefill": "llmrt_over_hf_prefill_long",
}


@pytest.fixture(scope="module")
def reports() -> dict[str, Report]:
    """Each workload's report, run once for the module (filled on first use)."""
    return {}


def _report(reports: dict[str, Report], workload: str) -> Report:
    if workload not in reports:
        settings = BenchSettings(recipe=RECIPE, workload=workload, **SMALL[workload])
        reports[workload] = bench_report(settings)
    return reports[workload]


@pytest.fixture(params=sorted(SMALL))
def report(request: pytest.FixtureRequest, reports: dict[str, Report]) -> Report:
    return _report(reports, request.param)


def _emit(report: Report, *, as_json: bool) -> str:
    out = io.StringIO()
    report.emit(as_json=as_json, out=out)
    return out.getvalue()


def test_json_has_the_documented_keys(report: Report) -> None:
    text = _emit(report, as_json=True)
    assert text.count("\n") == 1, "one JSON object on one line"
    data = json.loads(text)
    assert data["workload"] == report.workload
    assert data["recipe"] == RECIPE
    assert {"torch", "transformers", "threads", "load_average_1m", "cpus", "cpu_model"} <= set(
        data["environment"]
    )
    for section, keys in SECTIONS[report.workload].items():
        missing = keys - set(data[section])
        assert not missing, f"{section} lacks {sorted(missing)}"
    key = HEADLINE_KEYS[report.workload]
    assert data["headline_ratio"] == data["ratios"][key]
    assert RATIO_LINE.match(data["headline"]), data["headline"]
    for target in data.get("targets", {}).values():
        assert set(target) == {"target", "value", "met"}


def test_text_output_ends_with_the_headline_ratio(report: Report) -> None:
    lines = _emit(report, as_json=False).splitlines()
    assert lines[-1] == report.headline
    assert RATIO_LINE.match(lines[-1]), lines[-1]
    assert sum(line == report.headline for line in lines) == 1


def test_workload_sanity(report: Report) -> None:
    """What each workload counted is what it was asked to run."""
    r = report.results
    if report.workload == "mixed":
        n, new = r["config"]["num_prompts"], r["config"]["max_new_tokens"]
        assert r["llmrt"]["output_tokens"] == r["hf"]["output_tokens"] == n * new
        assert r["llmrt"]["prompt_tokens"] == r["config"]["prompt_tokens"]
    elif report.workload == "shared-prefix":
        n, prompt = r["config"]["num_prompts"], r["config"]["prefix_len"] + 32
        assert r["caching_off"]["prefill_tokens_computed"] == n * prompt
        assert 0 < r["caching_on"]["prefill_tokens_computed"] <= n * prompt
        assert r["check"]["outputs_identical"] is True
    elif report.workload == "decode":
        assert all(v > 0 for v in r["step_s"].values())
        # tiny-llama's float32 linears: 2 layers x (qkv 64x128, o 64x64, gate/up 256x64,
        # down 64x128) and the untied 258x64 head, 4 bytes each.
        assert r["bandwidth"]["weight_bytes"] == 4 * (2 * (8192 + 4096 + 16384 + 8192) + 16512)
        # K and V of 128 context tokens, 2 KV heads of 16 dims, 2 layers, float32.
        assert r["bandwidth"]["kv_context_bytes"] == 2 * 2 * 128 * 2 * 16 * 4
        # The target's step is the decode loop's, per step; the cold one is reported beside.
        band, ratios = r["bandwidth"], r["ratios"]
        assert band["llmrt_b1_loop_s"] == pytest.approx(r["step_s"]["llmrt_b1_loop"], rel=1e-3)
        assert band["llmrt_b1_cold_s"] == pytest.approx(r["step_s"]["llmrt_b1"], rel=1e-3)
        floor = ratios["llmrt_b1_over_bandwidth_floor"]
        assert floor == pytest.approx(band["llmrt_b1_loop_s"] / band["floor_s"], rel=2e-2)
        # The step in core cycles per byte it reads, at the clock measured in the same run.
        read = band["weight_bytes"] + band["kv_context_bytes"]
        cycles = band["llmrt_b1_loop_s"] * band["core_clock_GHz"] * 1e9 / read
        assert band["step_cycles_per_byte"] == pytest.approx(cycles, rel=2e-2)
    else:
        assert r["waves"]["batched_plan_requests"] == 1
        assert r["waves"]["sequential_plan_requests"] == r["config"]["wave_rows"]
        assert r["waves"]["first_tokens_identical"] is True


def test_hf_baseline_generates_the_same_greedy_tokens(reports: dict[str, Report]) -> None:
    """A baseline that computes something else than llmrt on the same weights is a defect."""
    hf = _report(reports, "mixed").results["hf"]
    assert hf["greedy_rows"] == SMALL["mixed"]["num_prompts"]
    assert hf["greedy_rows_identical"] == hf["greedy_rows"]


def test_hf_generate_matches_llm_generate_directly() -> None:
    """Left-padded HF batches of mixed lengths equal llmrt's greedy tokens, token for token."""
    from llmrt.benchmarks.hf import build_hf_model, hf_generate
    from llmrt.benchmarks.prompts import random_prompts, spread_lengths, token_pool
    from llmrt.benchmarks.serving import greedy
    from llmrt.serving.llm import LLM

    with LLM.from_recipe(RECIPE, overrides=["kv_cache.num_blocks=128"]) as llm:
        pool = token_pool(llm.tokenizer, model_vocab_size=258)
        workload = random_prompts(spread_lengths(32, low=16, high=448, seed=0), pool=pool, seed=0)
        prompts = [workload[i] for i in EOS_ROWS]
        ours = [o.token_ids for o in llm.generate(prompts, greedy(64))]
        model = build_hf_model(llm.container.model.weights(), device=llm_device(llm))
        eos = llm.tokenizer.eos_token_ids
    # ignore_eos semantics: an EOS argmax is generated and decoding goes on.
    assert any(t in eos for row in ours for t in row), "pick rows whose greedy output has EOS"
    theirs = hf_generate(model, prompts, max_new_tokens=64, batch_size=4, pad_token_id=pool[0])
    assert [len(t) for t in theirs.token_ids] == [64] * len(prompts)
    assert list(theirs.token_ids) == ours


def llm_device(llm: Any) -> Any:
    return llm.engine.executor.lanes[0].decode.config.device.torch_device


def test_cli_prints_one_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["bench", RECIPE, "--workload", "shared-prefix", "--num-prompts", "2",
         "--max-new-tokens", "2", "--json"]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    data = json.loads(out[0])
    assert data["workload"] == "shared-prefix"
    assert data["headline"].startswith("mean TTFT off/on: ")


@pytest.mark.parametrize(("flag", "value"), [("--num-prompts", "0"), ("--planner-rows", "10,x")])
def test_bad_options_are_one_line_user_errors(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", RECIPE, flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err


@pytest.mark.parametrize("flags", [["--schema"], ["--stall-check"], ["--concurrency", "4"]])
def test_server_only_options_without_server_are_refused(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", RECIPE, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"llmrt: error: {flags[0]}: measures llmrt serve: add --server"], err


def test_report_formats_targets_and_keeps_the_headline_last() -> None:
    report = Report(workload="w", recipe="r")
    report.ratio("main", 1.5, label="main ratio", target=Target(op=">=", bound=2.0), headline=True)
    report.section("s", {"a": 1, "b": 0.25})
    report.ratio("side", 0.5, label="side ratio", target=Target(op="<=", bound=1.1))
    lines = _emit(report, as_json=False).splitlines()
    assert lines[-1] == "main ratio: 1.50x (target >= 2: missed)"
    assert "side ratio: 0.50x (target <= 1.1: met)" in lines
    data = json.loads(_emit(report, as_json=True))
    assert data["targets"]["main"] == {"target": ">= 2", "value": 1.5, "met": False}
    assert data["headline_ratio"] == 1.5


@pytest.mark.parametrize(
    ("value", "op", "shown"),
    [
        (1.0213, "<=", "1.021x (target <= 1.02: missed)"),  # not "1.02x ... missed"
        (1.0149, "<=", "1.01x (target <= 1.02: met)"),
        (1.02, "<=", "1.02x (target <= 1.02: met)"),
        (1.0199, ">=", "1.0199x (target >= 1.02: missed)"),
        (1.3004, "<=", "1.3004x (target <= 1.3: missed)"),
        (1.35, "<=", "1.35x (target <= 1.3: missed)"),
    ],
)
def test_a_ratio_reads_as_the_side_of_its_bound_it_is_judged(
    value: float, op: str, shown: str
) -> None:
    report = Report(workload="w", recipe="r")
    bound = 1.3 if value > 1.2 else 1.02
    report.ratio("k", value, label="r", target=Target(op=op, bound=bound))
    assert report.lines == [f"r: {shown}"]


def test_plot_without_matplotlib_is_a_note(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    report = Report(workload="w", recipe="r", series={"x": [0.1, 0.2]})
    assert write_plot(report, str(tmp_path / "p.png")) is False
    assert "matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_planner_cost_is_a_positive_time_per_row() -> None:
    cost = planner_cost(50, seed=0, repeat=1)
    assert math.isfinite(cost) and 0 < cost < 1.0


def test_cpu_model_reads_the_model_name_line(tmp_path: Path) -> None:
    from llmrt.benchmarks.report import cpu_model

    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
        "model name\t: AMD EPYC\nflags\t\t: fpu avx512f\n\n"
        "processor\t: 1\ncpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Other\n"
    )
    assert cpu_model(str(info)) == "AMD EPYC, family 25 model 17"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C CPU\n")
    assert cpu_model(str(info)) == "Intel(R) Xeon(R) Platinum 8481C CPU"


def test_cpu_model_falls_back_without_cpuinfo(tmp_path: Path) -> None:
    import platform

    from llmrt.benchmarks.report import cpu_model

    assert cpu_model(str(tmp_path / "absent")) == (platform.processor() or None)


def test_decode_floor_counts_the_kv_cache_in_the_dtype_it_holds() -> None:
    """``kv_cache.dtype: float16`` halves the context bytes the floor counts (tiny-llama's
    model computes in float32: the cache, not the model, says what a step reads)."""
    settings = BenchSettings(
        recipe=RECIPE,
        workload="decode",
        overrides=("kv_cache.dtype=float16",),
        **SMALL["decode"],
    )
    band = bench_report(settings).results["bandwidth"]
    # K and V of 128 context tokens, 2 KV heads of 16 dims, 2 layers, 2 bytes each.
    assert band["kv_context_bytes"] == 2 * 2 * 128 * 2 * 16 * 2


def test_the_clock_probe_reads_a_core_clock() -> None:
    """Dependent adds retire one per cycle: the rate is a CPU clock (0.3-7 GHz; time lost to
    other tenants only lowers it), the adds really run, and a non-positive count is an
    error."""
    from llmrt.kernels.native import kernels_available

    if not kernels_available()[0]:
        pytest.skip("llmrt's compiled kernels do not load here")
    probe = torch.ops.llmrt_kernels.dependent_adds_per_second
    rates = [probe(20_000_000) for _ in range(5)]
    assert 0.3e9 < max(rates) < 6.5e9, rates
    start = time.perf_counter()
    probe(40_000_000)
    took = time.perf_counter() - start
    # The adds really ran, one per cycle: no faster than a 6.5 GHz core (a chain of immediate
    # adds, which Intel cores fold at rename, read 4.8-7.6 "GHz" on a 2.8 GHz Emerald Rapids).
    assert 40_000_000 / took < 6.5e9
    with pytest.raises(RuntimeError, match="adds must be positive"):
        probe(0)


def test_recipes_outside_the_defaults_bench_without_crashing() -> None:
    """A model transformers has no class for keeps llmrt's numbers (the HF ratio says why it
    is missing); ttnn's decode ends on its own headline; a context under 512 tokens sizes the
    prefill workload's long prompt to it."""
    mixed = bench_report(
        BenchSettings(
            recipe="toy-ttnn", workload="mixed", baseline="hf", num_prompts=2, max_new_tokens=4
        )
    )
    assert any("no HF baseline" in line and "toy_ttnn" in line for line in mixed.lines)
    assert mixed.results["llmrt"]["output_tokens"] == 8 and mixed.headline
    decode = bench_report(BenchSettings(recipe="toy-ttnn", workload="decode", num_prompts=2))
    assert decode.to_json()["headline_ratio"] is not None and decode.headline
    assert decode.headline not in decode.lines
    prefill = bench_report(
        BenchSettings(
            recipe=RECIPE,
            workload="prefill",
            num_prompts=1,
            overrides=("serving.max_model_len=256",),
        )
    )
    assert prefill.results["config"]["long_prompt_len"] == 256
    assert prefill.to_json()["headline_ratio"] is not None
