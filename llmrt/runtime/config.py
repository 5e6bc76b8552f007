"""Static runtime policy: trace, warmup, paged-KV and page-table geometry.

Every value here is a frozen attrs class validated at construction, so runtime
objects can read ``self.config`` without re-checking. The one late change the
runtime allows is the physical KV capacity: ``PagedKVCacheConfig.with_num_blocks``
and ``PageTableLayout.with_physical_blocks`` return shrunk replacements and refuse
to grow capacity or change the block size.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import attrs
import torch

from llmrt.errors import ConfigError

TraceMode = Literal["none", "decode_only", "all"]
TRACE_MODES: tuple[str, ...] = ("none", "decode_only", "all")

#: Physical prefill batch sizes a padded wave may use (the spec's tile-friendly set).
PREFILL_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)

KV_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def _check(ok: bool, field: str, value: Any, reason: str) -> None:
    if not ok:
        raise ConfigError(field, value, reason)


def _positive_int(field: str, value: Any) -> None:
    _check(
        isinstance(value, int) and not isinstance(value, bool) and value > 0,
        field,
        value,
        "must be a positive integer",
    )


def is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@attrs.frozen(kw_only=True)
class TraceConfig:
    """Which operations replay captured traces: ``none``, ``decode_only`` or ``all``."""

    mode: str = "none"

    def __attrs_post_init__(self) -> None:
        _check(self.mode in TRACE_MODES, "trace.mode", self.mode, f"must be one of {TRACE_MODES}")

    @property
    def prefill_enabled(self) -> bool:
        return self.mode == "all"

    @property
    def decode_enabled(self) -> bool:
        return self.mode in ("decode_only", "all")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


@attrs.frozen(kw_only=True)
class WarmupConfig:
    """Geometry warmed (compiled, and captured when traced) before serving.

    ``prefill_seq_lens`` are padded prefill lengths; ``prefill_batch_sizes`` are the
    physical padded wave sizes warmed for the smallest sequence length (the spec's
    Q128 rule); other lengths use single-row coverage.
    """

    prefill_seq_lens: tuple[int, ...] = (128,)
    prefill_batch_sizes: tuple[int, ...] = (1,)
    include_decode_top_k: bool = False

    def __attrs_post_init__(self) -> None:
        _check(
            len(self.prefill_seq_lens) > 0,
            "warmup.prefill_seq_lens",
            self.prefill_seq_lens,
            "must name at least one length",
        )
        for i, n in enumerate(self.prefill_seq_lens):
            _positive_int(f"warmup.prefill_seq_lens[{i}]", n)
        _check(
            list(self.prefill_seq_lens) == sorted(set(self.prefill_seq_lens)),
            "warmup.prefill_seq_lens",
            self.prefill_seq_lens,
            "must be strictly increasing",
        )
        _check(
            len(self.prefill_batch_sizes) > 0,
            "warmup.prefill_batch_sizes",
            self.prefill_batch_sizes,
            "must name at least one batch size",
        )
        for i, b in enumerate(self.prefill_batch_sizes):
            _check(
                b in PREFILL_BATCH_SIZES,
                f"warmup.prefill_batch_sizes[{i}]",
                b,
                f"must be one of {PREFILL_BATCH_SIZES}",
            )


@attrs.frozen(kw_only=True)
class PagedKVCacheConfig:
    """Paged-KV policy. ``num_blocks`` is None until the physical capacity is resolved.

    ``huge_pages`` advises a CPU pool onto transparent huge pages: it then commits 2 MiB per
    layer's K or V at a time instead of 4 KiB (a short one-shot run holds ~120 MB more for
    SmolLM2, and pays ~0.1 s to fault them in), and a decode step's attention crosses fewer
    TLB entries (SmolLM2 at 1,024 tokens of context: 5.92 -> 5.57 ms per batch-1 step; no
    change at 128). Off by default: resident memory follows the tokens held."""

    block_size: int
    max_num_blocks: int
    num_blocks: int | None = None
    dtype: str = "float32"
    huge_pages: bool = False

    def __attrs_post_init__(self) -> None:
        _positive_int("kv_cache.block_size", self.block_size)
        _check(
            is_power_of_two(self.block_size),
            "kv_cache.block_size",
            self.block_size,
            "must be a power of two",
        )
        _positive_int("kv_cache.max_num_blocks", self.max_num_blocks)
        if self.num_blocks is not None:
            _positive_int("kv_cache.num_blocks", self.num_blocks)
            _check(
                self.num_blocks <= self.max_num_blocks,
                "kv_cache.num_blocks",
                self.num_blocks,
                f"must not exceed kv_cache.max_num_blocks={self.max_num_blocks}",
            )
        _check(
            self.dtype in KV_DTYPES,
            "kv_cache.dtype",
            self.dtype,
            f"must be one of {tuple(KV_DTYPES)}",
        )
        _check(
            isinstance(self.huge_pages, bool),
            "kv_cache.huge_pages",
            self.huge_pages,
            "must be true or false",
        )

    @property
    def is_resolved(self) -> bool:
        return self.num_blocks is not None

    @property
    def torch_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.dtype]

    @property
    def capacity_tokens(self) -> int:
        """Tokens the physical cache holds; requires a resolved ``num_blocks``."""
        if self.num_blocks is None:
            raise ConfigError("kv_cache.num_blocks", None, "is not resolved yet")
        return self.num_blocks * self.block_size

    @property
    def max_capacity_tokens(self) -> int:
        return self.max_num_blocks * self.block_size

    def with_num_blocks(self, num_blocks: int) -> PagedKVCacheConfig:
        """The late physical-capacity replacement: may only shrink, never grow."""
        _positive_int("kv_cache.num_blocks", num_blocks)
        ceiling = self.num_blocks if self.num_blocks is not None else self.max_num_blocks
        _check(
            num_blocks <= ceiling,
            "kv_cache.num_blocks",
            num_blocks,
            f"replacement may only shrink capacity (ceiling {ceiling} blocks)",
        )
        return attrs.evolve(self, num_blocks=num_blocks)

    def check_replacement(self, new: PagedKVCacheConfig) -> None:
        """Raise unless ``new`` keeps the block size and does not grow capacity."""
        _check(
            new.block_size == self.block_size,
            "kv_cache.block_size",
            new.block_size,
            f"replacement may not change the block size (was {self.block_size})",
        )
        _check(
            new.max_num_blocks <= self.max_num_blocks,
            "kv_cache.max_num_blocks",
            new.max_num_blocks,
            f"replacement may not grow capacity (ceiling {self.max_num_blocks})",
        )
        if self.num_blocks is not None and new.num_blocks is not None:
            _check(
                new.num_blocks <= self.num_blocks,
                "kv_cache.num_blocks",
                new.num_blocks,
                f"replacement may not grow capacity (was {self.num_blocks})",
            )


@attrs.frozen(kw_only=True)
class PageTableLayout:
    """Canonical page-table geometry shared by prefill and decode.

    ``width`` is the number of page-table columns every request carries: enough
    blocks for the longest sequence the model and the physical cache allow.
    ``chunk_width`` is the number of blocks one regular prefill chunk spans.
    ``requested_prefill_chunk_size`` is the chunk asked for, before the table's width
    narrowed it to ``max_prefill_chunk_size`` (None: not recorded).
    """

    block_size: int
    num_blocks: int
    model_max_sequence_length: int
    max_prefill_chunk_size: int
    max_sequence_length: int
    width: int
    chunk_width: int
    requested_prefill_chunk_size: int | None = None

    @classmethod
    def resolve(
        cls,
        *,
        block_size: int,
        model_max_sequence_length: int,
        physical_num_blocks: int,
        max_prefill_chunk_size: int,
    ) -> PageTableLayout:
        _positive_int("kv_cache.block_size", block_size)
        _check(
            is_power_of_two(block_size), "kv_cache.block_size", block_size, "must be a power of two"
        )
        _positive_int("model.max_sequence_length", model_max_sequence_length)
        _positive_int("kv_cache.num_blocks", physical_num_blocks)
        _positive_int("prefill.max_chunk_size", max_prefill_chunk_size)
        _check(
            max_prefill_chunk_size % block_size == 0,
            "prefill.max_chunk_size",
            max_prefill_chunk_size,
            f"must be a multiple of kv_cache.block_size={block_size}",
        )
        model_blocks = math.ceil(model_max_sequence_length / block_size)
        width = min(model_blocks, physical_num_blocks)
        max_len = min(model_max_sequence_length, width * block_size)
        return cls(
            block_size=block_size,
            num_blocks=physical_num_blocks,
            model_max_sequence_length=model_max_sequence_length,
            max_prefill_chunk_size=min(max_prefill_chunk_size, width * block_size),
            max_sequence_length=max_len,
            width=width,
            chunk_width=min(max_prefill_chunk_size, width * block_size) // block_size,
            requested_prefill_chunk_size=max_prefill_chunk_size,
        )

    def with_physical_blocks(self, num_blocks: int) -> PageTableLayout:
        """Shrink to a late-resolved physical block count; never grows."""
        _positive_int("kv_cache.num_blocks", num_blocks)
        _check(
            num_blocks <= self.num_blocks,
            "kv_cache.num_blocks",
            num_blocks,
            f"layout replacement may only shrink (ceiling {self.num_blocks} blocks)",
        )
        return PageTableLayout.resolve(
            block_size=self.block_size,
            model_max_sequence_length=self.model_max_sequence_length,
            physical_num_blocks=num_blocks,
            max_prefill_chunk_size=self.requested_prefill_chunk_size or self.max_prefill_chunk_size,
        )

    def check_replacement(self, new: PageTableLayout) -> None:
        """Raise unless ``new`` stays within this layout's ceilings with the same block size."""
        _check(
            new.block_size == self.block_size,
            "kv_cache.block_size",
            new.block_size,
            f"layout replacement may not change the block size (was {self.block_size})",
        )
        for name in ("num_blocks", "width", "max_sequence_length", "max_prefill_chunk_size"):
            old_v, new_v = getattr(self, name), getattr(new, name)
            _check(
                new_v <= old_v,
                f"page_table_layout.{name}",
                new_v,
                f"layout replacement may not grow geometry (ceiling {old_v})",
            )

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
