"""The fake ttnn's attention ops (paged KV writes, paged decode SDPA, causal prefill SDPA,
rotary_embedding_llama) against torch references, strict inputs, and a traced decode step."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from llmrt.testing.fake_ttnn import FakeTtnn, TtnnRuleViolation

BLOCKS, KVH, BS, D, H = 12, 2, 16, 32, 4
BF16_TOL = {"rtol": 2**-6, "atol": 2**-6}


@pytest.fixture
def tt() -> Iterator[tuple[FakeTtnn, object]]:
    fake = FakeTtnn()
    mesh = fake.open_mesh_device(fake.MeshShape(1, 1), trace_region_size=1 << 20)
    yield fake, mesh
    fake.close_mesh_device(mesh)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tile(fake: FakeTtnn, mesh: object, value: torch.Tensor, dtype: object = None) -> object:
    dtype = fake.bfloat16 if dtype is None else dtype
    return fake.from_torch(value, dtype=dtype, layout=fake.TILE_LAYOUT, device=mesh)


def _int(fake: FakeTtnn, mesh: object, value: torch.Tensor) -> object:
    return fake.from_torch(value.to(torch.int32), dtype=fake.int32, device=mesh)


def _gather(cache: torch.Tensor, table_row: list[int], length: int) -> torch.Tensor:
    """``[kvH, length, D]``: a row's positions ``0..length-1`` read through its blocks."""
    pos = torch.arange(length)
    blocks = torch.tensor(table_row)[pos // BS]
    return cache[blocks, :, pos % BS, :].transpose(0, 1)


TABLE = torch.tensor([[3, 7, 1, -1], [5, 0, 9, 2]])


def test_paged_fill_then_update_land_where_the_page_table_says(
    tt: tuple[FakeTtnn, object],
) -> None:
    fake, mesh = tt
    cache = _tile(fake, mesh, torch.zeros(BLOCKS, KVH, BS, D))
    fill = torch.randn(1, KVH, 40, D, generator=_gen(1))
    fake.experimental.paged_fill_cache(
        cache, _tile(fake, mesh, fill), _int(fake, mesh, TABLE), batch_idx=1
    )
    step = torch.randn(1, 2, KVH, D, generator=_gen(2))
    fake.experimental.paged_update_cache(
        cache,
        _tile(fake, mesh, step),
        update_idxs_tensor=_int(fake, mesh, torch.tensor([-1, 40])),  # row 0 skipped
        page_table=_int(fake, mesh, TABLE),
    )

    held = fake.to_torch(cache).float()
    row1 = _gather(held, TABLE[1].tolist(), 41)
    assert torch.equal(row1[:, :40], fill[0].bfloat16().float())
    assert torch.equal(row1[:, 40], step[0, 1].bfloat16().float())
    assert held[[3, 7, 1]].abs().sum() == 0  # row 0's blocks untouched


def test_a_bfloat8_b_cache_holds_block_floats_after_a_write(
    tt: tuple[FakeTtnn, object],
) -> None:
    from llmrt.testing.block_float import round_block_float

    fake, mesh = tt
    cache = _tile(fake, mesh, torch.zeros(BLOCKS, KVH, BS, D), fake.bfloat8_b)
    step = torch.randn(1, 2, KVH, D, generator=_gen(3))
    fake.experimental.paged_update_cache(
        cache,
        _tile(fake, mesh, step),
        update_idxs_tensor=_int(fake, mesh, torch.tensor([5, 17])),
        page_table=_int(fake, mesh, TABLE),
    )
    written = fake.to_torch(cache)[3, :, 5, :]
    assert torch.equal(written, round_block_float(step[0, 0].bfloat16().float(), mantissa_bits=7))


@pytest.mark.parametrize("window", [None, 10])
def test_paged_decode_sdpa_matches_torch_over_each_rows_positions(
    tt: tuple[FakeTtnn, object], window: int | None
) -> None:
    """Each row attends to its own pages up to its position (with a sliding window: only its
    last ``window`` positions; row 2 at position 3 is still inside it); a -1 row is zeros."""
    fake, mesh = tt
    k = torch.randn(BLOCKS, KVH, BS, D, generator=_gen(4))
    v = torch.randn(BLOCKS, KVH, BS, D, generator=_gen(5))
    q = torch.randn(1, 3, H, D, generator=_gen(6))
    table = torch.cat([TABLE, torch.tensor([[4, 6, 8, 10]])])
    cur = torch.tensor([20, 47, -1 if window is None else 3])
    extra = {} if window is None else {"sliding_window_size": window}
    out = fake.transformer.paged_scaled_dot_product_attention_decode(
        _tile(fake, mesh, q),
        _tile(fake, mesh, k),
        _tile(fake, mesh, v),
        cur_pos_tensor=_int(fake, mesh, cur),
        page_table_tensor=_int(fake, mesh, table),
        scale=0.2,
        **extra,
    )
    got = fake.to_torch(out).float()
    kh, vh, qh = (t.bfloat16().float() for t in (k, v, q))
    for b in range(2 if window is None else 3):
        length = int(cur[b]) + 1
        keys = _gather(kh, table[b].tolist(), length)[None]
        values = _gather(vh, table[b].tolist(), length)[None]
        mask = None if window is None else _band(cur[b : b + 1], torch.arange(length), window)
        ref = F.scaled_dot_product_attention(
            qh[0, b][None, :, None], keys, values, attn_mask=mask, scale=0.2, enable_gqa=True
        )[0, :, 0]
        torch.testing.assert_close(got[0, b], ref, **BF16_TOL)
    if window is None:
        assert torch.equal(got[0, 2], torch.zeros(H, D))  # a padding row


def test_causal_prefill_sdpa_with_grouped_kv_heads(tt: tuple[FakeTtnn, object]) -> None:
    fake, mesh = tt
    q = torch.randn(2, H, 40, D, generator=_gen(7))
    k = torch.randn(2, KVH, 40, D, generator=_gen(8))
    v = torch.randn(2, KVH, 40, D, generator=_gen(9))
    out = fake.transformer.scaled_dot_product_attention(
        _tile(fake, mesh, q), _tile(fake, mesh, k), _tile(fake, mesh, v), is_causal=True
    )
    qh, kh, vh = (t.bfloat16().float() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(fake.to_torch(out).float(), ref, **BF16_TOL)


def _trans_mat() -> torch.Tensor:
    """tt_transformers' ``get_rot_transformation_mat``: pairs (2k, 2k+1) -> (-x[2k+1], x[2k])."""
    mat = torch.zeros(1, 1, 32, 32)
    mat[..., torch.arange(0, 32, 2), torch.arange(1, 32, 2)] = 1
    mat[..., torch.arange(1, 32, 2), torch.arange(0, 32, 2)] = -1
    return mat


def test_rotary_embedding_llama_rotates_interleaved_pairs(tt: tuple[FakeTtnn, object]) -> None:
    fake, mesh = tt
    x = torch.randn(1, H, 8, 64, generator=_gen(10))
    theta = torch.randn(8, 32, generator=_gen(11))  # one angle per (position, pair)
    cos = torch.cos(theta).repeat_interleave(2, dim=-1)[None, None]
    sin = torch.sin(theta).repeat_interleave(2, dim=-1)[None, None]
    out = fake.experimental.rotary_embedding_llama(
        _tile(fake, mesh, x),
        _tile(fake, mesh, cos),
        _tile(fake, mesh, sin),
        _tile(fake, mesh, _trans_mat()),
        is_decode_mode=False,
    )
    held = x.bfloat16().float()
    pairs = torch.view_as_complex(held.reshape(1, H, 8, 32, 2).contiguous())
    angle = torch.complex(cos[..., ::2].bfloat16().float(), sin[..., ::2].bfloat16().float())
    ref = torch.view_as_real(pairs * angle).reshape(1, H, 8, 64)
    torch.testing.assert_close(fake.to_torch(out).float(), ref, **BF16_TOL)


def test_index_tensors_must_be_int32_and_floats_tiled(tt: tuple[FakeTtnn, object]) -> None:
    fake, mesh = tt
    cache = _tile(fake, mesh, torch.zeros(BLOCKS, KVH, BS, D))
    step = _tile(fake, mesh, torch.zeros(1, 2, KVH, D))
    as_float = _tile(fake, mesh, TABLE.float())
    with pytest.raises(TtnnRuleViolation, match="page_table must be int32"):
        fake.experimental.paged_update_cache(
            cache,
            step,
            update_idxs_tensor=_int(fake, mesh, torch.tensor([1, 2])),
            page_table=as_float,
        )
    rm = fake.from_torch(torch.zeros(1, 2, KVH, D), dtype=fake.bfloat16, device=mesh)
    with pytest.raises(TtnnRuleViolation, match="TILE layout"):
        fake.experimental.paged_update_cache(
            cache,
            rm,
            update_idxs_tensor=_int(fake, mesh, torch.tensor([1, 2])),
            page_table=_int(fake, mesh, TABLE),
        )


def test_a_traced_decode_step_replays_on_refreshed_positions(tt: tuple[FakeTtnn, object]) -> None:
    fake, mesh = tt
    k = _tile(fake, mesh, torch.randn(BLOCKS, KVH, BS, D, generator=_gen(12)))
    v = _tile(fake, mesh, torch.randn(BLOCKS, KVH, BS, D, generator=_gen(13)))
    q = _tile(fake, mesh, torch.randn(1, 2, H, D, generator=_gen(14)))
    step = _tile(fake, mesh, torch.randn(1, 2, KVH, D, generator=_gen(15)))
    table = _int(fake, mesh, TABLE)
    pos = _int(fake, mesh, torch.tensor([3, 9]))

    def decode() -> object:
        fake.experimental.paged_update_cache(k, step, update_idxs_tensor=pos, page_table=table)
        return fake.transformer.paged_scaled_dot_product_attention_decode(
            q, k, v, cur_pos_tensor=pos, page_table_tensor=table
        )

    decode()
    trace = fake.begin_trace_capture(mesh, cq_id=0)
    out = decode()
    fake.end_trace_capture(mesh, trace, cq_id=0)
    host = fake.from_torch(torch.tensor([4, 10], dtype=torch.int32), dtype=fake.int32)
    fake.copy_host_to_device_tensor(host, pos)
    fake.execute_trace(mesh, trace, cq_id=0, blocking=True)
    replayed = fake.to_torch(out)

    assert torch.equal(replayed, fake.to_torch(decode()))  # eager at the same positions
    held = fake.to_torch(k)
    assert torch.equal(held[3, :, 4], held[3, :, 3])  # the replay wrote position 4 as well
    fake.release_trace(mesh, trace)


def test_a_chunk_attends_to_the_rows_cached_positions(tt: tuple[FakeTtnn, object]) -> None:
    fake, mesh = tt
    k = torch.randn(BLOCKS, KVH, BS, D, generator=_gen(16))
    v = torch.randn(BLOCKS, KVH, BS, D, generator=_gen(17))
    q = torch.randn(1, H, 8, D, generator=_gen(18))  # positions 16..23
    out = fake.transformer.chunked_scaled_dot_product_attention(
        _tile(fake, mesh, q),
        _tile(fake, mesh, k),
        _tile(fake, mesh, v),
        _int(fake, mesh, TABLE[1:]),
        16,
        scale=0.25,
    )
    kh, vh, qh = (t.bfloat16().float() for t in (k, v, q))
    keys = _gather(kh, TABLE[1].tolist(), 24)[None]
    values = _gather(vh, TABLE[1].tolist(), 24)[None]
    mask = torch.arange(24)[None, :] <= torch.arange(16, 24)[:, None]
    ref = F.scaled_dot_product_attention(
        qh, keys, values, attn_mask=mask, scale=0.25, enable_gqa=True
    )
    torch.testing.assert_close(fake.to_torch(out).float(), ref, **BF16_TOL)


def _band(queries: torch.Tensor, keys: torch.Tensor, window: int) -> torch.Tensor:
    """transformers' sliding-window mask, written out: causal, and fewer than ``window``
    positions back (``q - k < window``)."""
    offset = queries[:, None] - keys[None, :]
    return (offset >= 0) & (offset < window)


def test_a_sliding_window_limits_causal_prefill_to_the_last_positions(
    tt: tuple[FakeTtnn, object],
) -> None:
    fake, mesh = tt
    q = torch.randn(1, H, 40, D, generator=_gen(19))
    k = torch.randn(1, KVH, 40, D, generator=_gen(20))
    v = torch.randn(1, KVH, 40, D, generator=_gen(21))
    out = fake.transformer.scaled_dot_product_attention(
        _tile(fake, mesh, q),
        _tile(fake, mesh, k),
        _tile(fake, mesh, v),
        is_causal=True,
        scale=0.3,
        sliding_window_size=7,
    )
    qh, kh, vh = (t.bfloat16().float() for t in (q, k, v))
    mask = _band(torch.arange(40), torch.arange(40), 7)
    ref = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=0.3, enable_gqa=True)
    got = fake.to_torch(out).float()
    torch.testing.assert_close(got, ref, **BF16_TOL)
    full = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=0.3, enable_gqa=True)
    assert not torch.allclose(got[:, :, 7:], full[:, :, 7:], atol=0.05)  # the window bites
    torch.testing.assert_close(got[:, :, :7], full[:, :, :7], **BF16_TOL)  # not yet full
    with pytest.raises(NotImplementedError, match="is_causal=True only"):
        fake.transformer.scaled_dot_product_attention(
            _tile(fake, mesh, q),
            _tile(fake, mesh, k),
            _tile(fake, mesh, v),
            is_causal=False,
            sliding_window_size=7,
        )


def test_a_sliding_window_reaches_back_across_a_chunk_boundary(
    tt: tuple[FakeTtnn, object],
) -> None:
    fake, mesh = tt
    k = torch.randn(BLOCKS, KVH, BS, D, generator=_gen(25))
    v = torch.randn(BLOCKS, KVH, BS, D, generator=_gen(26))
    q = torch.randn(1, H, 8, D, generator=_gen(27))  # positions 16..23
    out = fake.transformer.chunked_scaled_dot_product_attention(
        _tile(fake, mesh, q),
        _tile(fake, mesh, k),
        _tile(fake, mesh, v),
        _int(fake, mesh, TABLE[1:]),
        16,
        scale=0.25,
        sliding_window_size=5,
    )
    kh, vh, qh = (t.bfloat16().float() for t in (k, v, q))
    keys = _gather(kh, TABLE[1].tolist(), 24)[None]
    values = _gather(vh, TABLE[1].tolist(), 24)[None]
    mask = _band(torch.arange(16, 24), torch.arange(24), 5)
    ref = F.scaled_dot_product_attention(
        qh, keys, values, attn_mask=mask, scale=0.25, enable_gqa=True
    )
    torch.testing.assert_close(fake.to_torch(out).float(), ref, **BF16_TOL)
