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

from llmrt.families.prefill_attention import native_causal_attention, native_usable

__all__ = [
    "TOKEN_MAJOR",
    "DecodePlan",
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


class PrefillPlan(NamedTuple):
    """Per-forward prefill routing shared by every layer.

    ``cached is None``: every row starts at position 0 and attends causally to the
    chunk itself (no page reads). ``split is None``: every row reads its context
    back through the page table (``cached``). Otherwise ``split`` holds the row
    indices of the fresh and of the cached group, and ``cached`` covers the
    cached group only.
    """

    writes: WritePlan
    positions: torch.Tensor
    cached: PagedReads | None
    split: tuple[torch.Tensor, torch.Tensor] | None

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
) -> PrefillPlan:
    """Plan a prefill chunk of ``chunk_len`` padded tokens per row (see ``PrefillPlan``)."""
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
    if not cached:
        return PrefillPlan(writes=writes, positions=positions, cached=None, split=None)
    blocks = max(-(-max(ends[row], starts[row] + 1) // block_size) for row in cached)
    blocks = max(1, min(width, blocks))
    if len(cached) == rows:
        reads = PagedReads(
            table=page_table[:, :blocks],
            mask=_causal_mask(positions=positions, length=blocks * block_size),
        )
        return PrefillPlan(writes=writes, positions=positions, cached=reads, split=None)
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
        writes=writes, positions=positions, cached=reads, split=(fresh_rows, cached_rows)
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
    write_kv(cache=k_cache, new=k, plan=plan.writes)
    write_kv(cache=v_cache, new=v, plan=plan.writes)
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
