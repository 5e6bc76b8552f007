"""Every architecture ``family: auto`` loads, against transformers, on tiny random
checkpoints with perturbed norms and biases.

One test per architecture runs the fast combination: a ragged batch with an inert
padding row, chunked prefill, a prefix-cached continuation next to a fresh row, and 32
greedy decode steps (logits within 1e-4, greedy tokens equal). Two more run each
architecture on the capture-safe path (no host reads inside a forward; MoE dense) and
through the whole serving stack on two data-parallel lanes with traced decode; a
representative subset (``REPRESENTATIVE``) runs by default, every case under ``-m slow``.
The configs switch on the options each architecture is known for (sliding windows,
soft-capping, q/k norms, partial rotary, RoPE scalings, multipliers, experts), so each
part is checked where transformers computes it. The fast-combination case runs on every
torch device (``torch_device``: cuda where a GPU is present), against transformers on the
CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from llmrt.families.registry import family_for_model_type, model_types
from llmrt.recipe.loader import load_recipe
from llmrt.sampling.params import SamplingParams
from llmrt.serving.llm import LLM
from llmrt.testing.parity import hf_greedy, page_table, reference_model
from llmrt.weights.checkpoint import Checkpoint

COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "initializer_range": 0.1,
}
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}

#: (model_type, config overrides) per case; every architecture has at least one.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-yarn-biases": (
        "llama",
        {"attention_bias": True, "mlp_bias": True, "rope_parameters": YARN},
    ),
    "mistral-window": ("mistral", {"sliding_window": 5, "head_dim": 24}),
    "qwen2-alternating-window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
    ),
    "qwen3-qk-norm-dynamic-rope": (
        "qwen3",
        {
            "head_dim": 16,
            "attention_bias": True,
            "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
        },
    ),
    "gemma-geglu-tied": ("gemma", {"head_dim": 16}),
    "gemma2-softcap-window": (
        "gemma2",
        {
            "head_dim": 16,
            "sliding_window": 5,
            "query_pre_attn_scalar": 12,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
        },
    ),
    "gemma3-local-global-rope": (
        "gemma3_text",
        {
            "head_dim": 16,
            "sliding_window": 5,
            "layer_types": ["sliding_attention", "full_attention"],
            "final_logit_softcapping": 3.0,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e3},
            },
        },
    ),
    "phi3-longrope-partial-window": (
        "phi3",
        {
            "sliding_window": 7,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.25, 1.5, 2.0],
                "long_factor": [2.0, 3.0, 4.0, 5.0],
                "original_max_position_embeddings": 128,
                "factor": 2.0,
            },
        },
    ),
    "olmo2-post-norm-qk-norm": ("olmo2", {"attention_bias": True}),
    "gpt-neox-parallel-partial": ("gpt_neox", {"num_key_value_heads": 4}),
    "gpt-neox-sequential": (
        "gpt_neox",
        {"num_key_value_heads": 4, "use_parallel_residual": False, "hidden_act": "gelu_new"},
    ),
    "stablelm-qk-layernorm-parallel": (
        "stablelm",
        {"qk_layernorm": True, "use_qkv_bias": True, "use_parallel_residual": True},
    ),
    "stablelm-sequential": ("stablelm", {}),
    "granite-multipliers": (
        "granite",
        {
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.3,
            "logits_scaling": 4.0,
        },
    ),
    "starcoder2-window-biases": ("starcoder2", {"sliding_window": 6}),
    "gpt2": ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}),
    "mixtral-top2-window": (
        "mixtral",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6},
    ),
    "qwen3-moe-softmax-topk-dense-layer": (
        "qwen3_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": False,
            "mlp_only_layers": [1],
        },
    ),
    "phi-parallel-partial-head-bias-qk-layernorm": ("phi", {"qk_layernorm": True}),
    "cohere-interleaved-qk-norm-logit-scale": (
        "cohere",
        {"use_qk_norm": True, "logit_scale": 0.5, "head_dim": 16},
    ),
    "nemotron-layernorm1p-relu2-partial": (
        "nemotron",
        {"partial_rotary_factor": 0.5, "attention_bias": True, "mlp_bias": True},
    ),
    "olmo-weightless-norm-clip-qkv": ("olmo", {"clip_qkv": 0.05, "attention_bias": True}),
    "helium-interleaved-bias": (
        "helium",
        {"head_dim": 16, "rope_theta": 1000.0, "attention_bias": True, "mlp_bias": True},
    ),
    "glm-interleaved-partial-fused-gate-up": ("glm", {"head_dim": 16}),
    "smollm3-nope-layers-window": (
        "smollm3",
        {
            "num_hidden_layers": 3,
            "no_rope_layers": [1, 0, 1],
            "use_sliding_window": True,
            "sliding_window": 6,
            "layer_types": ["full_attention", "sliding_attention", "full_attention"],
        },
    ),
    "qwen2-moe-shared-expert-dense-layer": (
        "qwen2_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 80,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        },
    ),
}


#: Cases the default run takes through the capture-safe and two-lane traced paths: dense
#: and MoE, pre-norm / sandwich / parallel residuals, windows and soft-caps, fused and
#: interleaved q/k/v, learned positions.
REPRESENTATIVE = (
    "llama-yarn-biases",
    "gemma2-softcap-window",
    "gpt-neox-parallel-partial",
    "qwen3-moe-softmax-topk-dense-layer",
)
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
#: The byte tokenizer's 258 ids fit every serving case's vocabulary.
SERVING_VOCAB = 258
MAX_TOKENS = 33  # the prefill token and 32 decode steps


def _cases(*, default: tuple[str, ...]) -> list[Any]:
    return [
        pytest.param(case, marks=() if case in default else pytest.mark.slow)
        for case in sorted(CASES)
    ]


def case_config(case: str, **extra: Any) -> dict[str, Any]:
    """The case's raw ``config.json``: what the runtime (and so the llmrt side) reads."""
    model_type, overrides = CASES[case]
    return {"model_type": model_type, **COMMON, **overrides, **extra}


