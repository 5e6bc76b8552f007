"""The attention ops of a tt_transformers decoder, computed by the fake ttnn.

``ttnn.experimental.paged_update_cache`` / ``paged_fill_cache`` (paged KV writes),
``ttnn.transformer.paged_scaled_dot_product_attention_decode``,
``ttnn.transformer.scaled_dot_product_attention`` (causal prefill, GQA),
``ttnn.transformer.chunked_scaled_dot_product_attention`` (a prefill chunk over the row's
cached positions) and
``ttnn.experimental.rotary_embedding_llama`` (``x * cos + (x @ trans_mat) * sin`` per 32-wide
tile, the transformation matrix swapping pairs as tt_transformers builds it). The three SDPA ops
take ttnn 0.81.1's ``sliding_window_size``: a query at position ``p`` attends to positions
``(p - sliding_window_size, p]`` (the 0.81.1 docs of the chunked op; the decode kernel's
``window_start = cur_pos + 1 - sliding_window_size``), as transformers' sliding windows do;
the non-causal windowed prefill (a window centred on the query) is not emulated and raises.
Layouts follow tt_transformers: the KV cache ``[blocks, kv_heads, block_size, head_dim]``,
decode queries ``[1, batch, heads, head_dim]``, prefill ``[batch, heads, seq, head_dim]``; a
``-1`` position or page-table entry skips a row. Scores and softmax run in float32 over the
held values; outputs are rounded to the query's dtype by the fake.
"""

from __future__ import annotations

import math
from typing import Any

import torch

TILE = 32


def _slots(
    page_table: torch.Tensor, positions: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(block, offset, valid)`` of ``positions`` ``[B, N]`` through ``page_table`` ``[B, W]``."""
    column = torch.div(positions, block_size, rounding_mode="floor")
    width = page_table.shape[1]
    inside = (positions >= 0) & (column < width)
    block = page_table.long().gather(1, column.clamp(0, width - 1))
    return block.clamp(min=0), positions.clamp(min=0) % block_size, inside & (block >= 0)


def paged_update_cache(
    cache: torch.Tensor,
    update: torch.Tensor,
    *,
    update_idxs_tensor: torch.Tensor,
    page_table: torch.Tensor,
) -> None:
    """Write ``update[0, b, :kv_heads]`` at position ``update_idxs_tensor[b]`` of row ``b``."""
    kv_heads, block_size = cache.shape[1], cache.shape[2]
    positions = update_idxs_tensor.long().reshape(-1, 1)
    block, offset, valid = _slots(page_table, positions, block_size)
    rows = valid[:, 0].nonzero(as_tuple=True)[0]
    values = update[0, rows, :kv_heads, :].to(cache.dtype)
    cache[block[rows, 0], :, offset[rows, 0], :] = values


def paged_fill_cache(
    cache: torch.Tensor, fill: torch.Tensor, page_table: torch.Tensor, *, batch_idx: int
) -> None:
    """Write ``fill[0]`` (``[kv_heads, seq, head_dim]``) at positions ``0..seq-1`` of row
    ``batch_idx`` (positions past its page table are dropped)."""
    seq, block_size = fill.shape[2], cache.shape[2]
    positions = torch.arange(seq).reshape(1, -1)
    block, offset, valid = _slots(page_table[batch_idx : batch_idx + 1], positions, block_size)
    cols = valid[0].nonzero(as_tuple=True)[0]
    cache[block[0, cols], :, offset[0, cols], :] = (
        fill[0, :, cols, :].transpose(0, 1).to(cache.dtype)
    )


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q [H, N, D]`` over ``k, v [kvH, P, D]`` (GQA: head ``h`` reads kv head
    ``h // (H // kvH)``); ``mask [N, P]`` True where allowed."""
    groups = q.shape[0] // k.shape[0]
    k = k.float().repeat_interleave(groups, dim=0)
    v = v.float().repeat_interleave(groups, dim=0)
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with nothing: zeros
    return torch.matmul(weights, v)


def _in_window(
    query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window_size: int | None
) -> torch.Tensor:
    """True where ``key_pos > query_pos - sliding_window_size``: the window's lower bound
    (everywhere when there is no window; the causal upper bound is the caller's)."""
    if sliding_window_size is None:
        return torch.ones(torch.broadcast_shapes(query_pos.shape, key_pos.shape), dtype=torch.bool)
    if isinstance(sliding_window_size, bool) or int(sliding_window_size) <= 0:
        raise ValueError(
            f"sliding_window_size must be a positive integer, got {sliding_window_size!r}"
        )
    return key_pos > query_pos - int(sliding_window_size)


def paged_sdpa_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cur_pos_tensor: torch.Tensor,
    page_table_tensor: torch.Tensor,
    scale: float | None = None,
    sliding_window_size: int | None = None,
) -> torch.Tensor:
    """``[1, B, H, D]``: row ``b`` attends to its positions ``0..cur_pos[b]`` (with a window,
    the last ``sliding_window_size`` of them; none: zeros)."""
    batch, heads, dim = q.shape[1], q.shape[2], q.shape[3]
    block_size = k_cache.shape[2]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    span = page_table_tensor.shape[1] * block_size
    positions = torch.arange(span).reshape(1, -1).expand(batch, -1)
    block, offset, valid = _slots(page_table_tensor, positions, block_size)
    out = torch.zeros(1, batch, heads, dim)
    for b in range(batch):
        cur = int(cur_pos_tensor.reshape(-1)[b])
        if cur < 0:
            continue
        keys = k_cache[block[b], :, offset[b], :].transpose(0, 1)  # [kvH, P, D]
        values = v_cache[block[b], :, offset[b], :].transpose(0, 1)
        here = torch.tensor(cur)
        allowed = (
            valid[b] & (positions[b] <= cur) & _in_window(here, positions[b], sliding_window_size)
        )
        allowed = allowed.reshape(1, -1)
        out[0, b] = _attend(q[0, b].unsqueeze(1), keys, values, allowed, scale)[:, 0]
    return out


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = True,
    scale: float | None = None,
    sliding_window_size: int | None = None,
) -> torch.Tensor:
    """``[B, H, S, D]`` attention of ``q`` over ``k, v [B, kvH, S, D]`` (causal by default;
    with ``sliding_window_size``, each query over its last that many positions)."""
    seq, dim = q.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    mask = torch.ones(seq, k.shape[2], dtype=torch.bool)
    if is_causal:
        mask = torch.tril(mask)
    if sliding_window_size is not None:
        if not is_causal:
            raise NotImplementedError(
                "the ttnn emulator computes sliding_window_size with is_causal=True only "
                "(ttnn 0.81.1 centres a non-causal window on the query)"
            )
        rows, cols = torch.arange(seq).reshape(-1, 1), torch.arange(k.shape[2]).reshape(1, -1)
        mask = mask & _in_window(rows, cols, sliding_window_size)
    return torch.stack([_attend(q[b], k[b], v[b], mask, scale) for b in range(q.shape[0])])


