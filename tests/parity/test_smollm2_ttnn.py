"""SmolLM2-135M-Instruct on the ttnn backend, on llmrt's ttnn emulator, against transformers.

The bundled ``smollm2-135m`` recipe with ``device.backend=ttnn`` and the emulator: the Q4_1
GGUF dequantized once, weights converted to bfloat16 or bfloat8_b as tt_transformers
does, prefill on ttnn ops, traced paged decode. Its greedy tokens on the parity prompts equal
transformers' float32 greedy tokens (on the dequantized weights) wherever the reference's
top-2 margin exceeds twice the stated tolerance (max |logit error| over the reference's
largest |logit|), teacher-forced on llmrt's tokens; the chat answer is Paris.
Minutes on two cores: slow (scripts/nightly.sh runs it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import NEEDS_SMOLLM2, SMOLLM2_PACKAGE

from llmrt.recipe.loader import load_recipe
from llmrt.sampling.params import SamplingParams
from llmrt.serving.llm import LLM
from llmrt.weights.package_data import package_file

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
STEPS = 12
#: Stated bounds on max |logit error| / max |logit| per weight dtype (activations bfloat16).
TOLERANCE = {"bfloat16": 0.03, "bfloat8_b": 0.06}
#: Of the 48 greedy positions, how many must clear twice the tolerance (measured: bfloat16
#: at least 24; bfloat8_b 16, its wider tolerance leaving fewer clear margins).
MIN_COMPARED = {"bfloat16": 24, "bfloat8_b": 12}
PARITY_TEXTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n",
    "The quick brown fox jumps over the lazy dog. Once upon a time",
    "numbers: 1234567890 3.14159",
]
OVERRIDES = [
    "device.backend=ttnn",
    "device.ttnn.module=emulator",
    "kv_cache.max_num_blocks=256",
    "prefill.max_chunk_size=128",
    "decode.lane_capacity=4",
    "warmup.prefill_batch_sizes=[1, 4]",
]

pytestmark = [*NEEDS_SMOLLM2, pytest.mark.slow]
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model() -> Any:
    path: Path = package_file(package=SMOLLM2_PACKAGE, file=FILE)
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module", params=["bfloat16", "bfloat8_b"])
def llm(request: pytest.FixtureRequest) -> Iterator[LLM]:
    recipe = load_recipe(
        "smollm2-135m", overrides=[*OVERRIDES, f"device.ttnn.weight_dtype={request.param}"]
    )
    with LLM(recipe=recipe) as built:
        yield built


def test_parity_prompts_and_the_answer(llm: LLM, hf_model: Any) -> None:
    dtype = llm.recipe.device.ttnn.weight_dtype
    tol = TOLERANCE[dtype]
    prompts = [list(llm.tokenizer.encode(text)) for text in PARITY_TEXTS]
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    compared = 0
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs, strict=True):
            tokens = list(out.token_ids)
            logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
            scale = float(logits.abs().max())
            top2 = logits.topk(2).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * tol * scale
            reference = logits.argmax(-1)
            assert torch.equal(torch.tensor(tokens)[clear], reference[clear]), (
                f"{dtype}: {tokens} vs transformers {reference.tolist()}"
            )
            compared += int(clear.sum())
    answer = llm.tokenizer.decode(list(outputs[0].token_ids), skip_special_tokens=True)
    assert answer.startswith("The capital of France is Paris."), answer
    assert compared >= MIN_COMPARED[dtype], f"only {compared} clear positions"
