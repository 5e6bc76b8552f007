"""The fused CPU decode layer (``llmrt_kernels::decode_layer``) against the torch-ops decode.

The torch-ops path is the one the architecture parity suite checks against transformers;
here the same greedy runs (ragged batch with a padding row, chunked prefill, a prefix-cached
continuation) decode once fused and once through the ops, and must agree: logits within
1e-5, the same greedy tokens, the same K/V bytes in every page, and the padding row writing
nothing. Architectures with a part the op lacks must say which and decode through the ops.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_architectures_parity import case_config

from llmrt.errors import ConfigError
from llmrt.families import fused_decode
from llmrt.families.fused_decode import FusedDecode, select_decode_kernel
from llmrt.families.layers import (
    QuantizedLinear,
    apply_weight_format,
    int8_gemm_coverage,
    select_gemm_dtype,
    select_weight_layout,
)

#: Cases whose every layer the op runs, and the parts each one exercises.
FUSABLE = {
    "llama-yarn-biases": "q/k/v, o and MLP biases; YaRN-scaled RoPE tables",
    "mistral-window": "sliding window over the pages; head_dim != hidden / heads",
    "qwen2-alternating-window": "windowed and full layers in one model",
    "gemma-geglu-tied": "(1 + w) RMSNorm, GELU-tanh, embedding scale, tied head",
    "granite-multipliers": "residual multiplier, attention multiplier as the scale",
    "phi3-longrope-partial-window": "partial rotary, longrope, fused qkv/gate_up names",
    "gpt-neox-parallel-partial": "parallel residual with its own MLP LayerNorm (with bias)",
    "stablelm-sequential": "LayerNorm with bias, sequential",
    "starcoder2-window-biases": "LayerNorm with bias, plain GELU-tanh MLP, window",
    "nemotron-layernorm1p-relu2-partial": "(1 + w) LayerNorm with bias, relu², partial rotary",
    "olmo-weightless-norm-clip-qkv": "weightless LayerNorm, q/k/v clipping after the bias",
    "phi-parallel-layernorm-head-bias": "parallel residual from one LayerNorm, LM-head bias",
    "cohere-parallel-interleaved": "parallel residual from one bias-free LayerNorm",
    "qwen3-qk-norm-dynamic-rope": "per-head q/k RMSNorm before RoPE",
    "phi-parallel-partial-head-bias-qk-layernorm": "q/k LayerNorm with a bias, shared by heads",
    "cohere-interleaved-qk-norm-logit-scale": "q/k LayerNorm with a weight row per head",
    "stablelm-qk-layernorm-parallel": "q/k LayerNorm per head (stacked tensors), parallel",
}
#: Fusable variants of the parity cases: (case, config changes).
VARIANTS = {
    "phi-parallel-layernorm-head-bias": (
        "phi-parallel-partial-head-bias-qk-layernorm",
        {"qk_layernorm": False},
    ),
    "cohere-parallel-interleaved": (
        "cohere-interleaved-qk-norm-logit-scale",
        {"use_qk_norm": False},
    ),
}
#: Cases with a part the op does not implement: the status must start with
#: ``not fused: <part>``.
NOT_FUSABLE = {
    "olmo2-post-norm-qk-norm": "post-attention",
    "gemma2-softcap-window": "post-attention",
    "mixtral-top2-window": "mixture-of-experts",
    "gpt2": "learned position embeddings",
}


@pytest.fixture
def counted_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many decode steps ran through ``FusedDecode.step`` (rows of each)."""
    calls: list[int] = []
    original = FusedDecode.step

    def step(self: FusedDecode, *, tokens: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        calls.append(int(tokens.shape[0]))
        return original(self, tokens=tokens, **kwargs)

    monkeypatch.setattr(FusedDecode, "step", step)
    return calls


def _build(case: str, parity_harness: Any, *, weights: str | None = None) -> Any:
    base, changes = VARIANTS.get(case, (case, {}))
    harness = parity_harness(config=case_config(base, **changes))
    if weights is not None:
        apply_weight_format(harness.model, weights=weights, field="checkpoint.weights")
    return harness


def _run(
    harness: Any,
    *,
    fused: bool,
    kv_dtype: torch.dtype = torch.float32,
    rows: int = 3,
    pad_row: bool = True,
) -> tuple[list[Any], list[torch.Tensor]]:
    """Greedy runs of ``rows`` prompts (and a padding row) over a noise-filled cache (stored
    as ``kv_dtype``); returns the runs and the cache afterwards."""
    harness.model.backbone.fused_decode = fused
    bound: list[Any] = []
    bind = harness.bind

    def noisy_bind(**_: Any) -> Any:
        kv, pool = bind(fill_seed=7)
        kv.keys = [t.to(kv_dtype) for t in kv.keys]
        kv.values = [t.to(kv_dtype) for t in kv.values]
        harness.model.set_kv_cache(kv)
        bound.append(kv)
        return kv, pool

    harness.bind = noisy_bind
    try:
        lengths = [(14, 9, 12)[i % 3] + i // 3 for i in range(rows)]
        prompts = [harness.prompt(n, seed=30 + i) for i, n in enumerate(lengths)]
        cuts = [([5, 8], [], [6])[i % 3] for i in range(rows)]
        runs = harness.greedy(prompts, cuts=cuts, align="end", pad_row=pad_row, steps=12)
    finally:
        del harness.bind
    return runs, bound[0].snapshot()


def _run_both(
    harness: Any, kv_dtype: torch.dtype = torch.float32, rows: int = 3, pad_row: bool = True
) -> tuple[list[Any], list[Any], list[torch.Tensor], list[torch.Tensor]]:
    fused, fused_kv = _run(harness, fused=True, kv_dtype=kv_dtype, rows=rows, pad_row=pad_row)
    ops, ops_kv = _run(harness, fused=False, kv_dtype=kv_dtype, rows=rows, pad_row=pad_row)
    return fused, ops, fused_kv, ops_kv


@pytest.mark.parametrize(
    ("case", "rows", "pad_row"),
    [(case, 3, True) for case in sorted(FUSABLE)]
    + [("llama-yarn-biases", 8, True), ("gemma-geglu-tied", 8, True)]
    + [("llama-yarn-biases", 1, False), ("mistral-window", 1, False)]
    + [("gpt-neox-parallel-partial", 8, True), ("nemotron-layernorm1p-relu2-partial", 8, True)]
    + [("phi-parallel-layernorm-head-bias", 1, False)]
    + [("cohere-interleaved-qk-norm-logit-scale", 1, False)]
    + [("qwen3-qk-norm-dynamic-rope", 8, True)],
)
def test_fused_decode_matches_torch_ops(
    case: str, rows: int, pad_row: bool, parity_harness: Any, counted_runs: list[int]
) -> None:
    """3 prompts and a padding row: each thread keeps its own residual stream; 8 and a
    padding row (more than ``kPrivateRows``): the team shares it, split by rows; 1 prompt
    (2 KV heads: fewer attention tasks than twice a 2-thread team): each task's keys are
    split in parts and merged."""
    harness = _build(case, parity_harness)
    assert harness.model.backbone.fused_decode_status() is None
    fused, ops, fused_kv, ops_kv = _run_both(harness, rows=rows, pad_row=pad_row)
    assert counted_runs, "the fused path never ran"
    assert max(counted_runs) == rows + pad_row
    for a, b in zip(fused, ops, strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-5)
    # Same bytes in every page, padding row and unused blocks included (the cache was
    # filled with seeded noise first, so a stray write would show).
    for a, b in zip(fused_kv, ops_kv, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 24, 32, 64, 128])
def test_fused_attention_over_head_dims(
    head_dim: int, parity_harness: Any, counted_runs: list[int]
) -> None:
    """Head dims of 16, 32, 64 and 128 take the op's register-tiled attention, others
    its generic loop; both must match the torch ops."""
    harness = parity_harness(config=case_config("llama-yarn-biases", head_dim=head_dim))
    fused, ops, fused_kv, ops_kv = _run_both(harness)
    assert counted_runs
    for a, b in zip(fused, ops, strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-5)
    for a, b in zip(fused_kv, ops_kv, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "rows"),
    [(2, 2, 16, 3), (6, 2, 64, 3), (6, 2, 64, 1), (8, 2, 16, 3), (10, 2, 32, 1), (8, 1, 128, 3)],
)
def test_fused_attention_over_query_groups(
    heads: int,
    kv_heads: int,
    head_dim: int,
    rows: int,
    parity_harness: Any,
    counted_runs: list[int],
) -> None:
    """1, 3, 4, 5 and 8 query heads per KV head: the op scores up to 4 (head_dim 128: 2)
    query heads per pass over a 16-key block, so 5 and 8 take several passes; 1 row splits
    each head's keys in parts. Contexts of 9-26 keys on 32-key pages end 16-key blocks
    mid-way."""
    config = case_config(
        "llama-yarn-biases",
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=16 * heads,  # transformers wants a multiple of the head count
    )
    harness = parity_harness(config=config)
    harness.block_size = 32  # page runs of up to 26 keys: a whole 16-key block and a tail
    fused, ops, fused_kv, ops_kv = _run_both(harness, rows=rows, pad_row=rows > 1)
    assert counted_runs
    for a, b in zip(fused, ops, strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-5)
    for a, b in zip(fused_kv, ops_kv, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", ["llama-yarn-biases", "mistral-window"])
@pytest.mark.parametrize("block_size", [4, 32])
def test_fused_decode_over_half_precision_kv(
    case: str, kv_dtype: torch.dtype, block_size: int, parity_harness: Any, counted_runs: list[int]
) -> None:
    # 32-key pages (the default recipe's): long runs of keys within a page, as served.
    harness = _build(case, parity_harness)
    harness.block_size = block_size
    fused, ops, fused_kv, ops_kv = _run_both(harness, kv_dtype)
    assert counted_runs
    # Logits: the float32 summation-order differences (1e-5 with a float32 cache) pass through
    # K/V rounded to 8-11 mantissa bits, measured up to 3.4e-4 here.
    for a, b in zip(fused, ops, strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-3)
    # Both paths round the same float32 K/V to the cache dtype (round to nearest even).
    for a, b in zip(fused_kv, ops_kv, strict=True):
        assert a.dtype == kv_dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=1e-2)


