"""``llmrt bench``: run one workload and print its results against an in-run baseline.

Workloads (``--workload``; implemented in ``llmrt.benchmarks``):

- ``mixed`` (default): prompts of 16-512 tokens through ``LLM.generate``; with
  ``--baseline hf`` the same prompts through transformers ``generate`` on the same
  weights. JSON sections ``llmrt`` / ``hf`` (``wall_s``, ``output_tokens_per_s``,
  ``total_tokens_per_s``, ``ttft_p50_s``, ``ttft_p99_s``, ``itl_p50_s``, ``itl_p99_s``;
  ``hf`` adds ``greedy_rows_identical``), ratio ``llmrt_over_hf_tokens_per_s``.
- ``shared-prefix``: prefix caching on vs off. Sections ``caching_on`` / ``caching_off``
  (``prefill_tokens_computed``, ``mean_ttft_s``), ``check.outputs_identical``; ratios
  ``prefill_tokens_off_over_on`` and ``mean_ttft_off_over_on`` (headline).
- ``decode``: sections ``step_s`` (medians: ``llmrt_b1``, ``hf_b1``, ``llmrt_b8``,
  ``hf_b8``), ``min_s`` (the same calls' minimums), ``host_overhead``, ``trace``; ratios
  ``llmrt_over_hf_step_b1`` / ``_b8`` / ``_worst`` (headline), ``traced_over_eager_step``,
  ``host_overhead_fraction``.
- ``prefill``: sections ``long_prompt_s``, ``waves``, ``min_s``, ``planner_us_per_row``;
  ratios ``llmrt_over_hf_prefill_long`` (headline), ``sequential_over_batched_prefill``,
  ``planner_cost_per_row_largest_over_smallest``.
- ``oneshot``: a fresh ``llmrt generate`` process (one prompt, 16 new tokens) against
  ``python -c "import torch"``, interleaved after one untimed warm run of each. Sections
  ``wall_s`` (medians ``import_torch``, ``llmrt_generate`` and their ``_min``),
  ``peak_rss_gb`` (each process's own peak); ratios ``generate_peak_rss_gb`` and
  ``generate_over_import_torch_wall`` (headline).
- ``llamacpp``: llmrt against llama.cpp on the recipe's GGUF (``llama-bench``,
  ``llama-server`` with 16 slots, or ``llama_cpp``; see ``llmrt.benchmarks.llamacpp``).
  Sections ``llmrt`` / ``llamacpp`` (``itl_s``, ``pp_tokens_per_s``,
  ``mixed_output_tokens_per_s``); ratios ``itl_llmrt_over_llamacpp``,
  ``pp_llmrt_over_llamacpp``, ``mixed_llmrt_over_llamacpp_server`` (headline). Without
  llama.cpp the headline says so and what to provide.

- ``--server [URL]``: the ``mixed`` prompts through ``llmrt serve`` (self-started, or the
  running server at URL) by concurrent streaming clients, against offline
  ``LLM.generate`` in the same run. Sections ``offline``, ``server``, ``server_8_clients``;
  ratio ``server_over_offline_tokens_per_s`` (headline, target >= 0.9); the TTFT p50 at 8
  clients is ``server_8_clients.ttft_p50_s``. ``--schema`` adds plain and JSON-schema
  ``response_format`` runs alternated twice on fresh prompts (section ``structured``, ratio
  ``structured_over_plain_tokens_per_s``, target >= 0.9); ``--stall-check`` adds 8 streams
  with and without a 10 MB request sent mid-decode (section ``stall``, ratio
  ``stall_max_gap_over_median``: the largest inter-chunk gap over its stream's median,
  target <= 2, beside the control run's).

Every JSON object also holds ``workload``, ``recipe``, ``environment``, ``config``,
``ratios``, ``targets`` (each ``{"target", "value", "met"}``), ``headline`` (the text of
the last line) and ``headline_ratio``. Text output ends with the headline line.
Progress bars go to stderr.
"""

from __future__ import annotations

import argparse

from llmrt.benchmarks.report import Report
from llmrt.benchmarks.settings import BenchSettings


def bench_report(settings: BenchSettings) -> Report:
    """Run the workload ``settings`` names and return its report (nothing printed)."""
    if settings.server is not None:
        from llmrt.benchmarks.server import server as run
    elif settings.workload in ("mixed", "shared-prefix"):
        from llmrt.benchmarks import serving

        run = serving.mixed if settings.workload == "mixed" else serving.shared_prefix
    elif settings.workload == "llamacpp":
        from llmrt.benchmarks.vs_llamacpp import vs_llamacpp as run
    elif settings.workload == "oneshot":
        from llmrt.benchmarks.oneshot import oneshot as run
    elif settings.workload == "decode":
        from llmrt.benchmarks.decode import decode as run
    else:
        from llmrt.benchmarks.prefill import prefill as run
    return run(settings)


def run_bench(args: argparse.Namespace) -> int:
    """``llmrt bench``: run, optionally plot, print the report (headline last); returns 0."""
    settings = BenchSettings.from_args(args)
    report = bench_report(settings)
    if settings.plot:
        from llmrt.benchmarks.plot import write_plot

        write_plot(report, settings.plot)
    report.emit(as_json=settings.as_json)
    return 0