def hf_model(case: str, **extra: Any) -> Any:
    """The case's transformers model (eager attention), norms and biases perturbed."""
    return reference_model(case_config(case, **extra))


@pytest.mark.parametrize("case", sorted(CASES))
def test_family_auto_matches_transformers(
    case: str, parity_harness: Any, torch_device: str
) -> None:
    harness = parity_harness(config=case_config(case), device=torch_device)
    prompts = [harness.prompt(n, seed=30 + n) for n in (14, 9, 12)]
    runs = harness.greedy(prompts, cuts=[[5, 8], [], [6]], align="end", pad_row=True)
    harness.assert_parity(prompts, runs)


@pytest.mark.parametrize("case", _cases(default=REPRESENTATIVE))
def test_capture_safe_path_matches_transformers(
    case: str, parity_harness: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No host read inside any forward (what CUDA-graph capture and compilation need):
    ragged batch, chunked prefill, shared prefix blocks, inert padding."""
    harness = parity_harness(config=case_config(case))
    harness.check_capture_safe(monkeypatch)


@pytest.mark.parametrize("case", _cases(default=REPRESENTATIVE))
def test_padded_prefill_matches_transformers_and_the_packed_one(
    case: str, parity_harness: Any
) -> None:
    """An eager prefill packs its real tokens (``pack_prefill``); with packing off the
    layers run the padded rows. Both match transformers, and on a ragged call with a padding
    row and a cached-prefix row they agree with each other on every row's logits and on
    what they write into the pages."""
    harness = parity_harness(config=case_config(case))
    prompts = [harness.prompt(n, seed=40 + n) for n in (13, 6, 11)]
    cuts = [[5, 8], [], [6]]
    harness.model.pack_prefill = False
    harness.assert_parity(prompts, harness.greedy(prompts, cuts=cuts, align="end", pad_row=True))
    results = {}
    for packed in (False, True):
        harness.model.pack_prefill = packed
        kv, pool = harness.bind(fill_seed=3)
        blocks = [pool.take(4) for _ in range(3)]
        table = page_table(blocks, width=4)
        first = harness.prefill(chunks=[prompts[2][:8]], starts=[0], table=table[2:3])
        rows = [prompts[0], [], prompts[2][8:]]  # fresh, padding, cached prefix of 8
        table[1] = -1
        logits = harness.prefill(chunks=rows, starts=[0, 0, 8], table=table, pad_to=16)
        results[packed] = (first, logits[[0, 2]], kv.snapshot())
    (first_p, logits_p, pages_p), (first_k, logits_k, pages_k) = results[False], results[True]
    torch.testing.assert_close(first_k, first_p, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits_k, logits_p, atol=1e-5, rtol=1e-5)
    for a, b in zip(pages_k, pages_p, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", _cases(default=REPRESENTATIVE))
def test_two_lanes_with_traced_decode_match_transformers(
    case: str, llmrt_runtime: Any, tmp_path: Path
) -> None:
    """The serving stack (scheduler, batched prefill, prefix cache, two data-parallel lanes,
    decode replayed from traces) on the case's perturbed weights gives transformers' greedy
    tokens for every prompt."""
    config = case_config(case, vocab_size=SERVING_VOCAB)
    model = reference_model(config)
    recipe = yaml.safe_load((RECIPES / "tiny-llama.yaml").read_text())
    recipe.update(name=f"arch-{case}", family="auto")
    recipe["model"] = config
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    overrides = {
        "lanes": 2,
        "decode.lane_capacity": 2,
        "trace.mode": "decode_only",
        "kv_cache.num_blocks": 24,
        "serving.max_model_len": 128,
        "warmup.prefill_seq_lens": [32],
        "warmup.prefill_batch_sizes": [1, 2],
    }
    weights = Checkpoint(
        source=f"transformers:{case}",
        hf_config=config,
        tensors={k: v.detach().contiguous() for k, v in model.state_dict().items()},
        tokenizer=None,
    )
    container = llmrt_runtime(str(path), overrides, providers={"model.weights": weights})
    prompts = [[(7 * i + 3 * n) % 250 + 1 for i in range(n)] for n in (14, 9, 21, 5)]
    with LLM(recipe=load_recipe(str(path), overrides=overrides), container=container) as llm:
        assert llm.container.model.family().name == family_for_model_type(config["model_type"]).name
        outputs = llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        )
        replays = [
            sum(lane.trace_compiler().replay_counts().values())
            for lane in llm.container.lane_containers()
        ]
    assert all(count > 0 for count in replays), replays  # both lanes decoded from traces
    for prompt, output in zip(prompts, outputs, strict=True):
        assert list(output.token_ids) == hf_greedy(model, prompt, steps=MAX_TOKENS).tokens


#: The architectures added by family (issue #39), each also run in 32-token prefill chunks.
ADDED = tuple(
    case
    for case, (model_type, _) in CASES.items()
    if model_type in ("phi", "cohere", "nemotron", "olmo", "helium", "glm", "smollm3", "qwen2_moe")
)


@pytest.mark.parametrize("case", ADDED)
def test_32_token_prefill_chunks_match_transformers(case: str, parity_harness: Any) -> None:
    """Prompts past one 32-token chunk, prefilled chunk by chunk (as ``max_chunk_size: 32``
    schedules them) next to a row that fits one, then greedy decode."""
    harness = parity_harness(config=case_config(case))
    prompts = [harness.prompt(n, seed=60 + n) for n in (75, 40, 21)]
    runs = harness.greedy(prompts, cuts=[[32, 64], [32], []], steps=8)
    harness.assert_parity(prompts, runs)


#: Sizes (not options) a minimal config of these types needs to stay tiny.
MINIMAL_SIZES: dict[str, dict[str, Any]] = {
    "helium": {"head_dim": 16},  # transformers' o_proj is hidden x hidden
    "mixtral": {"num_local_experts": 4},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48},
    "qwen2_moe": {
        "num_experts": 4,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 80,
    },
}


@pytest.mark.parametrize("model_type", [t for t in model_types() if t in CONFIG_MAPPING])
def test_every_default_is_read_as_transformers_reads_it(
    model_type: str, parity_harness: Any
) -> None:
    """A raw config with sizes only: every option (RoPE base, rotary share, norm eps, query
    scale, soft-caps, windows, tied head) is the architecture's default, which the family must
    read as transformers fills it in (the runtime reads the raw ``config.json``)."""
    config = {"model_type": model_type, **COMMON, **MINIMAL_SIZES.get(model_type, {})}
    harness = parity_harness(config=config)
    prompts = [harness.prompt(n, seed=50 + n) for n in (20, 7)]
    harness.assert_parity(prompts, harness.greedy(prompts, cuts=[[9], []], steps=8))


def test_every_listed_architecture_has_a_case() -> None:
    covered = {model_type for model_type, _ in CASES.values()}
    assert covered == {
        "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3",
        "olmo2", "gpt_neox", "stablelm", "granite", "starcoder2", "gpt2", "mixtral",
        "qwen3_moe", "phi", "cohere", "nemotron", "olmo", "helium", "glm", "smollm3",
        "qwen2_moe",
    }  # fmt: skip