@pytest.mark.parametrize("layout", ["ggml", "interleaved"])
@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize("rows", [3, 17])
def test_fused_decode_over_block_quantized_weights(
    weights: str, layout: str, rows: int, parity_harness: Any, counted_runs: list[int]
) -> None:
    # 17 prompts and a padding row: interleaved linears of 16 rows or more run the integer
    # GEMM, split across the team by panels of output columns (the ops path: one call).
    harness = _build("llama-yarn-biases", parity_harness, weights=weights)
    select_weight_layout(harness.model, choice=layout, device=torch.device("cpu"))
    linears = [m for m in harness.model.modules() if isinstance(m, QuantizedLinear)]
    assert linears and {m.weight.layout for m in linears} == {layout}
    fused, ops, fused_kv, ops_kv = _run_both(harness, rows=rows)
    assert counted_runs and max(counted_runs) == rows + 1
    # Interleaved: both paths run the same integer kernels, but a float32 summation-order
    # difference upstream (1e-5) can move an activation across an 8-bit rounding boundary,
    # a step of 1/65024 of its block's largest value (measured 1.5e-4 on logits, 1.7e-4 on K/V).
    logit_tol, kv_tol = (1e-4, 1e-5) if layout == "ggml" else (1e-3, 1e-3)
    for a, b in zip(fused, ops, strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=logit_tol)
    for a, b in zip(fused_kv, ops_kv, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=kv_tol)


