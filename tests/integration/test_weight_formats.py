"""``checkpoint.weights`` through the container: int8 / int4 quantize a float checkpoint's
linear layers at load, and the quantized recipe serves requests."""

from __future__ import annotations

import pytest
import torch

from llmrt.families.layers import FrozenLinear, QuantizedLinear
from llmrt.sampling.params import SamplingParams
from llmrt.serving.llm import LLM

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize(("weights", "kind"), [("int8", "q8_0"), ("int4", "q4_1")])
def test_float_checkpoint_quantized_at_load_serves(weights: str, kind: str) -> None:
    with LLM.from_recipe("tiny-llama", overrides={"checkpoint.weights": weights}) as llm:
        model = llm.engine.executor.lanes[0].decode.config.model
        assert isinstance(model, torch.nn.Module)
        linears = [m for m in model.modules() if isinstance(m, (FrozenLinear, QuantizedLinear))]
        # 2 layers x (qkv, o, gate_up, down) + the untied LM head, all quantized.
        assert len(linears) == 9
        assert all(isinstance(m, QuantizedLinear) and m.weight.kind == kind for m in linears)
        out = llm.generate(["hello", "a longer prompt than the other one"], GREEDY)
    assert [len(o.token_ids) for o in out] == [6, 6]
