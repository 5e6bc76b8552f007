"""``BenchSettings``: the ``llmrt bench`` options, validated once."""

from __future__ import annotations

import argparse
from typing import Any, Literal

import attrs

from llmrt.errors import MISSING, ConfigError

Workload = Literal["mixed", "shared-prefix", "decode", "prefill", "oneshot", "llamacpp"]
WORKLOADS: tuple[str, ...] = (
    "mixed",
    "shared-prefix",
    "decode",
    "prefill",
    "oneshot",
    "llamacpp",
)
DEFAULT_PLANNER_ROWS: tuple[int, ...] = (1_000, 10_000, 100_000)


def _optional_positive(field: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(field, value, "must be a positive integer")


@attrs.frozen(kw_only=True)
class BenchSettings:
    """What to run and how to report it.

    ``num_prompts`` scales a workload down (or up): prompts for ``mixed`` and
    ``shared-prefix``, timed repeats for ``decode`` and ``prefill``. ``None`` fields take
    each workload's default.
    """

    recipe: str
    overrides: tuple[str, ...] = ()
    workload: Workload = "mixed"
    baseline: Literal["hf", "none"] = "none"
    num_prompts: int | None = None
    max_new_tokens: int | None = None
    hf_batch_size: int | None = None
    planner_rows: tuple[int, ...] = DEFAULT_PLANNER_ROWS
    seed: int = 0
    as_json: bool = False
    plot: str | None = None
    llamacpp_dir: str | None = None
    llamacpp_bench: str | None = None
    llamacpp_server: str | None = None
    server: str | None = None
    """``--server``: "" starts ``llmrt serve`` itself, a URL drives a running server."""
    concurrency: int | None = None
    schema: bool = False
    """``--server --schema``: also stream the prompts under a JSON-schema response_format."""
    stall_check: bool = False
    """``--server --stall-check``: a 10 MB request during 8 streams, inter-chunk gaps."""

    def __attrs_post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ConfigError("--workload", self.workload, f"must be one of {WORKLOADS}")
        if self.baseline not in ("hf", "none"):
            raise ConfigError("--baseline", self.baseline, "must be 'hf' or 'none'")
        _optional_positive("--num-prompts", self.num_prompts)
        _optional_positive("--max-new-tokens", self.max_new_tokens)
        _optional_positive("--hf-batch-size", self.hf_batch_size)
        _optional_positive("--concurrency", self.concurrency)
        if self.server and not self.server.startswith(("http://", "https://")):
            raise ConfigError("--server", self.server, "must be an http:// or https:// URL")
        if self.server is None:
            for flag, given in (
                ("--concurrency", self.concurrency is not None),
                ("--schema", self.schema),
                ("--stall-check", self.stall_check),
            ):
                if given:
                    raise ConfigError(flag, MISSING, "measures llmrt serve: add --server")
        if not self.planner_rows:
            raise ConfigError("--planner-rows", self.planner_rows, "needs at least one size")
        for rows in self.planner_rows:
            _optional_positive("--planner-rows", rows)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchSettings:
        rows = getattr(args, "planner_rows", None)
        return cls(
            recipe=args.recipe,
            overrides=tuple(args.overrides or ()),
            workload=args.workload,
            baseline=args.baseline,
            num_prompts=args.num_prompts,
            max_new_tokens=getattr(args, "max_new_tokens", None),
            hf_batch_size=getattr(args, "hf_batch_size", None),
            planner_rows=DEFAULT_PLANNER_ROWS if rows is None else _parse_rows(rows),
            seed=getattr(args, "seed", 0),
            as_json=bool(args.json),
            plot=args.plot,
            llamacpp_dir=getattr(args, "llamacpp_dir", None),
            llamacpp_bench=getattr(args, "llamacpp_bench", None),
            llamacpp_server=getattr(args, "llamacpp_server", None),
            server=getattr(args, "server", None),
            concurrency=getattr(args, "concurrency", None),
            schema=bool(getattr(args, "schema", False)),
            stall_check=bool(getattr(args, "stall_check", False)),
        )

    def count(self, default: int) -> int:
        """``num_prompts`` if given, else the workload's ``default``."""
        return self.num_prompts if self.num_prompts is not None else default

    def new_tokens(self, default: int) -> int:
        return self.max_new_tokens if self.max_new_tokens is not None else default


def _parse_rows(text: str | tuple[int, ...]) -> tuple[int, ...]:
    if isinstance(text, tuple):
        return text
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError("--planner-rows", text, "must be comma-separated integers") from None