@pytest.mark.parametrize("case", sorted(NOT_FUSABLE))
def test_unfusable_layers_say_why_and_use_the_ops(
    case: str, parity_harness: Any, counted_runs: list[int]
) -> None:
    harness = _build(case, parity_harness)
    why = harness.model.backbone.fused_decode_status()
    assert why is not None and why.startswith(f"not fused: {NOT_FUSABLE[case]}")
    with pytest.raises(ConfigError, match=r"device\.decode_kernel"):
        select_decode_kernel(harness.model, choice="fused", device=torch.device("cpu"))
    assert select_decode_kernel(harness.model, choice="auto", device=torch.device("cpu")) == why
    harness.check_single_prompt()
    assert counted_runs == []


def test_ops_choice_turns_the_fused_path_off(parity_harness: Any, counted_runs: list[int]) -> None:
    harness = _build("llama-yarn-biases", parity_harness)
    assert select_decode_kernel(harness.model, choice="fused", device=torch.device("cpu")) is None
    harness.check_single_prompt()
    assert counted_runs
    counted_runs.clear()
    assert select_decode_kernel(harness.model, choice="ops", device=torch.device("cpu"))
    harness.check_single_prompt()
    assert counted_runs == []
    with pytest.raises(ConfigError, match="must be one of"):
        select_decode_kernel(harness.model, choice="fast", device=torch.device("cpu"))


