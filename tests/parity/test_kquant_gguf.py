"""GGUF files in the block types llama.cpp's K-quant mixes write, run from their blocks and
checked against transformers loading the same file (it dequantizes every tensor with gguf-py).

Two sources: a tiny Llama written here with gguf-py whose tensors are random valid blocks of
every kernel kind (no binary needed), and SmolLM2 requantized by llama.cpp's own
``llama-quantize`` to Q4_K_M, Q5_K_M, Q6_K and Q8_0 (only where that binary exists).

Logit bound: the kernels quantize activations per 32 values in two 8-bit levels
(``csrc/kquants.cpp``; the K-quant GEMVs at AVX2 below AVX-512 VNNI per 256), ~1.6e-5 of
each group's largest value; over a few layers that moved
the tiny model's logits (magnitude ~5) by under 1e-3, and SmolLM2's (magnitude ~20) by about
1e-2 like the interleaved Q4 layout, whose bound (2e-2) is asserted here too.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from conftest import NEEDS_SMOLLM2, SMOLLM2_PACKAGE, Harness

import llmrt.weights.gguf as gguf_module
from llmrt.errors import CheckpointError
from llmrt.families.fused_decode import select_decode_kernel
from llmrt.families.layers import (
    FrozenLinear,
    QuantizedEmbedding,
    QuantizedLinear,
    StackedLinear,
    select_linear_kernel,
)
from llmrt.families.llama import FAMILY
from llmrt.kernels.formats import QuantizedWeight
from llmrt.kernels.native import kernels_available
from llmrt.testing.gguf_blocks import random_blocks
from llmrt.weights import load_checkpoint
from llmrt.weights.package_data import package_file

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not kernels_available()[0], reason="needs the CPU kernels")

LOGIT_BOUND = 2e-2
STEPS = 8
HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 288
#: The tiny model's tensor types per layer: every kernel kind, q/k/v in different kinds (a
#: stacked projection) in layer 0 and alike in layer 1 (one fused weight).
LAYER_KINDS = (
    {"attn_q": "q4_k", "attn_k": "q4_k", "attn_v": "q6_k", "attn_output": "q5_0",
     "ffn_gate": "q4_k", "ffn_up": "q5_k", "ffn_down": "q6_k"},
    {"attn_q": "q5_1", "attn_k": "q5_1", "attn_v": "q5_1", "attn_output": "bf16",
     "ffn_gate": "f16", "ffn_up": "f16", "ffn_down": "q4_k"},
)  # fmt: skip
EMBED_KIND, OUTPUT_KIND = "q4_k", "q6_k"


def _add(writer: gguf.GGUFWriter, name: str, kind: str, rows: int, k: int, seed: int) -> None:
    blocks = random_blocks(kind, rows, k, seed=seed)
    qtype = (
        gguf.GGMLQuantizationType[kind.upper()]
        if kind != "bf16"
        else gguf.GGMLQuantizationType.BF16
    )
    if kind == "f16":
        writer.add_tensor(name, blocks.view(np.float16).reshape(rows, k))
    else:
        writer.add_tensor(name, blocks, raw_dtype=qtype)


def write_tiny_llama(path: Path, *, layer_kinds: tuple[dict[str, str], ...] = LAYER_KINDS) -> Path:
    """A 2-layer Llama GGUF with random valid blocks (``layer_kinds``), untied Q6_K output."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(len(layer_kinds))
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(VOCAB)
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    shapes = {
        "attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
        "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER),
    }  # fmt: skip
    _add(writer, "token_embd.weight", EMBED_KIND, VOCAB, HIDDEN, seed=1)
    for i, kinds in enumerate(layer_kinds):
        for norm in ("attn_norm", "ffn_norm"):
            weight = rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32)
            writer.add_tensor(f"blk.{i}.{norm}.weight", weight)
        for j, (part, kind) in enumerate(kinds.items()):
            rows, k = shapes[part]
            _add(writer, f"blk.{i}.{part}.weight", kind, rows, k, seed=100 * i + j + 2)
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    _add(writer, "output.weight", OUTPUT_KIND, VOCAB, HIDDEN, seed=99)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_model_of(path: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def build(path: Path, **load: Any) -> Any:
    checkpoint = load_checkpoint(format="gguf", path=str(path), keep_quantized=True, **load)
    model = FAMILY.build(
        hf_config=checkpoint.hf_config,
        tensors=checkpoint.tensors,
        dtype=torch.float32,
        device="cpu",
    )
    select_linear_kernel(model, choice="auto", device=torch.device("cpu"), dtype=torch.float32)
    return model


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("LLMRT_CACHE_DIR", str(path))
    return path


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("kquant") / "tiny-kquant.gguf")


