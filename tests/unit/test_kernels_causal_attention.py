"""``llmrt_kernels.causal_attention`` (``device.attention_kernel: native``) against a float64
softmax reference written out here, and its routing in ``paged_attention.attend``."""

from __future__ import annotations

import pytest
import torch

from llmrt.errors import ConfigError
from llmrt.families.paged_attention import attend, plan_prefill
from llmrt.families.prefill_attention import select_attention_kernel
from llmrt.kernels.native import load_kernels

load_kernels()
op = torch.ops.llmrt_kernels.causal_attention
pytestmark = pytest.mark.skipif(
    not bool(torch.ops.llmrt_kernels.causal_attention_supported(64)),
    reason="the native causal attention needs AVX2",
)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Position i of query head h attends to keys 0..i of KV head h // (H / Hkv), float64."""
    heads, kv_heads, length = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return weights @ v


def qkv(
    batch: int, heads: int, kv_heads: int, length: int, dim: int, *, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the prefill path hands them over: ``[B, S, H, D]`` storage seen as
    ``[B, H, S, D]`` (strided heads and positions)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, dim, generator=gen) * 2
    k = torch.randn(batch, length, kv_heads, dim, generator=gen) * 2
    v = torch.randn(batch, length, kv_heads, dim, generator=gen)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "length", "dim"),
    [
        (1, 9, 3, 512, 64),  # SmolLM2's layer: several query and key blocks
        (2, 4, 2, 77, 32),  # a length that fills no block exactly
        (1, 8, 8, 130, 128),  # no grouping, the widest head
        (3, 6, 1, 33, 16),  # multi-query, one position past a query block
        (1, 2, 1, 1, 64),  # one token
    ],
)
def test_matches_the_float64_reference(
    batch: int, heads: int, kv_heads: int, length: int, dim: int
) -> None:
    q, k, v = qkv(batch, heads, kv_heads, length, dim, seed=length)
    scale = dim**-0.5
    got = op(q, k, v, scale)
    assert got.shape == (batch, heads, length, dim)
    # The result's storage is [B, S, H, D]: the caller's transpose + flatten is a view.
    assert got.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(got.double(), reference(q, k, v, scale), atol=2e-5, rtol=1e-5)


def test_contiguous_inputs_and_an_empty_batch() -> None:
    q, k, v = (t.contiguous() for t in qkv(1, 4, 2, 40, 16, seed=1))
    torch.testing.assert_close(
        op(q, k, v, 0.3).double(), reference(q, k, v, 0.3), atol=2e-5, rtol=1e-5
    )
    q, k, v = qkv(0, 4, 2, 8, 16, seed=2)
    assert op(q, k, v, 0.25).shape == (0, 4, 8, 16)


def test_nan_and_overflowing_scores_poison_the_rows_that_see_them_as_torch_does() -> None:
    import torch.nn.functional as F

    q, k, v = (t.contiguous() for t in qkv(1, 2, 1, 70, 16, seed=8))
    k[0, 0, 40, 3] = float("nan")  # key 40: rows 40.. see a NaN score
    got = op(q, k, v, 0.25)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    assert torch.isnan(want[:, :, 40:]).all() and not torch.isnan(want[:, :, :40]).any()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    torch.testing.assert_close(got[:, :, :40], want[:, :, :40], atol=1e-5, rtol=1e-5)
    big = torch.full((1, 1, 3, 16), 1e20)  # scores overflow to +inf: torch gives NaN
    assert torch.isnan(op(big, big, big, 1.0)).all()


def test_bad_inputs_name_the_problem() -> None:
    q, k, v = qkv(1, 4, 2, 8, 16, seed=3)
    with pytest.raises(RuntimeError, match="float32 on the CPU"):
        op(q.double(), k, v, 0.25)
    q3, k3, v3 = qkv(1, 3, 2, 8, 16, seed=4)
    with pytest.raises(
        RuntimeError, match=r"query heads \(3\) must be a multiple of KV heads \(2\)"
    ):
        op(q3, k3, v3, 0.25)
    q24, k24, v24 = qkv(1, 4, 2, 8, 24, seed=5)
    with pytest.raises(RuntimeError, match=r"head_dim 16, 32, 64 or 128 \(got 24\)"):
        op(q24, k24, v24, 0.25)
    with pytest.raises(RuntimeError, match="k and v must be"):
        op(q, k[:, :, :4], v[:, :, :4], 0.25)


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.native_causal = False


def test_select_sets_every_attention_and_native_where_it_cannot_run_is_an_error() -> None:
    model = torch.nn.Sequential(_Attention(), torch.nn.Linear(2, 2), _Attention())
    assert select_attention_kernel(model, choice="auto", device=torch.device("cpu")) is None
    assert all(m.native_causal for m in model if isinstance(m, _Attention))
    why = select_attention_kernel(model, choice="sdpa", device=torch.device("cpu"))
    assert why is not None and not any(m.native_causal for m in model if isinstance(m, _Attention))
    with pytest.raises(ConfigError, match="runs on cuda, not the CPU"):
        select_attention_kernel(model, choice="native", device=torch.device("cuda"))
    with pytest.raises(ConfigError, match="must be one of"):
        select_attention_kernel(model, choice="flash", device=torch.device("cpu"))


