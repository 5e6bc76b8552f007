"""Optional latency plot: the CDF of every latency series of a report (needs matplotlib)."""

from __future__ import annotations

import sys

import numpy as np

from llmrt.benchmarks.report import Report


def write_plot(report: Report, path: str) -> bool:
    """Write ``path``; without matplotlib or series, say so on stderr and return False."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "llmrt bench: --plot needs matplotlib (not installed); no plot written", file=sys.stderr
        )
        return False
    series = {name: values for name, values in report.series.items() if values}
    if not series:
        print(
            f"llmrt bench: the {report.workload} workload has no latency series to plot",
            file=sys.stderr,
        )
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in series.items():
        ordered = np.sort(np.asarray(values, dtype=np.float64)) * 1e3
        ax.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of samples")
    ax.set_title(f"llmrt bench {report.workload} ({report.recipe})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
