"""Attention over a paged KV cache, in plain torch ops.

A layer's cache is ``[num_blocks, num_kv_heads, block_size, head_dim]`` (stored
token-major where the model asks for it); a row's
page table maps logical block ``pos // block_size`` to a physical block (``-1`` =
none). A *plan* (built once per forward, shared by every layer) resolves where each
token's K/V is written and which pages each row reads, so the per-layer work is a
scatter, a gather and one ``scaled_dot_product_attention`` call with GQA
(``enable_gqa=True``, K/V never repeated).

Host syncs (``.tolist()``/``.item()``) are only used to pick fast paths and trim
the page table; they are skipped while a CUDA graph is being captured or while
``torch.compile`` traces the step, where every shape depends only on the input shapes.
Plans are ``NamedTuple``s, not attrs classes: Dynamo traces their construction
without a graph break (attrs' frozen ``__init__`` is opaque to it).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from llmrt.families.prefill_attention import (
    native_causal_attention,
    native_usable,
    native_varlen_attention,
)

__all__ = [
    "TOKEN_MAJOR",
    "DecodePlan",
    "PackedTokens",
    "PagedReads",
    "PrefillPlan",
    "WritePlan",
    "attend",
    "gather_context",
    "host_sync_allowed",
    "plan_decode",
    "plan_prefill",
    "plan_writes",
    "write_kv",
]


#: K/V storage order ``[num_blocks, block_size, heads, head_dim]`` behind the logical
#: ``[num_blocks, heads, block_size, head_dim]`` shape (see ``AttentionMetadata.kv_dim_order``).
TOKEN_MAJOR: tuple[int, int, int, int] = (0, 2, 1, 3)


def host_sync_allowed(device: torch.device) -> bool:
    """False while a CUDA graph is captured on ``device`` or Dynamo traces (no host reads)."""
    if torch.compiler.is_compiling():
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


class WritePlan(NamedTuple):
    """Destination slot of each flattened token ``[T]`` and the token whose K/V lands there.

    Tokens that must not write (padding, ``-1`` page entry, outside the page table)
    are redirected onto the first real write with that write's value, so the
    scatter has a static shape and every duplicate index stores identical bytes.
    ``any_write`` is a 0-d bool tensor; ``any_write_host`` is its host value when a
    sync was allowed, else None.
    """

    block: torch.Tensor
    offset: torch.Tensor
    source: torch.Tensor
    any_write: torch.Tensor
    any_write_host: bool | None


def plan_writes(
    *,
    page_table: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    allow_sync: bool,
) -> WritePlan:
    """Resolve ``positions``/``valid`` ``[B, S]`` of each row through ``page_table`` ``[B, W]``."""
    rows, width = page_table.shape
    pos = positions.reshape(rows, -1).long()
    column = torch.div(pos, block_size, rounding_mode="floor")
    inside = valid.reshape(rows, -1) & (pos >= 0) & (column < width)
    block = page_table.long().gather(1, column.clamp(0, max(width - 1, 0)))
    keep = (inside & (block >= 0)).flatten()
    block = block.clamp(min=0).flatten()
    offset = torch.remainder(pos, block_size).flatten()
    count = keep.numel()
    if count == 0:
        none = torch.zeros((), dtype=torch.bool, device=keep.device)
        return WritePlan(
            block=block, offset=offset, source=block, any_write=none, any_write_host=False
        )
    first = keep.to(torch.int32).argmax().reshape(1)  # a tensor index: no host read
    any_write = keep.any()
    index = torch.arange(count, device=keep.device)
    source = torch.where(keep, index, first)
    fallback_block = torch.where(any_write, block.index_select(0, first), 0)
    fallback_offset = torch.where(any_write, offset.index_select(0, first), 0)
    return WritePlan(
        block=torch.where(keep, block, fallback_block),
        offset=torch.where(keep, offset, fallback_offset),
        source=source,
        any_write=any_write,
        any_write_host=bool(any_write.item()) if allow_sync else None,
    )


def write_kv(*, cache: torch.Tensor, new: torch.Tensor, plan: WritePlan) -> None:
    """Scatter ``new`` ``[..., H, D]`` (one entry per planned token) into ``cache`` in place."""
    if plan.any_write_host is False:
        return
    heads, dim = new.shape[-2:]
    values = new.reshape(-1, heads, dim).index_select(0, plan.source).to(cache.dtype)
    if plan.any_write_host is None:
        current = cache[plan.block, :, plan.offset]
        values = torch.where(plan.any_write, values, current)
    cache[plan.block, :, plan.offset] = values


def gather_context(*, cache: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """Read the pages of each row: ``[B, nb]`` table -> ``[B, H, nb * block_size, D]``.

    A ``-1`` entry reads block 0 (finite garbage the attention mask hides). A token-major
    cache (``TOKEN_MAJOR`` storage) is read with one gather and returned as a strided view;
    a row-major one needs a second, transposing copy.
    """
    rows, blocks = page_table.shape
    _, heads, block_size, dim = cache.shape
    table = page_table.clamp(min=0).flatten()
    tokens_outer = cache.transpose(1, 2)
    if tokens_outer.is_contiguous():
        pages = tokens_outer.index_select(0, table)
        return pages.view(rows, blocks * block_size, heads, dim).transpose(1, 2)
    pages = cache.index_select(0, table).view(rows, blocks, heads, block_size, dim)
    return pages.transpose(1, 2).reshape(rows, heads, blocks * block_size, dim)


class PagedReads(NamedTuple):
    """The pages some rows read back (``table`` ``[R, nb]``) and their key mask ``[R, 1, S, L]``."""

    table: torch.Tensor
    mask: torch.Tensor


class PackedTokens(NamedTuple):
    """A padded prefill's real tokens packed back to back: ``[B, S]`` -> ``[1, T]``.

    Why: rows of a wave differ in length, and every per-token op (the linears above all)
    costs the same on a padding token as on a real one; packed, a wave of prompts of 16 to
    512 tokens multiplies only its real tokens, in one GEMM per linear. Attention takes the
    rows apart again (``varlen_causal_attention``, or the padded path for what it does not
    cover).

    ``flat_index`` ``[T]``: each real token's place in the flattened ``[B * S]`` rows (row-major);
    ``starts`` (CPU int64 ``[B + 1]``): where each row's tokens begin in the packed order;
    ``offsets``/``lens``: each row's first position (its cached prefix) and token count;
    ``writes``: the KV write plan per packed token; ``page_table``: the rows' ``[B, W]`` table.
    """

    flat_index: torch.Tensor
    starts: torch.Tensor
    offsets: tuple[int, ...]
    lens: tuple[int, ...]
    rows: int
    length: int
    writes: WritePlan
    page_table: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.flat_index.numel())

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S, ...]`` -> ``[1, T, ...]`` (the real tokens, in order)."""
        return x.flatten(0, 1).index_select(0, self.flat_index).unsqueeze(0)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, T, ...]`` -> ``[B, S, ...]`` with zeros at the padding."""
        flat = x.new_zeros((self.rows * self.length, *x.shape[2:]))
        flat.index_copy_(0, self.flat_index, x[0])
        return flat.view(self.rows, self.length, *x.shape[2:])

    def last_tokens(self, last_token_index: torch.Tensor) -> torch.Tensor:
        """Packed index of each row's ``last_token_index`` token, kept inside the row's own
        tokens as the padded path keeps it inside its row (a padding row reads token 0 of
        the next row or the last one: its logits are never used)."""
        device = self.flat_index.device
        last = last_token_index.to(device=device, dtype=torch.long)
        first = self.starts[:-1].to(device)
        lens = (self.starts[1:] - self.starts[:-1]).to(device)
        inside = torch.minimum(last.clamp(min=0), (lens - 1).clamp(min=0))
        return (first + inside).clamp(0, max(self.tokens - 1, 0))


class PrefillPlan(NamedTuple):
    """Per-forward prefill routing shared by every layer.

    ``cached is None``: every row starts at position 0 and attends causally to the
    chunk itself (no page reads). ``split is None``: every row reads its context
    back through the page table (``cached``). Otherwise ``split`` holds the row
    indices of the fresh and of the cached group, and ``cached`` covers the
    cached group only. ``packed``: the layers run on the real tokens only
    (``PackedTokens``; hidden states ``[1, T, hidden]``), else on the padded rows.
    """

    writes: WritePlan
    positions: torch.Tensor
    cached: PagedReads | None
    split: tuple[torch.Tensor, torch.Tensor] | None
    packed: PackedTokens | None = None

    @property
    def mode(self) -> Literal["fresh", "cached", "split"]:
        """Which attention path the layers take (for tests and logs)."""
        if self.cached is None:
            return "fresh"
        return "cached" if self.split is None else "split"


class DecodePlan(NamedTuple):
    """Per-forward decode routing: the (possibly trimmed) page table and key mask."""

    writes: WritePlan
    positions: torch.Tensor
    reads: PagedReads


def plan_prefill(
    *,
    start_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    block_size: int,
    chunk_len: int,
    allow_sync: bool | None = None,
    pack: bool = False,
) -> PrefillPlan:
    """Plan a prefill chunk of ``chunk_len`` padded tokens per row (see ``PrefillPlan``);
    ``pack``: pack the real tokens where host reads are allowed (``PackedTokens``)."""
    device = page_table.device
    sync = host_sync_allowed(device) if allow_sync is None else allow_sync
    rows, width = page_table.shape
    steps = torch.arange(chunk_len, device=device)
    start = start_pos.to(device=device, dtype=torch.long)
    positions = start[:, None] + steps[None, :]
    valid = steps[None, :] < seq_lens.to(device=device, dtype=torch.long)[:, None]
    writes = plan_writes(
        page_table=page_table,
        positions=positions,
        valid=valid,
        block_size=block_size,
        allow_sync=sync,
    )
    positions = positions.clamp(min=0)
    if not sync:
        reads = PagedReads(
            table=page_table, mask=_causal_mask(positions=positions, length=width * block_size)
        )
        return PrefillPlan(writes=writes, positions=positions, cached=reads, split=None)
    starts = start_pos.tolist()
    ends = (start_pos.long() + seq_lens.long()).tolist()
    cached = [row for row in range(rows) if starts[row] != 0]
    packed = (
        _packed(valid=valid, starts=starts, ends=ends, writes=writes, page_table=page_table)
        if pack and any(e > s for s, e in zip(starts, ends, strict=True))
        else None  # nothing to pack: padding rows only
    )
    if not cached:
        return PrefillPlan(
            writes=writes, positions=positions, cached=None, split=None, packed=packed
        )
    blocks = max(-(-max(ends[row], starts[row] + 1) // block_size) for row in cached)
    blocks = max(1, min(width, blocks))
    if len(cached) == rows:
        reads = PagedReads(
            table=page_table[:, :blocks],
            mask=_causal_mask(positions=positions, length=blocks * block_size),
        )
        return PrefillPlan(
            writes=writes, positions=positions, cached=reads, split=None, packed=packed
        )
    fresh = [row for row in range(rows) if starts[row] == 0]
    fresh_rows = torch.tensor(fresh, dtype=torch.long, device=device)
    cached_rows = torch.tensor(cached, dtype=torch.long, device=device)
    reads = PagedReads(
        table=page_table.index_select(0, cached_rows)[:, :blocks],
        mask=_causal_mask(
            positions=positions.index_select(0, cached_rows), length=blocks * block_size
        ),
    )
    return PrefillPlan(
        writes=writes,
        positions=positions,
        cached=reads,
        split=(fresh_rows, cached_rows),
        packed=packed,
    )


def _packed(
    *,
    valid: torch.Tensor,
    starts: list[int],
    ends: list[int],
    writes: WritePlan,
    page_table: torch.Tensor,
) -> PackedTokens:
    """The real tokens of ``valid`` ``[B, S]`` and their share of ``writes``."""
    rows, length = valid.shape
    flat_valid = valid.flatten()
    index = flat_valid.nonzero().flatten()
    lens = [max(0, min(e - s, length)) for s, e in zip(starts, ends, strict=True)]
    bounds = torch.tensor([0, *lens], dtype=torch.long).cumsum(0)
    # Each padded slot's packed position (padding: 0, never read for a kept write).
    packed_of = torch.zeros(rows * length, dtype=torch.long, device=index.device)
    packed_of[index] = torch.arange(index.numel(), device=index.device)
    token_writes = WritePlan(
        block=writes.block.index_select(0, index),
        offset=writes.offset.index_select(0, index),
        source=packed_of.index_select(0, writes.source.index_select(0, index)),
        any_write=writes.any_write,
        any_write_host=writes.any_write_host,
    )
    return PackedTokens(
        flat_index=index,
        starts=bounds,
        offsets=tuple(starts),
        lens=tuple(lens),
        rows=rows,
        length=length,
        writes=token_writes,
        page_table=page_table,
    )


def plan_decode(
    *,
    positions: torch.Tensor,
    page_table: torch.Tensor,
    block_size: int,
    allow_sync: bool | None = None,
) -> DecodePlan:
    """Plan one decode token per row at ``positions`` ``[B]``.

    On CPU the page table is trimmed to the blocks in use; elsewhere its width is
    kept so the step's shapes are static (CUDA-graph friendly).
    """
    device = page_table.device
    sync = host_sync_allowed(device) if allow_sync is None else allow_sync
    rows, width = page_table.shape
    pos = positions.to(device=device, dtype=torch.long)
    writes = plan_writes(
        page_table=page_table,
        positions=pos[:, None],
        valid=torch.ones((rows, 1), dtype=torch.bool, device=device),
        block_size=block_size,
        allow_sync=sync,
    )
    pos = pos.clamp(min=0)
    table = page_table
    if sync and device.type == "cpu" and rows > 0:
        blocks = max(1, min(width, int(pos.max().item()) // block_size + 1))
        table = page_table[:, :blocks]
    mask = _causal_mask(positions=pos[:, None], length=table.shape[1] * block_size)
    return DecodePlan(writes=writes, positions=pos, reads=PagedReads(table=table, mask=mask))


def attend(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan | DecodePlan,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    native_causal: bool = False,
) -> torch.Tensor:
    """Write this step's K/V into the pages, then attend.

    ``q`` ``[B, S, Hq, D]``, ``k``/``v`` ``[B, S, Hkv, D]`` (S = 1 for decode);
    returns ``[B, S, Hq * D]`` in ``q``'s dtype. ``window`` limits each query to the
    ``window`` most recent positions (itself included), as transformers' sliding-window
    mask does; ``softcap`` bounds the scores by ``softcap * tanh(score / softcap)``.
    ``native_causal`` runs attention among the step's own tokens with llmrt's C++ kernel
    where the call allows it (``prefill_attention``), else torch's SDPA.
    """
    if isinstance(plan, PrefillPlan) and plan.packed is not None:
        return _attend_packed(
            q, k, v, k_cache, v_cache, plan, plan.packed, scale, window, softcap, native_causal
        )
    write_kv(cache=k_cache, new=k, plan=plan.writes)
    write_kv(cache=v_cache, new=v, plan=plan.writes)
    return _attend_written(q, k, v, k_cache, v_cache, plan, scale, window, softcap, native_causal)


def _attend_written(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan | DecodePlan,
    scale: float,
    window: int | None,
    softcap: float | None,
    native_causal: bool,
) -> torch.Tensor:
    """``attend`` over padded rows once this step's K/V are in the pages."""
    query = q.transpose(1, 2)
    if window is not None or softcap is not None:
        out = _attend_masked(query, k, v, k_cache, v_cache, plan, scale, window, softcap)
    elif isinstance(plan, DecodePlan):
        out = _paged(query, k_cache, v_cache, plan.reads, scale)
    elif plan.cached is None:
        out = _causal(query, k.transpose(1, 2), v.transpose(1, 2), scale, native_causal)
    elif plan.split is None:
        out = _paged(query, k_cache, v_cache, plan.cached, scale)
    else:
        fresh, cached = plan.split
        out = torch.empty_like(query)
        out[fresh] = _causal(
            query.index_select(0, fresh),
            k.index_select(0, fresh).transpose(1, 2),
            v.index_select(0, fresh).transpose(1, 2),
            scale,
            native_causal,
        )
        out[cached] = _paged(query.index_select(0, cached), k_cache, v_cache, plan.cached, scale)
    return out.transpose(1, 2).flatten(2)