def test_auto_takes_the_ops_where_the_kernels_have_no_openmp(
    parity_harness: Any, counted_runs: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library built without OpenMP (Apple clang) would run the step's team on one thread:
    ``auto`` says so and takes the ops; ``fused`` still runs it (and stays correct)."""
    import llmrt.families.fused_decode as fused_decode

    if not fused_decode.vector_kernels():
        pytest.skip("auto already takes the ops at this level (no vector loops)")
    harness = _build("llama-yarn-biases", parity_harness)
    monkeypatch.setattr(fused_decode, "kernels_openmp", lambda: False)
    why = select_decode_kernel(harness.model, choice="auto", device=torch.device("cpu"))
    assert why is not None and "without OpenMP" in why
    harness.check_single_prompt()
    assert counted_runs == []
    assert select_decode_kernel(harness.model, choice="fused", device=torch.device("cpu")) is None


def _decode(harness: Any) -> torch.Tensor:
    """One decode step of two rows at positions 3 and 5 over blocks 1 and 2 of the bound cache."""
    table = torch.tensor([[1, 0], [2, 0]], dtype=torch.int32)
    return harness.model.decode_forward(
        tokens=torch.tensor([4, 9]),
        positions=torch.tensor([3, 5], dtype=torch.int32),
        page_table=table,
    ).clone()


def test_the_bound_step_reads_the_binding_of_the_moment(parity_harness: Any) -> None:
    """A fused step borrows the model's KV caches and RoPE tables once; a new KV binding,
    resized RoPE tables or an unbound cache make it let go (no stale reads, nothing held)."""
    harness = _build("llama-yarn-biases", parity_harness)
    model, backbone = harness.model, harness.model.backbone
    harness.bind(fill_seed=1)
    first = _decode(harness)
    fused = backbone._fused_plan()
    assert backbone.decode_fast is fused and fused.bound_kv is model._kv
    assert fused._stack.has_cache()
    assert fused._entry is not None  # the library imports as a Python module too
    # Another cache (other noise): the bound step reads it, as the ops do.
    harness.bind(fill_seed=2)
    assert backbone.decode_fast is None and not fused._stack.has_cache()
    again = _decode(harness)
    assert backbone.decode_fast is fused and fused.bound_kv is model._kv
    harness.bind(fill_seed=2)
    backbone.fused_decode = False
    ops = _decode(harness)
    backbone.fused_decode = True
    torch.testing.assert_close(again, ops, rtol=0, atol=1e-5)
    assert not torch.allclose(first, again, atol=1e-3)  # it did not read the first cache
    # Resized RoPE tables are new tensors: the stack lets go of the old ones.
    harness.bind(fill_seed=2)
    _decode(harness)
    backbone.reserve_positions(backbone._rope_rows // 2)
    assert backbone.decode_fast is None and not fused._stack.has_cache()
    torch.testing.assert_close(_decode(harness), ops, rtol=0, atol=1e-5)
    # Unbound: nothing of the cache stays borrowed.
    model.set_kv_cache(None)
    assert backbone.decode_fast is None and fused.bound_kv is None
    assert not fused._stack.has_cache()


def test_the_bound_step_refuses_to_run_unbound(parity_harness: Any) -> None:
    harness = _build("llama-yarn-biases", parity_harness)
    fused = harness.model.backbone._fused_plan()
    rows = {
        "tokens": torch.tensor([4]),
        "positions": torch.tensor([3]),
        "page_table": torch.tensor([[1]]),
    }
    with pytest.raises(RuntimeError, match="before bind"):
        fused.step_bound(**rows)
    with pytest.raises(RuntimeError, match="needs bind_cache first"):
        fused._stack.step_bound(rows["tokens"], rows["positions"], rows["page_table"])
    with pytest.raises(RuntimeError, match="one K and one V cache per layer"):
        fused._stack.bind_cache([], [], [], [])


def test_batches_from_the_gemm_threshold_use_the_ops(
    parity_harness: Any, counted_runs: list[int]
) -> None:
    harness = _build("llama-yarn-biases", parity_harness)
    prompts = [harness.prompt(5, seed=s) for s in range(fused_decode.MAX_ROWS_DENSE)]
    harness.greedy(prompts, steps=2)
    assert counted_runs == []


@pytest.mark.parametrize(
    ("layout", "choice"),
    [("interleaved", "int8"), ("ggml", "bfloat16")],
    ids=["int8-one-level", "bfloat16-dequantized"],
)
def test_decode_batches_from_the_gemm_dtype_threshold_multiply_in_it(
    layout: str, choice: str, parity_harness: Any, counted_runs: list[int]
) -> None:
    """``device.gemm_dtype_min_rows`` means the same whichever path a step takes: a decode
    batch of that many rows multiplies in ``gemm_dtype`` (int8: one activation level;
    bfloat16: dequantized weights), which the op does not, so it runs the torch ops; one row
    fewer stays fused."""
    harness = _build("llama-yarn-biases", parity_harness, weights="int4")
    select_weight_layout(harness.model, choice=layout, device=torch.device("cpu"))
    if choice == "int8" and int8_gemm_coverage(harness.model)[0] == 0:
        pytest.skip("no int8 GEMM at this instruction-set level")
    rows = 15  # and a padding row: 16-row steps
    reference, _ = _run(harness, fused=True, rows=rows)
    assert max(counted_runs) == rows + 1  # the plan is built before the threshold changes
    counted_runs.clear()

    select_gemm_dtype(harness.model, choice=choice, min_rows=rows + 1)
    fused, fused_kv = _run(harness, fused=True, rows=rows)
    assert rows + 1 not in counted_runs
    ops, ops_kv = _run(harness, fused=False, rows=rows)
    for a, b in zip(fused, ops, strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-6)
    for a, b in zip(fused_kv, ops_kv, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    moved = max(
        float((a.logits - b.logits).abs().max()) for a, b in zip(fused, reference, strict=True)
    )
    assert moved > 1e-3, f"no {choice} GEMM ran"

    counted_runs.clear()
    select_gemm_dtype(harness.model, choice=choice, min_rows=rows + 2)
    _run(harness, fused=True, rows=rows)
    assert max(counted_runs) == rows + 1


def test_the_bound_step_leaves_batches_from_the_gemm_dtype_threshold_to_the_ops(
    parity_harness: Any,
) -> None:
    """The fast path a fused step leaves behind (``decode_fast``) takes smaller steps only:
    3 rows fused, 16 through the ops (int8 from 16 rows), 3 fused again."""
    harness = _build("llama-yarn-biases", parity_harness, weights="int4")
    select_weight_layout(harness.model, choice="interleaved", device=torch.device("cpu"))
    if int8_gemm_coverage(harness.model)[0] == 0:
        pytest.skip("no int8 GEMM at this instruction-set level")
    select_gemm_dtype(harness.model, choice="int8", min_rows=16)
    backbone, model = harness.model.backbone, harness.model
    harness.bind(fill_seed=1)

    def step(rows: int, position: int) -> None:
        model.decode_forward(
            tokens=torch.arange(rows) + 3,
            positions=torch.full((rows,), position, dtype=torch.int32),
            page_table=torch.tensor([[1, 0]] * rows, dtype=torch.int32),
        )

    step(3, 2)
    fast = backbone.decode_fast
    assert fast is not None and fast.max_rows == 16
    calls: list[int] = []
    bound = fast.step_bound

    def counted(**kwargs: Any) -> torch.Tensor:
        calls.append(int(kwargs["tokens"].shape[0]))
        return bound(**kwargs)

    fast.step_bound = counted  # type: ignore[method-assign]
    step(16, 3)
    step(3, 4)
    assert calls == [3]


def test_the_op_rejects_mismatched_inputs_by_name() -> None:
    from llmrt.kernels.native import load_kernels

    load_kernels()
    hidden, heads, kv_heads, dim = 32, 2, 1, 16
    w = lambda n, k: torch.randn(n, k)  # noqa: E731
    norm = torch.ones(hidden)
    cache = torch.zeros(4, kv_heads, 8, dim)
    args = dict(
        attn_norm=norm, mlp_norm=norm,
        qkv=w((heads + 2 * kv_heads) * dim, hidden), qkv_kind=0, qkv_bias=None,
        o=w(hidden, heads * dim), o_kind=0, o_bias=None,
        up=w(2 * 24, hidden), up_kind=0, up_bias=None,
        down=w(hidden, 24), down_kind=0, down_bias=None,
        cos=torch.ones(1, dim), sin=torch.zeros(1, dim),
        k_cache=cache, v_cache=cache.clone(),
        page_table=torch.zeros(1, 4, dtype=torch.int32),
        positions=torch.zeros(1, dtype=torch.int64),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, eps=1e-6, scale=0.25,
        window=0, activation=0, gated=True, residual_multiplier=1.0,
    )  # fmt: skip
    op = torch.ops.llmrt_kernels.decode_layer
    op(torch.randn(1, hidden), **args)  # well-formed: runs
    bad_cases = {
        "qkv has": {"qkv": w(3 * dim, hidden)},
        "KV caches must be": {"k_cache": torch.zeros(4, 2, 8, dim)},
        "one position per row": {"positions": torch.zeros(2, dtype=torch.int64)},
        "norm weights must hold": {"attn_norm": torch.ones(hidden + 1)},
        "cos/sin": {"cos": torch.ones(1, dim + 2), "sin": torch.zeros(1, dim + 2)},
    }
    for message, change in bad_cases.items():
        with pytest.raises(RuntimeError, match=message):
            op(torch.randn(1, hidden), **{**args, **change})


def _stack_layer(hidden: int, heads: int, kv_heads: int, dim: int, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    w = lambda n, k: torch.randn(n, k, generator=gen) * 0.1  # noqa: E731
    tensors = [
        1.0 + 0.1 * torch.randn(hidden, generator=gen),
        1.0 + 0.1 * torch.randn(hidden, generator=gen),
        w((heads + 2 * kv_heads) * dim, hidden),
        w(hidden, heads * dim),
        w(2 * 24, hidden),
        w(hidden, 24),
    ]
    biases = [0.1 * torch.randn((heads + 2 * kv_heads) * dim, generator=gen), None, None, None]
    biases += [None] * 6  # the norms' biases (RMSNorm: none), no q/k norms
    # ... window 0, SiLU, gated, RoPE table 0; RMSNorm (0) both, sequential, no q/k norms.
    ints = [0, 0, 0, 0, heads, kv_heads, dim, 0, 0, 1, 0, 0, 0, 0, -1]
    floats = [1e-6, dim**-0.5, 1.0, 1e-6, math.inf, 0.0]  # ..., MLP norm eps, no clip
    return tensors, biases, ints, floats


def _stack(layers: list[tuple]) -> Any:
    """A ``DecodeStack`` over ``_stack_layer`` tuples (their arguments concatenated)."""
    return torch.classes.llmrt_kernels.DecodeStack(
        *([x for layer in layers for x in layer[part]] for part in range(4))
    )


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    """torch's thread count set to ``count`` inside, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_the_stack_runs_layers_as_the_single_layer_op_does() -> None:
    """One ``DecodeStack`` call over two layers equals two ``decode_layer`` calls: the same
    hidden state and the same bytes written to each layer's cache."""
    from llmrt.kernels.native import load_kernels

    load_kernels()
    hidden, heads, kv_heads, dim = 32, 2, 1, 16
    layers = [_stack_layer(hidden, heads, kv_heads, dim, seed) for seed in (1, 2)]
    stack = _stack(layers)
    assert stack.num_layers() == 2
    x = torch.randn(3, hidden)
    cos, sin = torch.rand(3, dim), torch.rand(3, dim)
    caches = [torch.randn(4, kv_heads, 8, dim) for _ in range(4)]
    table = torch.tensor([[0, 1, -1, -1], [2, -1, -1, -1], [3, -1, -1, -1]], dtype=torch.int32)
    positions = torch.tensor([9, 3, -1])
    got, got_caches = x.clone(), [c.clone() for c in caches]
    stack.run(got, [cos], [sin], got_caches[:2], got_caches[2:], table, positions)
    want, want_caches = x.clone(), [c.clone() for c in caches]
    for i, (tensors, biases, _ints, floats) in enumerate(layers):
        attn_norm, mlp_norm, qkv, o, up, down = tensors
        torch.ops.llmrt_kernels.decode_layer(
            want, attn_norm, mlp_norm, qkv, 0, biases[0], o, 0, None, up, 0, None, down, 0,
            None, cos, sin, want_caches[i], want_caches[2 + i], table, positions,
            heads, kv_heads, dim, floats[0], floats[1], 0, 0, True, 1.0,
        )  # fmt: skip
    assert torch.equal(got, want)
    for a, b in zip(got_caches, want_caches, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(got, x)

    one = _stack_layer(hidden, heads, kv_heads, dim, 3)
    with pytest.raises(RuntimeError, match="per layer 6 tensors"):
        torch.classes.llmrt_kernels.DecodeStack(one[0][:5], one[1], one[2], one[3])
    wide = _stack_layer(hidden * 2, heads, kv_heads, dim, 4)
    with pytest.raises(RuntimeError, match="different widths"):
        torch.classes.llmrt_kernels.DecodeStack(
            one[0] + wide[0], one[1] + wide[1], one[2] + wide[2], one[3] + wide[3]
        )
    with pytest.raises(RuntimeError, match="one K and one V cache per layer"):
        stack.run(x.clone(), [cos], [sin], caches[:1], caches[2:3], table, positions)
    with pytest.raises(RuntimeError, match="RoPE table 0 is not given"):
        stack.run(x.clone(), [], [], caches[:2], caches[2:], table, positions)


def test_rows_reading_missing_pages_see_every_write_of_the_step() -> None:
    """A ``-1`` page reads block 0 (padding rows do), which another row may write in the same
    step: the team must finish every write before any attention reads, so two threads give
    the one-thread result every time. A stress test: the race it guards against showed in
    about one run in three."""
    from llmrt.kernels.native import load_kernels

    load_kernels()
    hidden, heads, kv_heads, dim = 32, 6, 3, 16
    layers = [_stack_layer(hidden, heads, kv_heads, dim, seed) for seed in (1, 2)]
    stack = _stack(layers)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, hidden, generator=gen)
    cos, sin = torch.rand(4, dim, generator=gen), torch.rand(4, dim, generator=gen)
    caches = [torch.randn(8, kv_heads, 8, dim, generator=gen) for _ in range(4)]
    # Row 2 writes block 0 (offset 5); rows 1 and 3 read block 0 through their -1 pages.
    table = torch.tensor(
        [[6, -1, -1, -1], [2, -1, -1, -1], [0, 3, -1, -1], [7, -1, -1, -1]], dtype=torch.int32
    )
    positions = torch.tensor([5, 35, 5, 36])

    def run(count: int) -> torch.Tensor:
        y = x.clone()
        copies = [c.clone() for c in caches]
        with _threads(count):
            stack.run(y, [cos], [sin], copies[:2], copies[2:], table, positions)
        return y

    want = run(1)
    for _ in range(20):
        assert torch.equal(run(2), want)


def test_a_row_with_no_keys_in_its_window_attends_to_nothing_on_any_team() -> None:
    """A position past its pages with a sliding window leaves no keys: the attention output is
    zeros (not NaN) whether one thread runs the row or two split its keys and merge them."""
    from llmrt.kernels.native import load_kernels

    load_kernels()
    hidden, heads, kv_heads, dim = 32, 2, 1, 16
    tensors, biases, ints, floats = _stack_layer(hidden, heads, kv_heads, dim, 1)
    ints = [*ints[:7], 4, *ints[8:]]  # window of 4 keys
    stack = _stack([(tensors, biases, ints, floats)])
    x = torch.randn(1, hidden)
    cos, sin = torch.rand(1, dim), torch.rand(1, dim)
    caches = [torch.randn(2, kv_heads, 8, dim) for _ in range(2)]
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    outs = []
    for count in (1, 2):
        y = x.clone()
        with _threads(count):
            stack.run(y, [cos], [sin], [caches[0].clone()], [caches[1].clone()], table,
                      torch.tensor([40]))  # fmt: skip
        outs.append(y)
    assert all(torch.isfinite(y).all() for y in outs)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)