def test_a_k_quant_llama_runs_from_its_blocks_as_transformers_does(tiny_file: Path) -> None:
    model = build(tiny_file)
    linears = [m for m in model.modules() if isinstance(m, (FrozenLinear, QuantizedLinear))]
    assert not any(isinstance(m, FrozenLinear) for m in linears)  # no float32 copy anywhere
    kinds = {m.weight.kind for m in linears if isinstance(m, QuantizedLinear)}
    assert kinds == {"q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "f16", "bf16"}
    # Layer 0's q/k/v and gate/up: parts in different kinds.
    assert sum(isinstance(m, StackedLinear) for m in model.modules()) == 2
    assert isinstance(model.backbone.embed_tokens, QuantizedEmbedding)
    harness = Harness(hf_model=hf_model_of(tiny_file), model=model, vocab_size=VOCAB, seed=0)
    prompts = [harness.prompt(n, seed=n) for n in (5, 19, 40)]  # decode rows, then a GEMM
    # Decode steps fused (stacked q/k/v and gate/up included), then on the torch ops.
    for choice in ("fused", "ops"):
        select_decode_kernel(model, choice=choice, device=torch.device("cpu"))
        worst = harness.greedy_error(prompts, steps=STEPS, describe=lambda _, c=choice: c)
        assert worst <= LOGIT_BOUND, f"{choice}: max |logit error| {worst:.3g}"


def test_a_type_without_kernel_is_named(tmp_path: Path) -> None:
    kinds = ({**LAYER_KINDS[1], "ffn_up": "q2_k"},)
    path = write_tiny_llama(tmp_path / "q2k.gguf", layer_kinds=kinds)
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_up\.weight.*Q2_K.*requantize"):
        load_checkpoint(format="gguf", path=str(path), keep_quantized=True)


def test_requantize_turns_it_into_q8_0_once_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    kinds = ({**LAYER_KINDS[1], "ffn_up": "q2_k"},)
    path = write_tiny_llama(tmp_path / "q2k.gguf", layer_kinds=kinds)
    with caplog.at_level(logging.WARNING, logger="llmrt.weights.gguf"):
        first = load_checkpoint(
            format="gguf", path=str(path), keep_quantized=True, requantize="q8_0"
        )
    assert "Q2_K has no llmrt kernel; requantized to Q8_0" in caplog.text
    up = first.tensors["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(up, QuantizedWeight) and up.kind == "q8_0"
    raw = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_up.weight")
    exact = gguf.quants.dequantize(raw.data, gguf.GGMLQuantizationType.Q2_K).reshape(INTER, HIDDEN)
    # Q8_0 rounds to half a step of amax / 127, plus its fp16 scale's rounding (2^-11
    # relative; half the subnormal spacing 2^-25 for tiny blocks) times up to 127 steps.
    step = np.abs(exact).reshape(INTER, -1, 32).max(-1).repeat(32, -1) / 127
    assert (np.abs(up.dequantize().numpy() - exact) <= step * 0.57 + 127 * 2.0**-25).all()
    caplog.clear()
    calls: list[str] = []
    original = gguf_module.dequantize_tensor
    monkeypatch.setattr(
        gguf_module,
        "dequantize_tensor",
        lambda tensor, **kw: calls.append(tensor.name) or original(tensor, **kw),
    )
    with caplog.at_level(logging.WARNING, logger="llmrt.weights.gguf"):
        second = load_checkpoint(
            format="gguf", path=str(path), keep_quantized=True, requantize="q8_0"
        )
    assert "blk.0.ffn_up.weight" not in calls and "requantized" not in caplog.text  # cached
    again = second.tensors["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(again, QuantizedWeight) and torch.equal(again.blocks, up.blocks)


# ---- SmolLM2 requantized by llama.cpp's own quantizer -----------------------------------

#: llama.cpp's quantizer, built by the project's setup (an AVX2 build); the tests that need
#: it skip without it. ``LLMRT_LLAMA_QUANTIZE`` names another.
LLAMA_QUANTIZE = Path(
    os.environ.get("LLMRT_LLAMA_QUANTIZE", "/work/llamacpp/build-avx2/bin/llama-quantize")
)
MIXES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
PARITY_TEXTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n",
    "The quick brown fox jumps over the lazy dog. Once upon a time",
]


@pytest.fixture(scope="module", params=MIXES)
def requantized(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not LLAMA_QUANTIZE.is_file():
        pytest.skip(f"needs llama.cpp's llama-quantize at {LLAMA_QUANTIZE}")
    source = package_file(package=SMOLLM2_PACKAGE, file="SmolLM2-135M-Instruct.Q4_1.gguf")
    out = tmp_path_factory.mktemp("mix") / f"smollm2-{request.param}.gguf"
    subprocess.run(
        [str(LLAMA_QUANTIZE), "--allow-requantize", str(source), str(out), request.param, "2"],
        check=True,
        capture_output=True,
    )
    return out


def test_llama_quantize_mixes_run_as_transformers_does(requantized: Path) -> None:
    model = build(requantized)
    assert not any(isinstance(m, FrozenLinear) for m in model.modules()), (
        "a linear fell back to float32"
    )
    harness = Harness(hf_model=hf_model_of(requantized), model=model, vocab_size=49152, seed=0)
    tokenizer = load_checkpoint(format="gguf", path=str(requantized), keep_quantized=True).tokenizer
    assert tokenizer is not None
    prompts = [tokenizer.encode(text) for text in PARITY_TEXTS]
    worst = harness.greedy_error(prompts, steps=16, describe=tokenizer.decode)
    assert worst <= LOGIT_BOUND, f"max |logit error| {worst:.3g}"


#: Stated bound for ``device.gemm_dtype: int8`` on the requantized mixes (prompt GEMMs over
#: one-level 8-bit activations): measured max |logit error| 0.94 (Q4_K_M), 1.06 (Q5_K_M),
#: 1.12 (Q6_K), every greedy token equal; ``test_smollm2_quantized`` states Q4_1's.
INT8_GEMM_LOGIT_BOUND = 2.0


def test_llama_quantize_mixes_keep_the_greedy_tokens_with_int8_gemms(requantized: Path) -> None:
    from llmrt.families.layers import int8_gemm_coverage, select_gemm_dtype

    model = build(requantized)
    covered, _ = int8_gemm_coverage(model)
    if covered == 0:
        pytest.skip("no int8 GEMM for this mix at this instruction-set level")
    harness = Harness(hf_model=hf_model_of(requantized), model=model, vocab_size=49152, seed=0)
    tokenizer = load_checkpoint(format="gguf", path=str(requantized), keep_quantized=True).tokenizer
    assert tokenizer is not None
    prompts = [tokenizer.encode(text) for text in PARITY_TEXTS]
    select_gemm_dtype(model, choice="int8", min_rows=16)
    worst = harness.greedy_error(prompts, steps=16, describe=tokenizer.decode)
    # Above the two-level kernels' bound: the one-level GEMM really ran.
    assert LOGIT_BOUND < worst <= INT8_GEMM_LOGIT_BOUND, f"max |logit error| {worst:.3g}"


for _mark in (*NEEDS_SMOLLM2, pytest.mark.slow):
    test_llama_quantize_mixes_run_as_transformers_does = _mark(
        test_llama_quantize_mixes_run_as_transformers_does
    )
    test_llama_quantize_mixes_keep_the_greedy_tokens_with_int8_gemms = _mark(
        test_llama_quantize_mixes_keep_the_greedy_tokens_with_int8_gemms
    )
