"""``Report``: one workload's results as text lines or one JSON object, headline last."""

from __future__ import annotations

import json
import math
import operator
import os
import platform
import sys
from collections.abc import Callable, Mapping
from typing import Any, TextIO

import attrs
import torch

from llmrt.device.cpu_features import CPUINFO, read_cpu_features

_COMPARE: Mapping[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
}


@attrs.frozen(kw_only=True)
class Target:
    """A performance target: ``value <op> bound`` (``op`` is ``<=`` or ``>=``)."""

    op: str
    bound: float

    def met(self, value: float) -> bool:
        return math.isfinite(value) and _COMPARE[self.op](value, self.bound)

    def describe(self) -> str:
        return f"{self.op} {self.bound:g}"


@attrs.define(kw_only=True)
class Report:
    """Results of one workload.

    ``results`` nests plain JSON values; ``lines`` are the human-readable lines printed
    before the ``headline`` (the workload's main ratio, always the last line);
    ``series`` are latency samples (seconds) for the optional plot.
    """

    workload: str
    recipe: str
    results: dict[str, Any] = attrs.Factory(dict)
    lines: list[str] = attrs.Factory(list)
    headline: str = ""
    headline_key: str | None = None
    series: dict[str, list[float]] = attrs.Factory(dict)
    _ratio_lines: dict[str, str] = attrs.Factory(dict)

    def section(self, name: str, values: Mapping[str, Any]) -> None:
        """Record ``values`` under ``results[name]`` and print them as ``name.key: value``."""
        self.results.setdefault(name, {}).update(values)
        for key, value in values.items():
            self.lines.append(f"{name}.{key}: {_format(value)}")

    def note(self, text: str) -> None:
        self.lines.append(text)

    def ratio(
        self,
        key: str,
        value: float,
        *,
        label: str,
        target: Target | None = None,
        headline: bool = False,
        suffix: str = "x",
        digits: int = 2,
    ) -> None:
        """Record a ratio (``results["ratios"][key]``) and its target; maybe the headline.

        A value printed at ``digits`` that would read as the other side of its target's
        bound (1.0213 as "1.02x" against <= 1.02) is printed with as many more digits as it
        takes to read as it is judged."""
        self.results.setdefault("ratios", {})[key] = _finite(value)
        shown = digits
        if target is not None and math.isfinite(value):
            while shown < 6 and target.met(round(value, shown)) != target.met(value):
                shown += 1
        text = f"{label}: {value:.{shown}f}{suffix}"
        if target is not None:
            met = target.met(value)
            self.results.setdefault("targets", {})[key] = {
                "target": target.describe(),
                "value": _finite(value),
                "met": met,
            }
            text += f" (target {target.describe()}: {'met' if met else 'missed'})"
        if headline:
            self.headline = text
            self.headline_key = key
        else:
            self.lines.append(text)
            self._ratio_lines[key] = text

    def promote(self, key: str) -> None:
        """Make the already recorded ratio ``key`` the headline (its line moves last)."""
        line = self._ratio_lines[key]
        self.lines.remove(line)
        self.headline = line
        self.headline_key = key

    def to_json(self) -> dict[str, Any]:
        ratios = self.results.get("ratios", {})
        return {
            "workload": self.workload,
            "recipe": self.recipe,
            "environment": environment(),
            "ratios": {},
            "targets": {},
            **self.results,
            "headline": self.headline,
            "headline_ratio": ratios.get(self.headline_key) if self.headline_key else None,
        }

    def emit(self, *, as_json: bool, out: TextIO | None = None) -> None:
        """Print one JSON object, or the lines and then the headline."""
        stream = out if out is not None else sys.stdout
        if as_json:
            print(json.dumps(self.to_json(), sort_keys=False), file=stream, flush=True)
            return
        print(f"llmrt bench {self.workload} ({self.recipe})", file=stream)
        env = environment()
        print(
            f"torch {env['torch']}, transformers {env['transformers']}, "
            f"{env['threads']} threads, {env['machine']}, {env['cpus']} CPUs"
            f"{' (' + env['cpu_model'] + ')' if env['cpu_model'] else ''}, "
            f"load average {env['load_average_1m']}",
            file=stream,
        )
        for line in self.lines:
            print(line, file=stream)
        print(self.headline, file=stream, flush=True)


def environment() -> dict[str, Any]:
    """What the numbers depend on: library versions, threads, CPU."""
    try:
        import transformers

        tf_version: str | None = transformers.__version__
    except ImportError:
        tf_version = None
    return {
        "torch": torch.__version__,
        "transformers": tf_version,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or platform.system()}".strip(),
        "python": platform.python_version(),
        # Other work on the machine skews every wall time; the 1-minute load says how much.
        "load_average_1m": _load_average(),
        "cpus": os.cpu_count(),
        # Kernel rates and bandwidth floors differ by CPU model: reports (and the floors in
        # them) are only comparable between runs on the same one.
        "cpu_model": cpu_model(),
    }


def cpu_model(cpuinfo: str = CPUINFO) -> str | None:
    """The CPU's model name with its family and model numbers (a VM may show only "AMD EPYC";
    the numbers tell Zen 3 from Zen 4), from Linux ``/proc/cpuinfo``; else what ``platform``
    knows, or None."""
    cpu = read_cpu_features(cpuinfo)
    if not cpu.model_name:
        return platform.processor() or None
    if cpu.family and cpu.model:
        return f"{cpu.model_name}, family {cpu.family} model {cpu.model}"
    return cpu.model_name


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # not on every platform
        return None


def _finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def _format(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_format(v) for v in value) + "]"
    return str(value)