@pytest.mark.parametrize(
    ("starts", "lens"),
    [([0, 0], [37, 20]), ([0, 9], [30, 12])],
    ids=["fresh", "split"],
)
def test_attend_routes_fresh_rows_to_the_kernel_with_the_same_result(
    starts: list[int], lens: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmrt.families import paged_attention

    calls: list[int] = []
    kernel = paged_attention.native_causal_attention

    def counted(*args: torch.Tensor | float) -> torch.Tensor:
        calls.append(1)
        return kernel(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(paged_attention, "native_causal_attention", counted)
    chunk, block, heads, kv_heads, dim = 40, 8, 4, 2, 16
    table = torch.arange(2 * 8, dtype=torch.int32).view(2, 8)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, chunk, heads, dim, generator=gen)
    k = torch.randn(2, chunk, kv_heads, dim, generator=gen)
    v = torch.randn(2, chunk, kv_heads, dim, generator=gen)
    outs = []
    for native in (False, True):
        caches = [
            torch.randn(16, kv_heads, block, dim, generator=torch.Generator().manual_seed(s))
            for s in (1, 2)
        ]
        plan = plan_prefill(
            start_pos=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            page_table=table,
            block_size=block,
            chunk_len=chunk,
            allow_sync=True,
        )
        outs.append(
            attend(
                q=q,
                k=k,
                v=v,
                k_cache=caches[0],
                v_cache=caches[1],
                plan=plan,
                scale=dim**-0.5,
                native_causal=native,
            )
        )
    assert len(calls) == 1  # only the native run, and once for all fresh rows
    for row, length in enumerate(lens):
        torch.testing.assert_close(
            outs[1][row, :length], outs[0][row, :length], atol=1e-5, rtol=1e-5
        )


# --- varlen_causal_attention: ragged sequences packed back to back ----------------------

varlen = torch.ops.llmrt_kernels.varlen_causal_attention


def ragged_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence, ``q`` ``[n, H, D]``, ``k``/``v`` ``[m, Hkv, D]``: query i is key
    m - n + i and sees keys 0..m - n + i, float64."""
    n, m = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    keys = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, m, D]
    values = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q.double().transpose(0, 1) @ keys.transpose(-1, -2)) * scale  # [H, n, m]
    hidden = torch.arange(m)[None, :] > (m - n + torch.arange(n))[:, None]
    weights = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return (weights @ values).transpose(0, 1)


def starts_of(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *counts], dtype=torch.long).cumsum(0)


@pytest.mark.parametrize(
    ("shapes", "heads", "kv_heads", "dim"),
    [
        # (queries, keys) per sequence: fresh rows (queries == keys), rows with a cached
        # prefix of whole and of partial key blocks, an empty row and a one-token row.
        ([(5, 5), (40, 104), (1, 33), (70, 70), (0, 12), (130, 200)], 9, 3, 64),
        ([(64, 64), (33, 97)], 4, 4, 128),
        ([(1, 1)], 2, 1, 16),
    ],
)
def test_varlen_matches_the_float64_reference_per_sequence(
    shapes: list[tuple[int, int]], heads: int, kv_heads: int, dim: int
) -> None:
    gen = torch.Generator().manual_seed(len(shapes))
    qs = [torch.randn(n, heads, dim, generator=gen) * 2 for n, _ in shapes]
    ks = [torch.randn(m, kv_heads, dim, generator=gen) * 2 for _, m in shapes]
    vs = [torch.randn(m, kv_heads, dim, generator=gen) for _, m in shapes]
    q_starts, k_starts = starts_of([n for n, _ in shapes]), starts_of([m for _, m in shapes])
    scale = dim**-0.5
    got = varlen(torch.cat(qs), torch.cat(ks), torch.cat(vs), q_starts, k_starts, scale)
    assert got.shape == (sum(n for n, _ in shapes), heads, dim)
    for i, (q, k, v) in enumerate(zip(qs, ks, vs, strict=True)):
        part = got[q_starts[i] : q_starts[i + 1]]
        torch.testing.assert_close(
            part.double(), ragged_reference(q, k, v, scale), atol=2e-5, rtol=1e-5
        )


def test_varlen_fresh_rows_equal_the_padded_kernel() -> None:
    """Packed rows without a prefix give the padded kernel's numbers on their tokens."""
    q, k, v = qkv(3, 9, 3, 96, 64, seed=11)
    lens = [96, 17, 50]
    padded = op(q, k, v, 0.125)
    pack = lambda t: torch.cat([t[b, :, :n].transpose(0, 1) for b, n in enumerate(lens)])  # noqa: E731
    starts = starts_of(lens)
    got = varlen(pack(q), pack(k), pack(v), starts, starts, 0.125)
    torch.testing.assert_close(got, pack(padded), atol=1e-6, rtol=1e-6)


def test_varlen_bad_inputs_name_the_problem() -> None:
    q, k, v = torch.randn(10, 4, 16), torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    with pytest.raises(RuntimeError, match="starts must run from 0 to the row counts"):
        varlen(q, k, v, starts_of([9]), starts_of([12]), 0.25)
    with pytest.raises(RuntimeError, match=r"sequence 1 has 6 queries and 2 keys"):
        varlen(q, k, v, starts_of([4, 6]), starts_of([10, 2]), 0.25)
    with pytest.raises(RuntimeError, match="int64 CPU vectors of one length"):
        varlen(q, k, v, starts_of([10]).int(), starts_of([12]), 0.25)
    with pytest.raises(RuntimeError, match=r"\[tokens, heads, head_dim\]"):
        varlen(q[None], k, v, starts_of([10]), starts_of([12]), 0.25)
    with pytest.raises(RuntimeError, match="float32 on the CPU"):
        varlen(q.double(), k, v, starts_of([10]), starts_of([12]), 0.25)
