"""Quantized Llama weights (ggml Q4_0 / Q4_1 / Q8_0 blocks) against transformers on the
dequantized weights: the same logits (within ``LOGIT_TOL``) and the same greedy tokens.

transformers holds exactly the float32 values the blocks encode (gguf-py's dequantization
of the llmrt checkpoint), so any difference is llmrt's kernels, fusing or binding, not
quantization error. Prefill rows reach the dequantize + GEMM path, decode rows the
in-register kernel.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import pytest
import torch
from conftest import Harness
from family_checks import perturb
from transformers import LlamaConfig, LlamaForCausalLM

from llmrt.families.layers import QuantizedEmbedding, QuantizedLinear, select_linear_kernel
from llmrt.families.llama import FAMILY
from llmrt.kernels.formats import GGML_TYPE, CheckpointTensor, QuantizedWeight, quantize

CONFIG: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.1,
    "attn_implementation": "eager",
}


def gguf_dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """gguf-py's dequantization (independent of llmrt's kernels)."""
    values = gguf.quants.dequantize(
        weight.blocks.numpy().reshape(-1), gguf.GGMLQuantizationType(GGML_TYPE[weight.kind])
    )
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(weight.shape))


def quantized_pair(*, kind: str, tie: bool, seed: int) -> tuple[Any, dict[str, CheckpointTensor]]:
    """A tiny HF Llama holding dequantized weights, and the llmrt tensors holding the blocks."""
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig(**CONFIG, tie_word_embeddings=tie))
    perturb(hf, seed=seed, is_norm=lambda name: "norm" in name)
    tensors: dict[str, CheckpointTensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, tensor in hf.state_dict().items():
        if tie and name == "lm_head.weight":
            continue
        if tensor.dim() == 2:
            blocks = quantize(tensor, kind=kind, field="test")  # type: ignore[arg-type]
            tensors[name] = blocks
            dense[name] = gguf_dequantize(blocks)
        else:
            tensors[name] = tensor
    hf.load_state_dict(dense, strict=False)
    return hf.eval(), tensors


@pytest.mark.parametrize(
    ("kind", "tie"), [("q4_0", True), ("q4_1", False), ("q8_0", True)], ids=str
)
def test_quantized_llama_matches_transformers_on_dequantized_weights(kind: str, tie: bool) -> None:
    hf, tensors = quantized_pair(kind=kind, tie=tie, seed=3)
    model = FAMILY.build(
        hf_config=hf.config.to_dict(), tensors=tensors, dtype=torch.float32, device="cpu"
    )
    select_linear_kernel(model, choice="auto", device=torch.device("cpu"), dtype=torch.float32)
    modules = dict(model.iter_executor_named_modules())
    assert isinstance(modules["backbone.embed_tokens"], QuantizedEmbedding)
    assert isinstance(modules["backbone.lm_head"], QuantizedLinear)
    if tie:
        assert (
            modules["backbone.lm_head"].blocks is modules["backbone.embed_tokens"].blocks
        )  # one copy
    harness = Harness(hf_model=hf, model=model, vocab_size=CONFIG["vocab_size"], seed=0)
    harness.check_single_prompt()
    harness.check_ragged_batch()