def chunked_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table_tensor: torch.Tensor,
    chunk_start_idx: int,
    *,
    scale: float | None = None,
    sliding_window_size: int | None = None,
) -> torch.Tensor:
    """``[1, H, S, D]``: query ``i`` (position ``chunk_start_idx + i``) attends causally to
    the row's cached positions ``0..chunk_start_idx + i`` (with a window, those in
    ``(p - sliding_window_size, p]``) through ``page_table_tensor [1, W]`` (the chunk's own
    K/V written there first)."""
    seq, dim = q.shape[2], q.shape[3]
    block_size = k_cache.shape[2]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    span = chunk_start_idx + seq
    positions = torch.arange(span).reshape(1, -1)
    block, offset, valid = _slots(page_table_tensor[:1], positions, block_size)
    keys = k_cache[block[0], :, offset[0], :].transpose(0, 1)  # [kvH, span, D]
    values = v_cache[block[0], :, offset[0], :].transpose(0, 1)
    query_pos = torch.arange(chunk_start_idx, span).reshape(-1, 1)
    allowed = (
        (positions <= query_pos) & valid & _in_window(query_pos, positions, sliding_window_size)
    )
    return _attend(q[0], keys, values, allowed, scale).unsqueeze(0)


def rotary_embedding_llama(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    trans_mat: torch.Tensor,
    *,
    is_decode_mode: bool = False,
) -> torch.Tensor:
    """``x * cos + rotate(x) * sin``; ``rotate`` multiplies each 32-wide tile of the last
    dimension by the ``[32, 32]`` transformation matrix."""
    x = x.float()
    tiles = x.reshape(*x.shape[:-1], x.shape[-1] // TILE, TILE)
    rotated = torch.matmul(tiles, trans_mat.float().reshape(TILE, TILE)).reshape(x.shape)
    return x * cos.float() + rotated * sin.float()


def install(fake: Any) -> None:
    """Give ``fake`` the ``experimental`` and ``transformer`` namespaces with these ops."""
    fake.install_namespace(
        "experimental",
        {
            "paged_update_cache": (paged_update_cache, None),
            "paged_fill_cache": (paged_fill_cache, None),
            "rotary_embedding_llama": (rotary_embedding_llama, "same"),
        },
    )
    fake.install_namespace(
        "transformer",
        {
            "paged_scaled_dot_product_attention_decode": (paged_sdpa_decode, "same"),
            "scaled_dot_product_attention": (sdpa, "same"),
            "chunked_scaled_dot_product_attention": (chunked_sdpa, "same"),
        },
    )
