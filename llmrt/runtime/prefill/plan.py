"""Prefill planning: immutable ``PrefillRequest`` / ``PrefillChunk`` values for one lane.

Planning decides once, on the host, everything a prefill call executes: source-row
and slot mapping, active and padded batch sizes, actual and padded sequence lengths,
cached-token offsets, page tables, regular single / regular batched / chunked
execution, chunk slices and absolute positions, and which chunk holds the final
prompt token. The runtime consumes the plan and never re-derives these choices;
there is no separate cached-prefill or chunked-prefill path.

Rows are bucketed by padded new-token length (cached rows included), and the
spec's rules decide per bucket: one padded wave, or one request per row. Under the
spec's ``wave_rules`` a bucket holding any cached row, or more rows than the largest
allowed wave, runs sequentially as a whole, and cached rows are chunked requests.
``packed`` rules (torch backends, whose prefill takes a start offset per row) let
cached rows whose new tokens fit one chunk join waves like any other row, and split a
large bucket into several full waves: prompts sharing a cached prefix, or many short
prompts arriving together, are then prefilled a wave at a time instead of row by row.
``ragged`` rules (eager torch prefill, which packs a wave's real tokens and so pays
nothing for padding in its linears) put every row whose new tokens fit one chunk into
waves in source order, whatever its length: a wave is padded to its longest row.

Slots are lane-local: routing rows to lanes happens above, in the lane group.
Tensors in a plan are CPU tensors owned by the plan; treat them as read-only
(several values may share one storage).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple, TypeGuard, get_args

import attrs
import torch

from llmrt.errors import ConfigError, RequestError
from llmrt.runtime.config import PREFILL_BATCH_SIZES, PageTableLayout
from llmrt.runtime.prefill.buckets import FINE_DEFAULT_STEP, SeqLenBuckets

#: Diagnostic off switch for batched prefill ("1", "true" or "yes", any case).
DISABLE_BATCHED_PREFILL_ENV = "DISABLE_BATCHED_PREFILL"
_TRUTHY = frozenset({"1", "true", "yes"})

#: A wave with ``padded_batch * padded_seq`` at or above this many tokens runs sequentially.
BATCHED_PREFILL_TOKEN_LIMIT = 128 * 1024

#: Page-table entry that skips the KV write (padding rows, regular tails, chunk tails).
SKIP_BLOCK = -1

#: SDPA-safe filler after the allocated prefix in a chunked full-request table.
CHUNKED_TABLE_FILLER = 0

RequestKind = Literal["single", "batched", "chunked"]

#: ``spec``: the Common runtime's wave rules. ``packed``: cached rows join waves and a
#: bucket larger than the largest wave is split into full waves (see the module doc).
#: ``ragged``: ``packed``, and rows of any lengths within one chunk share a wave (for
#: models that run a wave's real tokens only: eager torch prefill, ``PackedTokens``).
WaveRules = Literal["spec", "packed", "ragged"]

#: Why a row was planned as its own request although its bucket held several rows.
SequentialReason = Literal[
    "unsupported",  # the model cannot run batched prefill
    "disabled",  # the recipe disabled batched prefill
    "env_disabled",  # DISABLE_BATCHED_PREFILL is set
    "max_batch_size",  # padded batch above the configured maximum (or above 32)
    "lane_capacity",  # padded batch above the lane's slot count
    "cached",  # some row in the bucket has a cached prefix
    "chunked",  # the padded sequence exceeds the regular chunk size
    "token_limit",  # padded_batch * padded_seq >= 128 * 1024
    "sampling",  # sampling params given; the model cannot extract batched outputs
    "wave_seq_len",  # padded sequence above the longest length warmed for padded waves
]


def _require(ok: bool, field: str, value: object, reason: str) -> None:
    if not ok:
        raise ConfigError(field, value, reason)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


@attrs.frozen(kw_only=True)
class PrefillPlanPolicy:
    """Static planning policy for one lane, validated once at construction.

    ``page_table_width`` and ``num_blocks`` come from the ``PageTableLayout``;
    ``max_batch_size`` is the configured maximum physical prefill batch (one of
    ``PREFILL_BATCH_SIZES``); ``lane_capacity`` is the lane's slot count, which
    also caps a wave; ``buckets.max_len`` must equal ``max_chunk_size``.
    """

    block_size: int
    page_table_width: int
    num_blocks: int
    max_sequence_length: int
    max_chunk_size: int
    batching_supported: bool
    batching_enabled: bool
    max_batch_size: int
    lane_capacity: int
    buckets: SeqLenBuckets
    model_extracts_batched_outputs: bool
    wave_batch_sizes: tuple[int, ...] = PREFILL_BATCH_SIZES
    """Physical sizes a padded wave may take (the warmed ones); a wave rounds up to the next."""
    max_wave_seq_len: int | None = None
    """Padded waves only at or below this padded length (the spec's Q128 rule); None: any."""
    wave_rules: WaveRules = "spec"
    """``packed``: cached rows join waves and large buckets split into several waves."""

    def __attrs_post_init__(self) -> None:
        for name in (
            "block_size",
            "page_table_width",
            "num_blocks",
            "max_sequence_length",
            "max_chunk_size",
            "lane_capacity",
        ):
            value = getattr(self, name)
            _require(
                _is_int(value) and value > 0,
                f"prefill_plan.{name}",
                value,
                "must be a positive integer",
            )
        _require(
            self.block_size & (self.block_size - 1) == 0,
            "prefill_plan.block_size",
            self.block_size,
            "must be a power of two",
        )
        _require(
            self.max_chunk_size % self.block_size == 0,
            "prefill_plan.max_chunk_size",
            self.max_chunk_size,
            f"must be a multiple of block_size={self.block_size}",
        )
        _require(
            self.max_batch_size in PREFILL_BATCH_SIZES and _is_int(self.max_batch_size),
            "prefill_plan.max_batch_size",
            self.max_batch_size,
            f"must be one of {PREFILL_BATCH_SIZES}",
        )
        for name in ("batching_supported", "batching_enabled", "model_extracts_batched_outputs"):
            value = getattr(self, name)
            _require(isinstance(value, bool), f"prefill_plan.{name}", value, "must be a bool")
        _require(
            self.wave_rules in get_args(WaveRules),
            "prefill_plan.wave_rules",
            self.wave_rules,
            f"must be one of {list(get_args(WaveRules))}",
        )
        _require(
            len(self.wave_batch_sizes) > 0
            and all(b in PREFILL_BATCH_SIZES for b in self.wave_batch_sizes)
            and list(self.wave_batch_sizes) == sorted(set(self.wave_batch_sizes)),
            "prefill_plan.wave_batch_sizes",
            self.wave_batch_sizes,
            f"must be increasing values from {PREFILL_BATCH_SIZES}",
        )
        if self.max_wave_seq_len is not None:
            _require(
                _is_int(self.max_wave_seq_len) and self.max_wave_seq_len > 0,
                "prefill_plan.max_wave_seq_len",
                self.max_wave_seq_len,
                "must be a positive integer or None",
            )
        _require(
            isinstance(self.buckets, SeqLenBuckets),
            "prefill_plan.buckets",
            self.buckets,
            "must be a SeqLenBuckets",
        )
        _require(
            self.buckets.max_len == self.max_chunk_size,
            "prefill_plan.buckets.max_len",
            self.buckets.max_len,
            f"must equal max_chunk_size={self.max_chunk_size}",
        )

    @classmethod
    def from_layout(
        cls,
        layout: PageTableLayout,
        *,
        batching_supported: bool,
        batching_enabled: bool,
        max_batch_size: int,
        lane_capacity: int,
        model_extracts_batched_outputs: bool,
        buckets: str | SeqLenBuckets = "tile",
        bucket_step: int = FINE_DEFAULT_STEP,
        wave_batch_sizes: tuple[int, ...] = PREFILL_BATCH_SIZES,
        max_wave_seq_len: int | None = None,
        wave_rules: WaveRules = "spec",
    ) -> PrefillPlanPolicy:
        """Policy over ``layout``'s geometry; ``buckets`` is a named default or a policy value."""
        if isinstance(buckets, str):
            buckets = SeqLenBuckets.named(
                buckets, max_len=layout.max_prefill_chunk_size, step=bucket_step
            )
        return cls(
            block_size=layout.block_size,
            page_table_width=layout.width,
            num_blocks=layout.num_blocks,
            max_sequence_length=layout.max_sequence_length,
            max_chunk_size=layout.max_prefill_chunk_size,
            batching_supported=batching_supported,
            batching_enabled=batching_enabled,
            max_batch_size=max_batch_size,
            lane_capacity=lane_capacity,
            buckets=buckets,
            model_extracts_batched_outputs=model_extracts_batched_outputs,
            wave_batch_sizes=wave_batch_sizes,
            max_wave_seq_len=max_wave_seq_len,
            wave_rules=wave_rules,
        )

    def wave_sizes_at(self, seq: int) -> tuple[int, ...]:
        """Wave sizes of two rows or more a bucket padded to ``seq`` may form (increasing)."""
        ceiling = min(self.max_batch_size, self.lane_capacity)
        return tuple(
            b
            for b in self.wave_batch_sizes
            if 1 < b <= ceiling and b * seq < BATCHED_PREFILL_TOKEN_LIMIT
        )

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt a request may carry (sequence limit and page-table capacity)."""
        return min(self.max_sequence_length, self.page_table_width * self.block_size)


@attrs.frozen(kw_only=True, eq=False)
class PrefillRow:
    """One prompt to prefill, as the caller hands it to the lane's planner.

    ``tokens`` is the full prompt including any cached prefix; ``cached_tokens`` of
    it are already in KV (a block multiple). ``block_ids`` are the request's
    allocated KV blocks in order and must cover the prompt. ``slot`` is lane-local.
    """

    source_row: int
    tokens: torch.Tensor
    cached_tokens: int = 0
    slot: int
    block_ids: tuple[int, ...]


@attrs.frozen(kw_only=True, eq=False)
class PrefillChunk:
    """One model step of a prefill request, in padded device geometry.

    ``token_start``/``token_end`` are absolute prompt positions of the step (for a
    batched wave: the smallest cached offset, 0 without cached rows, and the longest
    row's length, an envelope that may span more than ``padded_len`` when rows start at
    different offsets; per-row offsets and lengths are in ``start_positions``/``seq_lens``).
    ``page_table`` is the table the model uses for this step: the regular table, or a
    chunk's fill-only table (``-1`` after the chunk end).
    Padding rows have zero tokens, ``seq_lens`` 0, ``last_token_index`` 0 and
    an all ``-1`` page table.
    """

    index: int
    token_start: int
    token_end: int
    start_pos: int
    padded_len: int
    is_last: bool
    tokens: torch.Tensor
    start_positions: torch.Tensor
    seq_lens: torch.Tensor
    last_token_index: torch.Tensor
    page_table: torch.Tensor


@attrs.frozen(kw_only=True, eq=False)
class PrefillRequest:
    """One planned prefill execution: a single row, a padded batched wave, or chunks.

    ``single``: one uncached prompt within the chunk size, one step. ``batched``: a
    bucket of prompts (or, under ``packed`` wave rules, part of one, cached rows
    included) as one padded wave. ``chunked``: one cached or longer-than-chunk prompt
    as one or more chunk steps.

    Logical activity lives in the tuples (one entry per active row, in batch-row
    order); tensors use the padded geometry. ``page_table`` is the full-request
    table (chunked: allocated prefix then a nonnegative filler). ``last_token_rows``
    are the batch rows whose final-chunk outputs are results and
    ``last_token_indices`` their last-token index inside the final chunk.
    ``sequential_reason`` says why a multi-row bucket was split into single rows.
    """

    kind: RequestKind
    source_rows: tuple[int, ...]
    slots: tuple[int, ...]
    active_batch_size: int
    padded_batch_size: int
    seq_lens: tuple[int, ...]
    prompt_lens: tuple[int, ...]
    cached_tokens: tuple[int, ...]
    padded_seq_len: int
    page_table_width: int
    page_table: torch.Tensor
    chunks: tuple[PrefillChunk, ...]
    last_token_rows: tuple[int, ...]
    last_token_indices: tuple[int, ...]
    sequential_reason: SequentialReason | None = None

    @property
    def final_chunk(self) -> PrefillChunk:
        return self.chunks[-1]


class RowLocation(NamedTuple):
    """Where one source row's result comes from in a plan."""

    source_row: int
    request_index: int
    batch_row: int


@attrs.frozen(kw_only=True, eq=False)
class PrefillPlan:
    """Every request of one lane's prefill call, in execution order."""

    requests: tuple[PrefillRequest, ...]

    @property
    def num_rows(self) -> int:
        return sum(r.active_batch_size for r in self.requests)

    def source_order(self) -> tuple[RowLocation, ...]:
        """One location per active row, sorted by source row: restores the caller's order."""
        locations = [
            RowLocation(src, ri, bi)
            for ri, request in enumerate(self.requests)
            for bi, src in enumerate(request.source_rows)
        ]
        locations.sort()
        return tuple(locations)


class _Row(NamedTuple):
    source_row: int
    tokens: torch.Tensor  # CPU int64, full prompt
    prompt_len: int
    cached: int
    slot: int
    blocks: tuple[int, ...]  # the allocated prefix that covers the prompt


def plan_prefill(
    *,
    rows: Sequence[PrefillRow],
    policy: PrefillPlanPolicy,
    sampling_params_given: bool = False,
    env: Mapping[str, str] = os.environ,
) -> PrefillPlan:
    """Validate ``rows`` and plan them into padded waves, single rows and chunked requests.

    Every row is validated before anything is built (``RequestError`` naming the
    source row and field). Rows are bucketed by padded new-token length; an
    eligible bucket becomes one wave (under ``packed`` rules, a bucket larger than the
    largest wave becomes several) padded to the next size in ``wave_batch_sizes``; any
    other bucket becomes one request per row. Requests come in increasing bucket
    length, rows in increasing source row. Under ``ragged`` rules the waves take rows of
    any lengths within one chunk, in source order (``_ragged_groups``).
    """
    valid = _validated(rows, policy)
    global_reason = _global_sequential_reason(policy, sampling_params_given, env)
    buckets: dict[int, list[_Row]] = {}
    for row in valid:
        buckets.setdefault(_bucket_len(row, policy), []).append(row)

    requests: list[PrefillRequest] = []
    if policy.wave_rules == "ragged" and global_reason is None:
        groups = _ragged_groups(valid, buckets=buckets, policy=policy)
    else:
        groups = [
            (seq, group)
            for seq in sorted(buckets)
            for group in _wave_groups(
                sorted(buckets[seq], key=lambda r: r.source_row),
                seq=seq,
                policy=policy,
                split=global_reason is None,
            )
        ]
    for seq, members in groups:
        if len(members) == 1:
            requests.extend(_sequential(members, seq=seq, policy=policy, reason=None))
            continue
        batch = padded_batch_size(len(members), sizes=policy.wave_batch_sizes)
        reason = global_reason or _bucket_sequential_reason(
            members, batch=batch, seq=seq, policy=policy
        )
        if reason is None and batch is not None:
            stack = _regular_stack(members, rows=batch, seq=seq, policy=policy)
            requests.append(
                _regular_request(
                    members, stack, kind="batched", seq=seq, policy=policy, reason=None
                )
            )
        else:
            requests.extend(_sequential(members, seq=seq, policy=policy, reason=reason))
    return PrefillPlan(requests=tuple(requests))


def _wave_groups(
    members: list[_Row], *, seq: int, policy: PrefillPlanPolicy, split: bool
) -> list[list[_Row]]:
    """A bucket as planned together: whole, or (``packed`` rules) in full waves.

    Packed rules split a bucket with more rows than the largest allowed wave into waves of
    that size (the last one may be smaller); with no wave of two rows or more allowed, the
    bucket stays whole and falls back row by row for the spec's reason.
    """
    if not split or policy.wave_rules == "spec":
        return [members]
    sizes = policy.wave_sizes_at(seq)
    if not sizes or len(members) <= sizes[-1]:
        return [members]
    size = sizes[-1]
    return [members[i : i + size] for i in range(0, len(members), size)]


def _ragged_groups(
    rows: list[_Row], *, buckets: Mapping[int, list[_Row]], policy: PrefillPlanPolicy
) -> list[tuple[int, list[_Row]]]:
    """``ragged`` rules: rows whose new tokens fit one chunk, in source order, as waves of the
    largest allowed size, each padded to its longest row; then each longer row on its own."""
    size = policy.max_chunk_size
    fits = sorted((r for r in rows if r.prompt_len - r.cached <= size), key=lambda r: r.source_row)
    sizes = policy.wave_sizes_at(size)
    wave = sizes[-1] if sizes else 1
    groups = [
        (max(_bucket_len(r, policy) for r in members), members)
        for members in (fits[i : i + wave] for i in range(0, len(fits), wave))
    ]
    groups.extend(
        (seq, [r])
        for seq in sorted(buckets)
        if seq > size
        for r in sorted(buckets[seq], key=lambda r: r.source_row)
    )
    return groups


def padded_batch_size(active: int, *, sizes: Sequence[int] = PREFILL_BATCH_SIZES) -> int | None:
    """Smallest physical prefill batch in ``sizes`` holding ``active`` rows."""
    for size in sizes:
        if size >= active:
            return size
    return None


def batched_prefill_disabled(env: Mapping[str, str]) -> bool:
    """Whether the ``DISABLE_BATCHED_PREFILL`` diagnostic switch is set in ``env``."""
    return env.get(DISABLE_BATCHED_PREFILL_ENV, "").strip().lower() in _TRUTHY


def _global_sequential_reason(
    policy: PrefillPlanPolicy, sampling_params_given: bool, env: Mapping[str, str]
) -> SequentialReason | None:
    if not policy.batching_supported:
        return "unsupported"
    if not policy.batching_enabled:
        return "disabled"
    if batched_prefill_disabled(env):
        return "env_disabled"
    if sampling_params_given and not policy.model_extracts_batched_outputs:
        return "sampling"
    return None


def _bucket_sequential_reason(
    members: Sequence[_Row], *, batch: int | None, seq: int, policy: PrefillPlanPolicy
) -> SequentialReason | None:
    if batch is None or batch > policy.max_batch_size:
        return "max_batch_size"
    if batch > policy.lane_capacity:
        return "lane_capacity"
    if policy.wave_rules == "spec" and any(r.cached for r in members):
        return "cached"
    if seq > policy.max_chunk_size:
        return "chunked"
    if batch * seq >= BATCHED_PREFILL_TOKEN_LIMIT:
        return "token_limit"
    if policy.max_wave_seq_len is not None and seq > policy.max_wave_seq_len:
        return "wave_seq_len"
    return None


def _bucket_len(row: _Row, policy: PrefillPlanPolicy) -> int:
    """Padded new-token length; beyond the chunk size, the chunk-multiple it spans."""
    new = row.prompt_len - row.cached
    if new <= policy.max_chunk_size:
        return policy.buckets.pad(new)
    return -(-new // policy.max_chunk_size) * policy.max_chunk_size


# --- validation -------------------------------------------------------------------------


def _validated(rows: Sequence[PrefillRow], policy: PrefillPlanPolicy) -> list[_Row]:
    bs = policy.block_size
    max_prompt = policy.max_prompt_tokens
    sources: set[int] = set()
    slot_owner: dict[int, int] = {}
    used_blocks: set[int] = set()
    written_blocks: set[int] = set()
    out: list[_Row] = []
    for position, row in enumerate(rows):
        if not isinstance(row, PrefillRow):
            raise RequestError("rows", "every row must be a PrefillRow", value=type(row).__name__)
        src = row.source_row
        if not _is_int(src) or src < 0:
            raise RequestError(
                "source_row",
                "must be a non-negative integer",
                row=src if _is_int(src) else None,
                value=src,
            )
        if src in sources:
            raise RequestError(
                "source_row", "appears more than once in this call", row=src, value=src
            )
        sources.add(src)

        tokens = row.tokens
        if (
            not isinstance(tokens, torch.Tensor)
            or tokens.dim() != 1
            or tokens.dtype.is_floating_point
            or tokens.dtype.is_complex
            or tokens.dtype == torch.bool
        ):
            raise RequestError(
                "tokens", "must be a 1-D integer tensor", row=src, value=_describe(tokens)
            )
        n = int(tokens.numel())
        if n == 0:
            raise RequestError("tokens", "prompt must not be empty", row=src, value=0)
        if n > policy.max_sequence_length:
            raise RequestError(
                "tokens",
                f"prompt is longer than max_sequence_length={policy.max_sequence_length}",
                row=src,
                value=n,
            )
        if n > max_prompt:
            raise RequestError(
                "tokens",
                f"prompt is longer than the page table holds "
                f"({policy.page_table_width} blocks of {bs})",
                row=src,
                value=n,
            )

        cached = row.cached_tokens
        if not _is_int(cached) or cached < 0:
            raise RequestError(
                "cached_tokens", "must be a non-negative integer", row=src, value=cached
            )
        if cached % bs:
            raise RequestError(
                "cached_tokens", f"must be a multiple of block_size={bs}", row=src, value=cached
            )
        if cached >= n:
            raise RequestError(
                "cached_tokens", f"must be less than the prompt length {n}", row=src, value=cached
            )

        slot = row.slot
        if not _is_int(slot) or not 0 <= slot < policy.lane_capacity:
            raise RequestError(
                "slot", f"must be an integer in [0, {policy.lane_capacity})", row=src, value=slot
            )
        if slot in slot_owner:
            raise RequestError(
                "slot", f"is already used by row {slot_owner[slot]}", row=src, value=slot
            )
        slot_owner[slot] = src

        ids = row.block_ids
        if not isinstance(ids, (tuple, list)):
            raise RequestError(
                "block_ids", "must be a tuple of block ids", row=src, value=type(ids).__name__
            )
        need = -(-n // bs)
        if len(ids) < need:
            raise RequestError(
                "block_ids",
                f"too few blocks for {n} tokens (needs {need})",
                row=src,
                value=len(ids),
            )
        unique = set(ids)
        # Rows may share cached prefix blocks (prefix-cache hits): those are only read. A
        # block this row writes must belong to no other row, and a block it only reads
        # must not be written by another row of the call.
        read_only = set(ids[: cached // bs])
        written = unique - read_only
        if (
            not set(map(type, ids)) <= {int}
            or len(unique) != len(ids)
            or min(ids) < 0
            or max(ids) >= policy.num_blocks
            or not written_blocks.isdisjoint(unique)
            or not used_blocks.isdisjoint(written)
        ):
            raise _block_error(ids, row=src, cached=cached, earlier=rows[:position], policy=policy)
        used_blocks |= unique
        written_blocks |= written
        out.append(
            _Row(
                src, tokens.to(device="cpu", dtype=torch.int64), n, cached, slot, tuple(ids[:need])
            )
        )
    return out


def _block_error(
    ids: Sequence[object],
    *,
    row: int,
    cached: int,
    earlier: Sequence[PrefillRow],
    policy: PrefillPlanPolicy,
) -> RequestError:
    """The first bad block id of ``ids`` (slow path, only once a check has failed)."""
    bs = policy.block_size
    writer = {b: r.source_row for r in earlier for b in r.block_ids[r.cached_tokens // bs :]}
    reader = {b: r.source_row for r in earlier for b in r.block_ids[: r.cached_tokens // bs]}
    mine_read_only = set(ids[: cached // bs])
    owner = {**{b: r for b, r in reader.items() if b not in mine_read_only}, **writer}
    seen: set[object] = set()
    for b in ids:
        if not _is_int(b) or not 0 <= b < policy.num_blocks:
            reason = f"block id must be an integer in [0, {policy.num_blocks})"
            return RequestError("block_ids", reason, row=row, value=b)
        if b in seen:
            return RequestError("block_ids", "duplicate block id within the row", row=row, value=b)
        if b in owner:
            reason = f"duplicate block id (also allocated to row {owner[b]})"
            return RequestError("block_ids", reason, row=row, value=b)
        seen.add(b)
    return RequestError("block_ids", "invalid block ids", row=row, value=tuple(ids))


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    return type(value).__name__


# --- construction -----------------------------------------------------------------------


class _Stack(NamedTuple):
    tokens: torch.Tensor
    start_positions: torch.Tensor
    seq_lens: torch.Tensor
    last_token_index: torch.Tensor
    page_table: torch.Tensor


def _regular_stack(
    members: Sequence[_Row], *, rows: int, seq: int, policy: PrefillPlanPolicy
) -> _Stack:
    """New tokens of each prompt in rows ``0..len(members)-1`` of ``rows``; the rest stay inert.

    A cached row holds the tokens after its cached prefix and starts at that offset; its
    page table maps the whole prompt (the prefix blocks are only read).
    """
    n = len(members)
    width = policy.page_table_width
    cached = torch.tensor([m.cached for m in members], dtype=torch.int64)
    lens = torch.tensor([m.prompt_len for m in members], dtype=torch.int64) - cached
    nblocks = torch.tensor([len(m.blocks) for m in members], dtype=torch.int64)

    tokens = torch.zeros((rows, seq), dtype=torch.int64)
    token_mask = torch.arange(seq) < lens[:, None]
    new = [m.tokens[m.cached :] if m.cached else m.tokens for m in members]
    tokens[:n].masked_scatter_(token_mask, torch.cat(new))

    table = torch.full((rows, width), SKIP_BLOCK, dtype=torch.int32)
    flat_blocks = [b for m in members for b in m.blocks]
    table_mask = torch.arange(width) < nblocks[:, None]
    table[:n].masked_scatter_(table_mask, torch.tensor(flat_blocks, dtype=torch.int32))

    seq_lens = torch.zeros(rows, dtype=torch.int32)
    seq_lens[:n] = lens
    last = torch.zeros(rows, dtype=torch.int64)
    last[:n] = lens - 1
    starts = torch.zeros(rows, dtype=torch.int32)
    starts[:n] = cached
    return _Stack(tokens, starts, seq_lens, last, table)


def _regular_request(
    members: Sequence[_Row],
    stack: _Stack,
    *,
    kind: RequestKind,
    seq: int,
    policy: PrefillPlanPolicy,
    reason: SequentialReason | None,
) -> PrefillRequest:
    lens = tuple(m.prompt_len for m in members)
    cached = tuple(m.cached for m in members)
    new = tuple(n - c for n, c in zip(lens, cached, strict=True))
    chunk = PrefillChunk(
        index=0,
        token_start=min(cached),
        token_end=max(lens),
        start_pos=min(cached),
        padded_len=seq,
        is_last=True,
        tokens=stack.tokens,
        start_positions=stack.start_positions,
        seq_lens=stack.seq_lens,
        last_token_index=stack.last_token_index,
        page_table=stack.page_table,
    )
    return PrefillRequest(
        kind=kind,
        source_rows=tuple(m.source_row for m in members),
        slots=tuple(m.slot for m in members),
        active_batch_size=len(members),
        padded_batch_size=int(stack.tokens.shape[0]),
        seq_lens=new,
        prompt_lens=lens,
        cached_tokens=cached,
        padded_seq_len=seq,
        page_table_width=policy.page_table_width,
        page_table=stack.page_table,
        chunks=(chunk,),
        last_token_rows=tuple(range(len(members))),
        last_token_indices=tuple(n - 1 for n in new),
        sequential_reason=reason,
    )


def _sequential(
    members: Sequence[_Row],
    *,
    seq: int,
    policy: PrefillPlanPolicy,
    reason: SequentialReason | None,
) -> list[PrefillRequest]:
    """One request per row, built in bulk: each request holds row views of shared tensors."""
    size = policy.max_chunk_size
    regular = [m for m in members if m.cached == 0 and m.prompt_len <= size]
    chunked = [m for m in members if m.cached > 0 or m.prompt_len > size]
    planned: dict[int, PrefillRequest] = {}
    if regular:
        stack = _regular_stack(regular, rows=len(regular), seq=seq, policy=policy)
        views = zip(*(t.split(1) for t in stack), strict=True)
        for m, view in zip(regular, views, strict=True):
            planned[m.source_row] = _regular_request(
                (m,), _Stack(*view), kind="single", seq=seq, policy=policy, reason=reason
            )
    if chunked:
        planned.update(_chunked_requests(chunked, policy=policy, reason=reason))
    return [planned[m.source_row] for m in members]


def _chunked_requests(
    rows: Sequence[_Row], *, policy: PrefillPlanPolicy, reason: SequentialReason | None
) -> dict[int, PrefillRequest]:
    """Cached or long prompts as chunks of at most ``max_chunk_size`` new tokens each.

    The first chunk starts at the cached offset and later ones at ``max_chunk_size``
    steps from it. The full-request table maps the allocated prefix and then the
    nonnegative filler; each chunk's fill-only table maps blocks up to the chunk end
    and ``-1`` after. All chunks of all ``rows`` are built as one stack and split.
    """
    size, bs, width = policy.max_chunk_size, policy.block_size, policy.page_table_width
    spans: list[list[tuple[int, int]]] = []
    chunk_row: list[int] = []
    lens: list[int] = []
    limits: list[int] = []
    for r, row in enumerate(rows):
        row_spans = [
            (s, min(s + size, row.prompt_len)) for s in range(row.cached, row.prompt_len, size)
        ]
        spans.append(row_spans)
        for start, end in row_spans:
            chunk_row.append(r)
            lens.append(end - start)
            limits.append(-(-end // bs))

    columns = torch.arange(width)
    full = torch.full((len(rows), width), CHUNKED_TABLE_FILLER, dtype=torch.int32)
    nblocks = torch.tensor([len(row.blocks) for row in rows])
    full.masked_scatter_(
        columns < nblocks[:, None],
        torch.tensor([b for row in rows for b in row.blocks], dtype=torch.int32),
    )
    tables = torch.where(
        columns < torch.tensor(limits)[:, None],
        full[torch.tensor(chunk_row)],
        torch.tensor(SKIP_BLOCK, dtype=torch.int32),
    )
    lens_t = torch.tensor(lens)
    tokens = torch.zeros((len(lens), size), dtype=torch.int64)
    tokens.masked_scatter_(
        torch.arange(size) < lens_t[:, None],
        torch.cat([row.tokens[row.cached :] if row.cached else row.tokens for row in rows]),
    )
    starts = torch.tensor([s for row_spans in spans for s, _ in row_spans], dtype=torch.int32)
    chunk_views = zip(
        tokens.split(1),
        starts.split(1),
        lens_t.to(torch.int32).split(1),
        (lens_t - 1).split(1),
        tables.split(1),
        strict=True,
    )

    out: dict[int, PrefillRequest] = {}
    for row, row_spans, full_view in zip(rows, spans, full.split(1), strict=True):
        chunks = []
        last = len(row_spans) - 1
        for i, (start, end) in enumerate(row_spans):
            tok, start_v, len_v, last_v, table_v = next(chunk_views)
            padded = policy.buckets.pad(end - start)
            chunks.append(
                PrefillChunk(
                    index=i,
                    token_start=start,
                    token_end=end,
                    start_pos=start,
                    padded_len=padded,
                    is_last=i == last,
                    tokens=tok if padded == size else tok[:, :padded],
                    start_positions=start_v,
                    seq_lens=len_v,
                    last_token_index=last_v,
                    page_table=table_v,
                )
            )
        out[row.source_row] = PrefillRequest(
            kind="chunked",
            source_rows=(row.source_row,),
            slots=(row.slot,),
            active_batch_size=1,
            padded_batch_size=1,
            seq_lens=(row.prompt_len - row.cached,),
            prompt_lens=(row.prompt_len,),
            cached_tokens=(row.cached,),
            padded_seq_len=max(c.padded_len for c in chunks),
            page_table_width=width,
            page_table=full_view,
            chunks=tuple(chunks),
            last_token_rows=(0,),
            last_token_indices=(row_spans[-1][1] - row_spans[-1][0] - 1,),
            sequential_reason=reason,
        )
    return out