def _attend_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    packed: PackedTokens,
    scale: float,
    window: int | None,
    softcap: float | None,
    native_causal: bool,
) -> torch.Tensor:
    """``attend`` on packed tokens (``[1, T, heads, D]`` in, ``[1, T, heads * D]`` out).

    Plain causal attention in float32 on the CPU takes the varlen kernel: a row with a
    cached prefix reads its keys back from the pages (as the padded path does), the others
    use this step's keys as they are. Anything else runs the padded path on the rows
    unpacked, so every model keeps its exact attention.
    """
    write_kv(cache=k_cache, new=k, plan=packed.writes)
    write_kv(cache=v_cache, new=v, plan=packed.writes)
    if window is None and softcap is None and native_causal and native_usable(q, k, v):
        keys, values, key_starts = _packed_keys(k[0], v[0], k_cache, v_cache, packed)
        out = native_varlen_attention(q[0], keys, values, packed.starts, key_starts, scale)
        return out.flatten(1).unsqueeze(0)
    padded = _attend_written(
        packed.unpack(q),
        packed.unpack(k),
        packed.unpack(v),
        k_cache,
        v_cache,
        plan,
        scale,
        window,
        softcap,
        native_causal,
    )
    return packed.pack(padded)


def _packed_keys(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    packed: PackedTokens,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's keys and values ``[Tk, Hkv, D]`` back to back, and where each row's begin:
    this step's own (``k``/``v`` ``[T, Hkv, D]``) for a row without a cached prefix, else its
    prefix and this step's tokens read from the pages."""
    if not any(packed.offsets):
        return k, v, packed.starts
    block_size = k_cache.shape[2]
    key_parts: list[torch.Tensor] = []
    value_parts: list[torch.Tensor] = []
    counts: list[int] = []
    bounds = packed.starts.tolist()
    for row, (offset, n) in enumerate(zip(packed.offsets, packed.lens, strict=True)):
        if offset == 0 or n == 0:
            key_parts.append(k[bounds[row] : bounds[row + 1]])
            value_parts.append(v[bounds[row] : bounds[row + 1]])
            counts.append(bounds[row + 1] - bounds[row])
            continue
        total = offset + n
        table = packed.page_table[row : row + 1, : -(-total // block_size)]
        for parts, cache in ((key_parts, k_cache), (value_parts, v_cache)):
            context = gather_context(cache=cache, page_table=table)[0, :, :total]
            parts.append(context.transpose(0, 1).to(k.dtype))
        counts.append(total)
    starts = torch.tensor([0, *counts], dtype=torch.long).cumsum(0)
    return torch.cat(key_parts), torch.cat(value_parts), starts


def _attend_masked(
    query: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan | DecodePlan,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """The same routing as ``attend`` with explicit masks (sliding window, soft-capping)."""

    def paged(q: torch.Tensor, reads: PagedReads, positions: torch.Tensor) -> torch.Tensor:
        keys = gather_context(cache=k_cache, page_table=reads.table).to(q.dtype)
        values = gather_context(cache=v_cache, page_table=reads.table).to(q.dtype)
        mask = _windowed(reads.mask, positions=positions, window=window)
        return _scored(q, keys, values, mask, scale, softcap)

    def fresh(q: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        keys, values = k.transpose(1, 2), v.transpose(1, 2)
        positions = plan.positions
        if rows is not None:
            keys, values = keys.index_select(0, rows), values.index_select(0, rows)
            positions = positions.index_select(0, rows)
        causal = positions[:, None, :, None] >= positions[:, None, None, :]
        mask = _windowed(causal, positions=positions, window=window, keys=positions)
        return _scored(q, keys, values, mask, scale, softcap)

    if isinstance(plan, DecodePlan):
        return paged(query, plan.reads, plan.positions[:, None])
    if plan.cached is None:
        return fresh(query, None)
    if plan.split is None:
        return paged(query, plan.cached, plan.positions)
    fresh_rows, cached_rows = plan.split
    out = torch.empty_like(query)
    out[fresh_rows] = fresh(query.index_select(0, fresh_rows), fresh_rows)
    out[cached_rows] = paged(
        query.index_select(0, cached_rows),
        plan.cached,
        plan.positions.index_select(0, cached_rows),
    )
    return out


def _windowed(
    mask: torch.Tensor,
    *,
    positions: torch.Tensor,
    window: int | None,
    keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """``mask`` ``[R, 1, S, L]`` also hiding keys ``window`` or more positions back.

    Key ``j`` sits at position ``keys[r, j]`` (default: ``j``, the paged layout).
    """
    if window is None:
        return mask
    if keys is None:
        key_pos = torch.arange(mask.shape[-1], device=mask.device)[None, None, None, :]
    else:
        key_pos = keys[:, None, None, :]
    return mask & (key_pos > positions[:, None, :, None] - window)


def _scored(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Attention with an explicit boolean mask; scores soft-capped when ``softcap`` is set."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    weights = torch.softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(weights.to(v.dtype), v)


def _causal_mask(*, positions: torch.Tensor, length: int) -> torch.Tensor:
    keys = torch.arange(length, device=positions.device)
    return (keys[None, None, :] <= positions[:, :, None])[:, None]


def _causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, native: bool = False
) -> torch.Tensor:
    if native and native_usable(q, k, v):
        return native_causal_attention(q, k, v, scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)


def _paged(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, reads: PagedReads, scale: float
) -> torch.Tensor:
    k = gather_context(cache=k_cache, page_table=reads.table).to(q.dtype)
    v = gather_context(cache=v_cache, page_table=reads.table).to(q.dtype)
    if q.shape[2] == 1 and q.device.type == "cpu" and q.dtype in _HALF_DTYPES:
        return _single_query(q, k, v, reads.mask, scale)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=reads.mask, scale=scale, enable_gqa=True
    )


#: Dtypes whose CPU flash-attention kernel is slow for one query per row (decode).
_HALF_DTYPES = (torch.bfloat16, torch.float16)


def _single_query(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Decode attention as two batched matmuls with a float32 softmax, GQA by grouping.

    torch's CPU flash kernel tiles for long queries; with one query per row in bf16 it is
    4-6x slower than this. Under ``torch.compile`` both products are written as
    reductions instead: inductor then fuses the page gather into one vectorized loop over
    ``head_dim``, where a matmul makes it materialize the gathered keys transposed, element
    by element (about 30% of a SmolLM2 bf16 decode step at batch 8).
    """
    rows, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    if torch.compiler.is_compiling():
        return _single_query_reduced(q, k, v, mask, scale)
    grouped = q.view(rows, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, k.transpose(-1, -2)).float() * scale
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(weights.to(v.dtype), v).view(rows, heads, 1, dim)


def _single_query_reduced(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``_single_query`` as float32 multiply-and-sum reductions (for compiled steps only:
    eagerly they would materialize ``[rows, heads, keys, head_dim]`` products)."""
    rows, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.view(rows, kv_heads, heads // kv_heads, 1, dim).float()
    scores = (grouped * k.float().unsqueeze(2)).sum(-1) * scale
    keep = mask.view(rows, 1, 1, -1)
    weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    out = (weights.unsqueeze(-1) * v.float().unsqueeze(2)).sum(-2)
    return out.to(q.dtype).view(rows, heads, 1, dim)