#: A child process pinned to one CPU runs the stack on a team larger than it: every barrier
#: crossing has a waiter that must give the CPU back to the thread it waits for.
_OVERSUBSCRIBED_CHILD = """
import os, sys
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import torch
sys.path.insert(0, sys.argv[1])
from test_fused_decode import _oversubscribed_runs
want, got = _oversubscribed_runs(threads=int(sys.argv[2]))
for y in got:
    assert torch.equal(y, got[0])
torch.testing.assert_close(got[0], want, rtol=0, atol=1e-5)
print("steps", len(got))
"""


def _oversubscribed_runs(*, threads: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The two-layer stack's step on one thread, then 30 steps on ``threads`` threads (each
    from the same inputs): the child of the oversubscription test."""
    from llmrt.kernels.native import load_kernels

    load_kernels()
    hidden, heads, kv_heads, dim = 32, 6, 3, 16
    layers = [_stack_layer(hidden, heads, kv_heads, dim, seed) for seed in (1, 2)]
    stack = _stack(layers)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, hidden, generator=gen)
    cos, sin = torch.rand(3, dim, generator=gen), torch.rand(3, dim, generator=gen)
    caches = [torch.randn(8, kv_heads, 8, dim, generator=gen) for _ in range(4)]
    table = torch.tensor([[6, 1, -1, -1], [2, -1, -1, -1], [0, 3, 4, -1]], dtype=torch.int32)
    positions = torch.tensor([12, 5, 20])

    def run(count: int) -> torch.Tensor:
        y = x.clone()
        copies = [c.clone() for c in caches]
        with _threads(count):
            stack.run(y, [cos], [sin], copies[:2], copies[2:], table, positions)
        return y

    want = run(1)
    return want, [run(threads) for _ in range(30)]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
@pytest.mark.parametrize("threads", [2, 6])
def test_a_team_larger_than_its_cpus_finishes_with_the_one_thread_result(threads: int) -> None:
    """Pinned to one CPU, a team of 2 or 6 threads runs the fused stack step after step to
    the same result each time, the one-thread result within rounding (a larger team splits
    the attention over key parts). A waiter that spins or yields instead of sleeping holds the CPU
    the late thread needs (a step stalled for minutes on a loaded host); the child's time
    limit is far beyond what the steps take, so only a stall fails it."""
    here = Path(__file__).resolve().parent
    run = subprocess.run(
        [sys.executable, "-c", _OVERSUBSCRIBED_CHILD, str(here), str(threads)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=here.parents[1],
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "steps 30" in run.stdout


@pytest.mark.parametrize("rows", [2, 7])
@pytest.mark.parametrize("embed_kind", ["float32", "q8_0"])
def test_a_step_is_embedding_layers_norm_and_head(rows: int, embed_kind: str) -> None:
    """``DecodeStack.step`` from token ids equals the embedding rows (scaled) through
    ``run``, then RMSNorm and the LM head with its bias, all stated with torch ops here;
    ids past the table read its last row, RoPE rows come from the caches at each position."""
    from llmrt.kernels.formats import GGML_TYPE, quantize
    from llmrt.kernels.native import load_kernels

    load_kernels()
    gen = torch.Generator().manual_seed(5)
    hidden, heads, kv_heads, dim, vocab = 32, 2, 1, 16, 40
    layers = [_stack_layer(hidden, heads, kv_heads, dim, seed) for seed in (1, 2)]
    stack = _stack(layers)
    table_f = torch.randn(vocab, hidden, generator=gen)
    if embed_kind == "q8_0":
        blocks = quantize(table_f, kind="q8_0", field="embed")
        embed, kind, dense = blocks.blocks, GGML_TYPE["q8_0"], blocks.dequantize()
    else:
        embed, kind, dense = table_f, 0, table_f
    norm = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
    head = torch.randn(vocab + 3, hidden, generator=gen) * 0.1
    head_bias = torch.randn(vocab + 3, generator=gen)
    stack.set_ends(embed, kind, 1.5, norm, 1e-6, head, 0, head_bias, None, 0)
    assert stack.has_ends()
    cos_cache = torch.rand(64, dim // 2, generator=gen)
    sin_cache = torch.rand(64, dim // 2, generator=gen)
    tokens = torch.tensor([3, vocab + 7, 0, 11, 5, 39, 2][:rows])
    positions = torch.tensor([9, 3, -1, 0, 12, 20, 7][:rows])
    table = torch.arange(rows * 4, dtype=torch.int32).reshape(rows, 4)
    caches = [torch.randn(rows * 4, kv_heads, 8, dim, generator=gen) for _ in range(4)]

    got_caches = [c.clone() for c in caches]
    logits = stack.step(tokens, positions, table, [cos_cache], [sin_cache], got_caches[:2],
                        got_caches[2:])  # fmt: skip

    want_caches = [c.clone() for c in caches]
    state = dense[tokens.clamp(max=vocab - 1)] * 1.5
    where = positions.clamp(min=0)
    cos = torch.cat([cos_cache[where]] * 2, dim=-1)
    sin = torch.cat([sin_cache[where]] * 2, dim=-1)
    stack.run(state, [cos], [sin], want_caches[:2], want_caches[2:], table, positions)
    normed = torch.nn.functional.rms_norm(state, (hidden,), eps=1e-6) * norm
    want = normed @ head.t() + head_bias
    assert logits.shape == (rows, vocab + 3)
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)
    for a, b in zip(got_caches, want_caches, strict=True):
        assert torch.equal(a, b)

    with pytest.raises(RuntimeError, match="final norm weight must hold"):
        stack.set_ends(embed, kind, 1.0, torch.ones(hidden + 1), 1e-6, head, 0, None, None, 0)
    with pytest.raises(RuntimeError, match="head_bias"):
        stack.set_ends(embed, kind, 1.0, norm, 1e-6, head, 0, torch.ones(2), None, 0)
    with pytest.raises(RuntimeError, match="one position per token"):
        stack.step(tokens, positions[:1], table, [cos_cache], [sin_cache], caches[:2], caches[2:])
    with pytest.raises(RuntimeError, match="RoPE tables"):
        stack.step(tokens, positions, table, [cos_cache.t()], [sin_cache.t()], caches[:2],
                   caches[2:])  # fmt: skip
    bare = _stack(layers[:1])
    with pytest.raises(RuntimeError, match="set_ends first"):
        bare.step(tokens, positions, table, [cos_cache], [sin_cache], caches[:1], caches[2:3])


def test_recipes_choose_the_decode_kernel_through_the_container(counted_runs: list[int]) -> None:
    from llmrt.sampling.params import SamplingParams
    from llmrt.serving.llm import LLM

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outputs = {}
    for choice in ("fused", "ops"):
        counted_runs.clear()
        with LLM.from_recipe("tiny-llama", overrides={"device.decode_kernel": choice}) as llm:
            outputs[choice] = [o.token_ids for o in llm.generate([[3, 4, 5]], params)]
        assert bool(counted_runs) == (choice == "fused")
    assert outputs["fused"] == outputs["ops"]
    # GPT-2's learned positions are not a part the op has: asking for it fails at build,
    # naming the part and where it is.
    with pytest.raises(
        ConfigError,
        match=r"device\.decode_kernel: .* not fused: learned position embeddings "
        r"\(embed_positions\)",
    ):
        LLM.from_recipe("tiny-gpt2", overrides={"device.decode_kernel": "fused"})


@pytest.mark.parametrize("entry", [4, -2, 1 << 40], ids=["past-pool", "below-minus-one", "huge"])
def test_a_page_table_outside_the_pool_raises_before_anything_is_written(entry: int) -> None:
    """Every page-table entry is checked against every layer's KV pool once per step, before
    any write: an entry past the pool (or below -1) is an error naming the entry, and the
    hidden state and both caches keep their bytes (the row at position 9 would have written
    through its second page)."""
    from llmrt.kernels.native import load_kernels

    load_kernels()
    hidden, heads, kv_heads, dim = 32, 2, 1, 16
    layers = [_stack_layer(hidden, heads, kv_heads, dim, seed) for seed in (1, 2)]
    stack = _stack(layers)
    x = torch.randn(2, hidden)
    cos, sin = torch.rand(2, dim), torch.rand(2, dim)
    caches = [torch.randn(4, kv_heads, 8, dim) for _ in range(4)]
    table = torch.tensor([[0, 1, -1], [2, entry, 3]], dtype=torch.int64)
    positions = torch.tensor([9, 3])
    got, got_caches = x.clone(), [c.clone() for c in caches]
    with pytest.raises(IndexError, match=rf"page_table\[1, 1\] = {entry} is not a block"):
        stack.run(got, [cos], [sin], got_caches[:2], got_caches[2:], table, positions)
    assert torch.equal(got, x)
    for a, b in zip(got_caches, caches, strict=True):
        assert torch.equal(a, b)
    # A pool smaller in one layer bounds the table for all of them.
    short_k = [caches[0][:2].clone(), caches[1].clone()]
    short_v = [caches[2][:2].clone(), caches[3].clone()]
    ok_table = torch.tensor([[0, 1, -1], [2, -1, 3]])
    with pytest.raises(IndexError, match=r"page_table\[1, 0\] = 2 .*\(0\.\.1\)"):
        stack.run(x.clone(), [cos], [sin], short_k, short_v, ok_table, positions)


def test_the_fused_step_turns_a_bad_page_table_into_a_device_error(parity_harness: Any) -> None:
    """Through the model's fused step (the pybind11 entry), a table entry past the pool is a
    ``DeviceError`` and the bound caches keep their bytes."""
    from llmrt.errors import DeviceError

    harness = _build("llama-yarn-biases", parity_harness)
    model = harness.model
    harness.bind(fill_seed=1)
    _decode(harness)  # the fused plan is built and bound
    keys = [k.clone() for k in model._kv.keys]
    blocks = model._kv.keys[0].shape[0]
    with pytest.raises(DeviceError, match="is not a block of the KV pool"):
        model.decode_forward(
            tokens=torch.tensor([4]),
            positions=torch.tensor([3], dtype=torch.int32),
            page_table=torch.tensor([[blocks]], dtype=torch.int32),
        )
    for a, b in zip(model._kv.keys, keys, strict=True):
        assert torch.equal(a, b)


def test_the_fused_status_names_a_device_other_than_the_cpu(
    parity_harness: Any, torch_device: str, counted_runs: list[int]
) -> None:
    """The status (what ``llmrt bench`` reports) never builds the CPU-only op from weights on
    another device: it says where they are, and decoding there takes the torch ops."""
    harness = parity_harness(config=case_config("llama-yarn-biases"), device=torch_device)
    why = harness.model.backbone.fused_decode_status()
    if torch_device == "cpu":
        assert why is None
    else:
        assert why == f"not fused: the weights are on {torch_device} (the fused op runs on the CPU)"
        harness.check_single_prompt()
        assert counted_runs == []
