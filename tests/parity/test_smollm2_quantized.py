"""SmolLM2-135M served from its GGUF's own Q4_1 / Q8_0 blocks (``checkpoint.weights:
gguf-native``) against transformers on the dequantized float32 weights: the same greedy
tokens on the parity prompts and logits within a stated bound.

The bound: llmrt's kernels accumulate the same float32 products as the reference in a
different order, and 30 layers amplify that rounding; measured max |logit error| is about
1e-4 to 1e-3 against logits of magnitude ~20, so 5e-3 is the bound asserted. The
interleaved layout's two-level 8-bit activations round each 32-wide block of a row to
1/65024 of its largest value: measured max |logit error| 5.6e-3 with the 4-bit linears
interleaved (what ``weight_layout: auto`` does) when only decode rows took that kernel, and
1.03e-2 since prompt rows take it too (under 128 rows at first, at every length since the
integer GEMM: unchanged), so that layout's stated bound is 2e-2 (the greedy tokens must
still be equal).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import NEEDS_SMOLLM2, SMOLLM2_PACKAGE, Harness

from llmrt.families.layers import QuantizedLinear, select_linear_kernel, select_weight_layout
from llmrt.families.llama import FAMILY
from llmrt.weights import load_checkpoint
from llmrt.weights.package_data import package_file

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOGIT_BOUND = {"ggml": 5e-3, "interleaved": 2e-2}
STEPS = 16
PARITY_TEXTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n",
    "The quick brown fox jumps over the lazy dog. Once upon a time",
    "numbers: 1234567890 3.14159",
]

pytestmark = [*NEEDS_SMOLLM2, pytest.mark.slow]
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model() -> Any:
    path: Path = package_file(package=SMOLLM2_PACKAGE, file=FILE)
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


#: The weight layouts: the file's blocks with float32 activations, and the interleaved
#: blocks with two-level 8-bit activations (the default on CPUs with AVX-512 VNNI).
@pytest.fixture(scope="module", params=["ggml", "interleaved"])
def harness(request: pytest.FixtureRequest, hf_model: Any) -> Harness:
    path: Path = package_file(package=SMOLLM2_PACKAGE, file=FILE)
    checkpoint = load_checkpoint(format="gguf", path=str(path), keep_quantized=True)
    model = FAMILY.build(
        hf_config=checkpoint.hf_config,
        tensors=checkpoint.tensors,
        dtype=torch.float32,
        device="cpu",
    )
    select_linear_kernel(model, choice="auto", device=torch.device("cpu"), dtype=torch.float32)
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 30 * 4 + 1
    changed = select_weight_layout(model, choice=request.param, device=torch.device("cpu"))
    assert changed == (len(linears) if request.param == "interleaved" else 0)
    harness = Harness(hf_model=hf_model, model=model, vocab_size=49152, seed=0)
    harness.tokenizer = checkpoint.tokenizer  # type: ignore[attr-defined]
    harness.layout = request.param  # type: ignore[attr-defined]
    return harness


def test_greedy_tokens_equal_the_dequantized_reference(harness: Harness) -> None:
    tokenizer = harness.tokenizer  # type: ignore[attr-defined]
    prompts = [tokenizer.encode(text) for text in PARITY_TEXTS]
    worst = harness.greedy_error(prompts, steps=STEPS, describe=tokenizer.decode)
    assert worst <= LOGIT_BOUND[harness.layout], f"max |logit error| {worst:.3g}"  # type: ignore[attr-defined]
    # greedy_error asserted llmrt's tokens equal these.
    chat = harness.reference(prompts[0], steps=STEPS).tokens
    answer = tokenizer.decode(chat, skip_special_tokens=True)
    assert answer.startswith("The capital of France is Paris."), answer


#: Stated bound for ``device.gemm_dtype: bfloat16`` (prefill GEMMs with bfloat16 operands):
#: measured max |logit error| 0.35 on the parity prompts, logits of magnitude ~20.
BF16_GEMM_LOGIT_BOUND = 0.5


def test_bfloat16_gemms_keep_the_greedy_tokens(harness: Harness) -> None:
    from llmrt.families.layers import select_gemm_dtype

    tokenizer = harness.tokenizer  # type: ignore[attr-defined]
    prompts = [tokenizer.encode(text) for text in PARITY_TEXTS]
    assert all(len(p) >= 16 for p in prompts[:1])  # the chat prompt's prefill is a GEMM
    select_gemm_dtype(harness.model, choice="bfloat16", min_rows=1)
    try:
        worst = harness.greedy_error(prompts, steps=STEPS, describe=tokenizer.decode)
    finally:
        select_gemm_dtype(harness.model, choice="float32")
    assert 5e-3 < worst <= BF16_GEMM_LOGIT_BOUND, f"max |logit error| {worst:.3g}"


#: Stated bound for a float16 KV cache (``kv_cache.dtype: float16``, the default recipe's):
#: keys and values rounded to float16 once, where they are written. Measured max |logit
#: error| on the parity prompts (32 steps): 3.2e-2 with the interleaved layout (1.0e-2 with a
#: float32 cache), under the 0.35 that bfloat16 GEMMs already allow.
FLOAT16_KV_LOGIT_BOUND = 0.1


def test_float16_kv_cache_keeps_the_greedy_tokens(harness: Harness) -> None:
    tokenizer = harness.tokenizer  # type: ignore[attr-defined]
    prompts = [tokenizer.encode(text) for text in PARITY_TEXTS]
    harness.kv_dtype = torch.float16
    try:
        kv, _ = harness.bind()
        assert kv.keys[0].dtype == torch.float16 and kv.values[-1].dtype == torch.float16
        del kv
        worst = harness.greedy_error(prompts, steps=STEPS, describe=tokenizer.decode)
    finally:
        harness.kv_dtype = None
    assert worst <= FLOAT16_KV_LOGIT_BOUND, f"max |logit error| {worst:.3g}"


#: Stated bound for ``device.gemm_dtype: int8`` (prompt GEMMs over one-level 8-bit
#: activations, llama.cpp's scheme): measured max |logit error| 1.44 on the parity prompts
#: (16 steps, logits of magnitude ~20), every greedy token equal; three times bfloat16's.
#: That is why the default threshold (``gemm_dtype_min_rows``, 128) keeps chat-length
#: prompts on the two-level kernels.
INT8_GEMM_LOGIT_BOUND = 2.0


def test_int8_gemms_keep_the_greedy_tokens(harness: Harness) -> None:
    from llmrt.families.layers import int8_gemm_coverage, select_gemm_dtype

    if harness.layout != "interleaved":  # type: ignore[attr-defined]
        pytest.skip("the int8 GEMM multiplies the interleaved Q4 blocks (and K-quants)")
    covered, total = int8_gemm_coverage(harness.model)
    if covered == 0:
        pytest.skip("no int8 GEMM at this instruction-set level")
    assert covered == total  # every Q4_1 linear and the interleaved Q8_0 head
    tokenizer = harness.tokenizer  # type: ignore[attr-defined]
    prompts = [tokenizer.encode(text) for text in PARITY_TEXTS]
    assert len(prompts[0]) >= 16  # the chat prompt's prefill runs the int8 GEMM
    select_gemm_dtype(harness.model, choice="int8", min_rows=16)
    try:
        worst = harness.greedy_error(prompts, steps=STEPS, describe=tokenizer.decode)
    finally:
        select_gemm_dtype(harness.model, choice="float32")
    # More than the two-level kernels' 2e-2: one 8-bit level really ran.
    assert LOGIT_BOUND["interleaved"] < worst <= INT8_GEMM_LOGIT_BOUND, (
        f"max |logit error| {worst:.3g}"
    )
