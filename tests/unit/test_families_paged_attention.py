"""Paged-attention primitives against a naive per-token reference (loops over rows/tokens)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from llmrt.families import paged_attention
from llmrt.families.paged_attention import (
    TOKEN_MAJOR,
    attend,
    gather_context,
    host_sync_allowed,
    plan_decode,
    plan_prefill,
)

BS = 4
N = 24
HQ, HKV, D = 4, 2, 8
SCALE = D**-0.5


def _cache(seed: int, *, token_major: bool = False, dim: int = D) -> torch.Tensor:
    """A random ``[N, HKV, BS, dim]`` cache, stored row-major or token-major (``TOKEN_MAJOR``)."""
    gen = torch.Generator().manual_seed(seed)
    if token_major:
        return torch.randn((N, BS, HKV, dim), generator=gen).permute(TOKEN_MAJOR)
    return torch.randn((N, HKV, BS, dim), generator=gen)


LAYOUTS = pytest.mark.parametrize("token_major", [False, True], ids=["row-major", "token-major"])


def _naive_write(
    cache: torch.Tensor, new: torch.Tensor, table: torch.Tensor, starts: list[int], lens: list[int]
) -> torch.Tensor:
    out = cache.clone()
    for row, (start, length) in enumerate(zip(starts, lens, strict=True)):
        for i in range(length):
            pos = start + i
            column = pos // BS
            if column < table.shape[1] and table[row, column] >= 0:
                out[table[row, column], :, pos % BS] = new[row, i]
    return out


def _naive_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    pos: int,
    row: int,
) -> torch.Tensor:
    """``q`` ``[HQ, dim]`` attending to positions ``0..pos`` of ``row`` (GQA: head h -> h // 2)."""
    keys = torch.stack([k_cache[table[row, p // BS], :, p % BS] for p in range(pos + 1)])
    values = torch.stack([v_cache[table[row, p // BS], :, p % BS] for p in range(pos + 1)])
    out = torch.empty(HQ, q.shape[-1])
    for h in range(HQ):
        kv_head = h // (HQ // HKV)
        weights = torch.softmax(keys[:, kv_head] @ q[h] * q.shape[-1] ** -0.5, dim=0)
        out[h] = weights @ values[:, kv_head]
    return out


def _table(rows: list[list[int]], width: int) -> torch.Tensor:
    table = torch.full((len(rows), width), -1, dtype=torch.int32)
    for r, blocks in enumerate(rows):
        table[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return table


PREFILL_CASES = {
    # name: (starts, lens, chunk, expected mode with sync)
    "fresh": ([0, 0, 0], [5, 0, 7], 8, "fresh"),
    "cached": ([3, 8, 5], [4, 2, 0], 5, "cached"),
    "split": ([0, 6, 0], [6, 3, 2], 6, "split"),
}


@LAYOUTS
@pytest.mark.parametrize("allow_sync", [True, False], ids=["sync", "capture-safe"])
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_prefill_matches_naive_reference(case: str, allow_sync: bool, token_major: bool) -> None:
    starts, lens, chunk, mode = PREFILL_CASES[case]
    gen = torch.Generator().manual_seed(1)
    rows = [[17, 2, 9, 21], [5, 11, 0, 14], [8, 3, 19, 6]]
    table = _table(rows, width=5)
    k_cache, v_cache = _cache(2, token_major=token_major), _cache(3, token_major=token_major)
    q = torch.randn((3, chunk, HQ, D), generator=gen)
    k = torch.randn((3, chunk, HKV, D), generator=gen)
    v = torch.randn((3, chunk, HKV, D), generator=gen)
    want_k = _naive_write(k_cache, k, table, starts, lens)
    want_v = _naive_write(v_cache, v, table, starts, lens)
    plan = plan_prefill(
        start_pos=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        page_table=table,
        block_size=BS,
        chunk_len=chunk,
        allow_sync=allow_sync,
    )
    assert plan.mode == (mode if allow_sync else "cached")
    out = attend(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, plan=plan, scale=SCALE)
    assert out.shape == (3, chunk, HQ * D)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.isfinite(out).all()
    for row in range(3):
        for i in range(lens[row]):
            want = _naive_attention(q[row, i], want_k, want_v, table, starts[row] + i, row)
            torch.testing.assert_close(out[row, i].view(HQ, D), want, atol=1e-5, rtol=1e-5)


@LAYOUTS
@pytest.mark.parametrize("allow_sync", [True, False], ids=["sync", "capture-safe"])
def test_decode_matches_naive_reference_and_skips_inert_rows(
    allow_sync: bool, token_major: bool
) -> None:
    gen = torch.Generator().manual_seed(4)
    rows = [[17, 2, 9], [], [5, 11], [8, -1]]
    table = _table(rows, width=6)
    positions = [9, 3, 6, 5]  # row 1 is inert, row 3 hits a -1 entry (write skipped)
    k_cache, v_cache = _cache(5, token_major=token_major), _cache(6, token_major=token_major)
    q = torch.randn((4, 1, HQ, D), generator=gen)
    k = torch.randn((4, 1, HKV, D), generator=gen)
    v = torch.randn((4, 1, HKV, D), generator=gen)
    want_k = _naive_write(k_cache, k, table, positions, [1, 1, 1, 1])
    want_v = _naive_write(v_cache, v, table, positions, [1, 1, 1, 1])
    plan = plan_decode(
        positions=torch.tensor(positions, dtype=torch.int32),
        page_table=table,
        block_size=BS,
        allow_sync=allow_sync,
    )
    blocks_in_use = math.ceil((max(positions) + 1) / BS)
    assert plan.reads.table.shape[1] == (blocks_in_use if allow_sync else 6)
    out = attend(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, plan=plan, scale=SCALE)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.isfinite(out).all()
    for row in (0, 2):
        want = _naive_attention(q[row, 0], want_k, want_v, table, positions[row], row)
        torch.testing.assert_close(out[row, 0].view(HQ, D), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("allow_sync", [True, False], ids=["sync", "capture-safe"])
def test_batch_without_any_write_leaves_cache_bit_identical(allow_sync: bool) -> None:
    k_cache, v_cache = _cache(7), _cache(8)
    k_cache[0, 0, 0, 0] = float("nan")  # a NaN payload must survive a no-op write too
    before_k, before_v = k_cache.clone(), v_cache.clone()
    table = _table([[], [3, 4]], width=2)
    plan = plan_prefill(
        start_pos=torch.tensor([0, 4], dtype=torch.int32),
        seq_lens=torch.tensor([0, 0], dtype=torch.int32),
        page_table=table,
        block_size=BS,
        chunk_len=3,
        allow_sync=allow_sync,
    )
    assert plan.writes.any_write_host is (False if allow_sync else None)
    shape = (2, 3)
    attend(
        q=torch.zeros((*shape, HQ, D)),
        k=torch.ones((*shape, HKV, D)),
        v=torch.ones((*shape, HKV, D)),
        k_cache=k_cache,
        v_cache=v_cache,
        plan=plan,
        scale=SCALE,
    )
    assert torch.equal(k_cache.view(torch.int32), before_k.view(torch.int32))
    assert torch.equal(v_cache.view(torch.int32), before_v.view(torch.int32))


@LAYOUTS
def test_gather_context_reads_pages_in_table_order(token_major: bool) -> None:
    cache = _cache(9, token_major=token_major)
    table = _table([[7, 1, 4]], width=3)
    got = gather_context(cache=cache, page_table=table)
    assert got.shape == (1, HKV, 3 * BS, D)
    # Token-major pages come back as a view of one gather: tokens outer, heads inner.
    assert got.transpose(1, 2).is_contiguous() is token_major
    for p in range(3 * BS):
        assert torch.equal(got[0, :, p], cache[[7, 1, 4][p // BS], :, p % BS])


def test_host_sync_is_allowed_on_cpu() -> None:
    assert host_sync_allowed(torch.device("cpu"))


@LAYOUTS
def test_bf16_decode_takes_the_single_query_path_and_matches_float32(token_major: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    table = _table([[17, 2, 9], [5, 11]], width=4)
    positions = [9, 6]
    k_cache, v_cache = _cache(12, token_major=token_major), _cache(13, token_major=token_major)
    q = torch.randn((2, 1, HQ, D), generator=gen)
    k = torch.randn((2, 1, HKV, D), generator=gen)
    v = torch.randn((2, 1, HKV, D), generator=gen)
    plan = plan_decode(
        positions=torch.tensor(positions, dtype=torch.int32), page_table=table, block_size=BS
    )
    half_k, half_v = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    out = attend(
        q=q.bfloat16(), k=k.bfloat16(), v=v.bfloat16(), k_cache=half_k, v_cache=half_v,
        plan=plan, scale=SCALE,
    )
    want = attend(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, plan=plan, scale=SCALE)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)
    for row in range(2):
        ref = _naive_attention(q[row, 0], k_cache, v_cache, table, positions[row], row)
        torch.testing.assert_close(out[row, 0].float().view(HQ, D), ref, atol=3e-2, rtol=3e-2)


@LAYOUTS
def test_compiled_bf16_decode_uses_the_reduction_form_and_matches(token_major: bool) -> None:
    """Under torch.compile the single-query path is written as reductions (see
    ``_single_query``); it must compute what the eager matmul form does."""
    gen = torch.Generator().manual_seed(12)
    table = _table([[17, 2, 9], [5, 11]], width=4)
    positions = torch.tensor([9, 6], dtype=torch.int32)
    caches = [
        _cache(seed, token_major=token_major).to(torch.bfloat16) for seed in (14, 15, 14, 15)
    ]
    q, k, v = (torch.randn((2, 1, h, D), generator=gen).bfloat16() for h in (HQ, HKV, HKV))
    plan = plan_decode(positions=positions, page_table=table, block_size=BS)
    calls: list[str] = []
    reduced = paged_attention._single_query_reduced

    def spy(*args: Any) -> torch.Tensor:
        calls.append("reduced")
        return reduced(*args)

    def step(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        compiled_plan = plan_decode(
            positions=positions, page_table=table, block_size=BS, allow_sync=False
        )
        return attend(
            q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, plan=compiled_plan, scale=SCALE
        )

    eager = attend(q=q, k=k, v=v, k_cache=caches[0], v_cache=caches[1], plan=plan, scale=SCALE)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged_attention, "_single_query_reduced", spy)
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(caches[2], caches[3])
    assert calls == ["reduced"]
    torch.testing.assert_close(compiled.float(), eager.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(caches[2], caches[0])  # the same K/V written both ways


# --- packed prefill: the real tokens only ------------------------------------------------


@LAYOUTS
@pytest.mark.parametrize("route", ["varlen", "sdpa", "window"])
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_packed_prefill_matches_the_naive_reference(
    case: str, route: str, token_major: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed tokens (``plan_prefill(pack=True)``) give every real token the naive result
    and write the same pages, through the varlen kernel or (other attention) the padded path."""
    if route == "varlen":
        from llmrt.kernels.native import load_kernels

        load_kernels()
        if not bool(torch.ops.llmrt_kernels.causal_attention_supported(16)):
            pytest.skip("the native attention kernels need AVX-512")
    starts, lens, chunk, _ = PREFILL_CASES[case]
    dim = 16  # a head_dim the native kernels take
    gen = torch.Generator().manual_seed(4)
    table = _table([[17, 2, 9, 21], [5, 11, 0, 14], [8, 3, 19, 6]], width=5)
    k_cache = _cache(5, token_major=token_major, dim=dim)
    v_cache = _cache(6, token_major=token_major, dim=dim)
    q = torch.randn((3, chunk, HQ, dim), generator=gen)
    k = torch.randn((3, chunk, HKV, dim), generator=gen)
    v = torch.randn((3, chunk, HKV, dim), generator=gen)
    want_k = _naive_write(k_cache, k, table, starts, lens)
    want_v = _naive_write(v_cache, v, table, starts, lens)
    plan = plan_prefill(
        start_pos=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        page_table=table,
        block_size=BS,
        chunk_len=chunk,
        pack=True,
    )
    packed = plan.packed
    assert packed is not None and packed.tokens == sum(lens)
    assert packed.starts.tolist() == [0, lens[0], lens[0] + lens[1], sum(lens)]
    calls: list[int] = []
    kernel = paged_attention.native_varlen_attention

    def counted(*args: Any) -> torch.Tensor:
        calls.append(1)
        return kernel(*args)

    monkeypatch.setattr(paged_attention, "native_varlen_attention", counted)
    window = chunk + max(starts) + 1 if route == "window" else None  # covers every key
    out = attend(
        q=packed.pack(q),
        k=packed.pack(k),
        v=packed.pack(v),
        k_cache=k_cache,
        v_cache=v_cache,
        plan=plan,
        scale=dim**-0.5,
        window=window,
        native_causal=route == "varlen",
    )
    assert out.shape == (1, sum(lens), HQ * dim)
    assert len(calls) == (route == "varlen")
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    rows = packed.unpack(out)
    for row in range(3):
        for i in range(lens[row]):
            want = _naive_attention(q[row, i], want_k, want_v, table, starts[row] + i, row)
            torch.testing.assert_close(rows[row, i].view(HQ, dim), want, atol=1e-5, rtol=1e-5)


def test_packed_tokens_pack_unpack_and_last_tokens() -> None:
    plan = plan_prefill(
        start_pos=torch.tensor([0, 4, 0], dtype=torch.int32),
        seq_lens=torch.tensor([3, 0, 5], dtype=torch.int32),  # row 1: a padding row
        page_table=_table([[1, 2], [3, 4], [5, 6]], width=2),
        block_size=BS,
        chunk_len=6,
        pack=True,
    )
    packed = plan.packed
    assert packed is not None
    x = torch.arange(18.0).view(3, 6, 1)
    assert packed.pack(x).flatten().tolist() == [0, 1, 2, 12, 13, 14, 15, 16]
    back = packed.unpack(packed.pack(x))
    assert back.flatten().tolist() == [0, 1, 2, 0, 0, 0] + [0] * 6 + [12, 13, 14, 15, 16, 0]
    # Last token of each row in packed order; the padding row's clamps inside the tokens.
    assert packed.last_tokens(torch.tensor([2, 0, 4])).tolist() == [2, 3, 7]
    # An index past a row's tokens stays in that row (the padded path keeps it in the row).
    assert packed.last_tokens(torch.tensor([5, 0, 9])).tolist() == [2, 3, 7]
    only_padding = plan_prefill(
        start_pos=torch.tensor([0, 0], dtype=torch.int32),
        seq_lens=torch.tensor([0, 0], dtype=torch.int32),
        page_table=_table([[1], [2]], width=1),
        block_size=BS,
        chunk_len=4,
        pack=True,
    )
    assert only_padding.packed is None  # nothing to pack: the padded path runs
    no_pack = plan_prefill(
        start_pos=torch.tensor([0], dtype=torch.int32),
        seq_lens=torch.tensor([3], dtype=torch.int32),
        page_table=_table([[1]], width=1),
        block_size=BS,
        chunk_len=4,
        pack=True,
        allow_sync=False,  # captured or compiled: shapes stay padded
    )
    assert no_pack.packed is None
