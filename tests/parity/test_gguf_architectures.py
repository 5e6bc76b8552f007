"""Every llama.cpp architecture llmrt reads: a tiny random transformers model written as a GGUF
the way llama.cpp's converter writes it (gguf-py's writer and tensor-name map, the
converter's layout changes), run by ``LLM(model=FILE)`` with no recipe, gives transformers'
greedy tokens on the original model."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from lane_fixtures import module_torch_thread  # noqa: F401  (autouse fixture)
from model_files import add_bpe_tokenizer, llama_permute, train_bpe

from llmrt.kernels.formats import QuantizedWeight
from llmrt.sampling.params import SamplingParams
from llmrt.serving.llm import LLM
from llmrt.weights.gguf import read_gguf, read_gguf_config
from llmrt.weights.gguf_architectures import supported_architectures

transformers = pytest.importorskip("transformers")

STEPS = 8
SMALL = ["decode.lane_capacity=1", "kv_cache.num_blocks=16", "warmup.prefill_batch_sizes=[1]"]
#: Config keys a GGUF header does not state (they come from the tokenizer or the class).
NOT_IN_THE_HEADER = {
    "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias",
    "hidden_act", "mlp_bias", "use_bias",
}  # fmt: skip
#: Keys an architecture's header must carry beyond the common shape.
HEADER_KEYS = {
    "llama-mixtral": ("num_local_experts", "num_experts_per_tok", "rms_norm_eps"),
    "qwen2moe": (
        "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        "shared_expert_intermediate_size", "qkv_bias",
    ),
    "qwen3moe": (
        "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    ),
    "command-r": ("logit_scale", "layer_norm_eps", "use_qk_norm"),
    "nemotron": ("norm_eps", "head_dim"),
    "phi3-longrope": ("original_max_position_embeddings",),
    "stablelm-qk_norm": ("qk_layernorm", "use_qkv_bias"),
    "gemma2": (
        "attn_logit_softcapping", "final_logit_softcapping", "sliding_window",
        "query_pre_attn_scalar",
    ),
    "starcoder2": ("norm_epsilon",),
    "stablelm": ("partial_rotary_factor", "layer_norm_eps", "use_qkv_bias"),
    "granite": (
        "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
    ),
    "gptneox": ("partial_rotary_factor", "layer_norm_eps", "use_parallel_residual"),
}  # fmt: skip
COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
}


def _one_plus_norms(name: str, array: np.ndarray) -> np.ndarray:
    """llama.cpp's Gemma and Nemotron converters store norm weights as ``1 + w``."""
    return array + 1 if name.endswith("norm.weight") else array


def _neox_qkv(cfg: Any) -> Callable[[str, np.ndarray], np.ndarray]:
    """llama.cpp's GPTNeoXModel: per-head interleaved q, k, v rows to all q, all k, all v."""

    def regroup(name: str, array: np.ndarray) -> np.ndarray:
        if ".attn_qkv." not in name:
            return array
        heads = cfg.num_attention_heads
        split = array.reshape(heads, 3, cfg.hidden_size // heads, *array.shape[1:])
        return np.concatenate([split[:, j].reshape(-1, *array.shape[1:]) for j in range(3)])

    return regroup


def _llama_qk(cfg: Any) -> Callable[[str, np.ndarray], np.ndarray]:
    def permute(name: str, array: np.ndarray) -> np.ndarray:
        if ".attn_q." in name:
            return llama_permute(array, cfg.num_attention_heads)
        if ".attn_k." in name:
            return llama_permute(array, cfg.num_key_value_heads)
        return array

    return permute


#: Token ids inside the tiny vocabulary (some configs default to ids past it).
SMALL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
#: Phi-3's LongRoPE over an original context of 64: the short factors and the attention
#: factor serve this test's positions (transformers' generate re-prefills the whole sequence
#: with the long factors once it passes the original context; llmrt switches per position,
#: so the two differ past it for Hugging Face checkpoints as much as for GGUF files). The
#: long factors are checked as read back from the file.
LONGROPE = {
    "rope_type": "longrope",
    "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
    "short_factor": [1.0, 1.1, 1.2, 1.4, 1.6, 2.0, 2.5, 3.0],
    "rope_theta": 10000.0,
}
#: MoE shapes: four experts, two per token.
EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def arch_of(case: str) -> str:
    """The GGUF architecture a case writes (``phi3-longrope``: ``phi3`` with LongRoPE)."""
    return case if case == "command-r" else case.split("-")[0]


#: case -> (transformers config class, extra config, converter change); a case is a
#: ``general.architecture``, or one followed by ``-variant``.
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("LlamaConfig", {}, "llama"),
    # llama.cpp writes Mixtral as llama (LlamaModel: q/k permuted) with stacked experts
    "llama-mixtral": (
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
        "llama",
    ),
    "qwen2": ("Qwen2Config", {}, ""),
    "qwen3": ("Qwen3Config", {"head_dim": 16}, ""),
    "starcoder2": ("Starcoder2Config", {"use_bias": True}, ""),
    "phi3": ("Phi3Config", {"pad_token_id": 0}, ""),
    "phi3-longrope": (
        "Phi3Config",
        {
            **SMALL_IDS,
            "head_dim": 16,
            "original_max_position_embeddings": 64,
            "rope_parameters": {**LONGROPE, "original_max_position_embeddings": 64},
        },
        "",
    ),
    "stablelm-qk_norm": ("StableLmConfig", {"qk_layernorm": True, "use_qkv_bias": True}, ""),
    # llama.cpp's qwen2moe never renormalises the top-k weights (no header key says so): a
    # checkpoint with norm_topk_prob=true runs in llama.cpp, and by llmrt from its GGUF,
    # unrenormalised, as the file means; the cases use false, as Qwen1.5-MoE does
    "qwen2moe": (
        "Qwen2MoeConfig",
        {**EXPERTS, "shared_expert_intermediate_size": 48, "norm_topk_prob": False},
        "experts",
    ),
    # as converters wrote it before llama.cpp stopped squeezing tensors: the gate 1-D
    "qwen2moe-squeezed": (
        "Qwen2MoeConfig",
        {**EXPERTS, "shared_expert_intermediate_size": 48, "norm_topk_prob": False},
        "experts",
    ),
    # llama.cpp's qwen3moe always renormalises the top-k weights (Qwen3-MoE checkpoints do)
    "qwen3moe": ("Qwen3MoeConfig", {**EXPERTS, "head_dim": 16, "norm_topk_prob": True}, "experts"),
    "command-r": (
        "CohereConfig",
        {**SMALL_IDS, "use_qk_norm": True, "logit_scale": 0.25, "layer_norm_eps": 1e-5},
        "",
    ),
    "nemotron": ("NemotronConfig", {**SMALL_IDS, "head_dim": 16}, "one_plus"),
    "smollm3": ("SmolLM3Config", {**SMALL_IDS, "num_hidden_layers": 4}, "llama"),
    "olmo2": ("Olmo2Config", {}, ""),
    "stablelm": ("StableLmConfig", {"partial_rotary_factor": 0.5, "use_qkv_bias": True}, ""),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,  # shorter than the prompt: the window matters
            "num_hidden_layers": 6,  # five local layers, then a global one
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        },
        "one_plus",
    ),
    "granite": (
        "GraniteConfig",
        {
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.125,
            "logits_scaling": 2.0,
        },
        "llama",  # llama.cpp's GraniteModel is a LlamaModel: Q/K rows permuted
    ),
    "gptneox": ("GPTNeoXConfig", {"partial_rotary_factor": 0.25}, "gptneox"),
    "gemma": ("GemmaConfig", {"head_dim": 16}, "one_plus"),
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 64,
            "attn_logit_softcapping": 0.5,
            "final_logit_softcapping": 1.0,
        },  # caps that bite
        "one_plus",
    ),
}


@pytest.fixture(scope="module")
def bpe() -> Any:
    return train_bpe()


def tiny_model(case: str, vocab: int) -> Any:
    config_class, extra, change = CASES[case]
    config = getattr(transformers, config_class)(vocab_size=vocab, **{**COMMON, **extra})
    if case == "starcoder2":
        config.norm_epsilon = 1e-5
    torch.manual_seed(0)
    # eager: the attention that applies Gemma 2's logit soft-capping (sdpa skips it)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                # (1 + w) norms: w near 0
                param.uniform_(-0.5, 0.5) if change == "one_plus" else param.uniform_(0.5, 1.5)
            elif "norm" in name and name.endswith("bias"):
                param.uniform_(-0.2, 0.2)
    return model


def write_gguf(path: Path, case: str, model: Any, bpe: Any, *, q8_0: tuple[str, ...] = ()) -> Path:
    """``model`` as llama.cpp's converter writes a file of the case's architecture; tensors
    whose GGUF name contains one of ``q8_0`` are stored as Q8_0 blocks."""
    cfg = model.config
    _, _, change = CASES[case]
    arch = arch_of(case)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' base
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 1e4))))
    if arch == "starcoder2":
        writer.add_layer_norm_eps(cfg.norm_epsilon)
    elif arch in ("gptneox", "stablelm"):
        writer.add_layer_norm_eps(cfg.layer_norm_eps)
        writer.add_parallel_residual(cfg.use_parallel_residual)
    elif arch == "command-r":
        writer.add_layer_norm_eps(cfg.layer_norm_eps)
        writer.add_logit_scale(cfg.logit_scale)
    elif arch == "nemotron":  # the base converter writes norm_eps as both
        writer.add_layer_norm_rms_eps(cfg.norm_eps)
        writer.add_layer_norm_eps(cfg.norm_eps)
    else:
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if case == "llama-mixtral":
        writer.add_expert_count(cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "phi3":  # Phi3MiniModel: the original context always, a window (0: none)
        original = getattr(cfg, "original_max_position_embeddings", None)
        writer.add_rope_scaling_orig_ctx_len(original or cfg.max_position_embeddings)
        writer.add_sliding_window(cfg.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            scale = cfg.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(
                float(np.sqrt(1 + np.log(scale) / np.log(original)))
            )
            for which in ("long", "short"):
                factors = np.asarray(rope[f"{which}_factor"], dtype=np.float32)
                writer.add_tensor(f"rope_factors_{which}.weight", factors)
    if arch == "granite":
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    if arch == "gemma3":
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    add_bpe_tokenizer(writer, bpe)
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    permute = {"llama": _llama_qk, "gptneox": _neox_qkv}.get(change, lambda cfg: None)(cfg)
    for name, array in _converter_tensors(model, squeeze=case.endswith("-squeezed")):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if permute is not None:
            array = permute(gguf_name, array)
        if change == "one_plus":
            array = _one_plus_norms(gguf_name, array)
        if any(part in gguf_name for part in q8_0):
            blocks = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _converter_tensors(model: Any, *, squeeze: bool) -> list[tuple[str, np.ndarray]]:
    """The model's tensors as llama.cpp's converter regroups them before naming: experts'
    ``gate_up_proj`` split into stacked gate and up (Qwen2MoeModel), StableLM's per-head q/k
    norms stacked into one ``[heads, head_dim]`` tensor (StableLMModel); ``squeeze``: unit
    dimensions dropped, as older converters did."""
    out: list[tuple[str, np.ndarray]] = []
    heads: dict[str, list[np.ndarray]] = {}
    for name, tensor in model.state_dict().items():
        array = tensor.detach().float().numpy().copy()
        if squeeze:
            array = array.squeeze()
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = np.split(array, 2, axis=1)
            out += [(name.replace("gate_up_proj", "gate_proj.weight"), gate)]
            out += [(name.replace("gate_up_proj", "up_proj.weight"), up)]
        elif name.endswith("mlp.experts.down_proj"):
            out.append((name + ".weight", array))
        elif "_layernorm.norms." in name:
            heads.setdefault(name.split(".norms.")[0] + ".weight", []).append(array)
        else:
            out.append((name, array))
    out += [(name, np.stack(rows)) for name, rows in heads.items()]
    return out


#: Architectures whose GGUF parity is tested elsewhere: gpt2 in tests/parity/test_gpt2_parity.py,
#: olmo and phi2 in tests/unit/test_weights_gguf.py.
TESTED_ELSEWHERE = ("gpt2", "olmo", "phi2")


def test_every_readable_architecture_is_tested() -> None:
    tested = sorted({arch_of(case) for case in CASES})
    assert tested == [a for a in supported_architectures() if a not in TESTED_ELSEWHERE]
    assert len(supported_architectures()) >= 16


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_gguf_of_each_architecture_runs_like_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bpe: Any, case: str
) -> None:
    monkeypatch.setenv("LLMRT_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_model(case, bpe.get_vocab_size())
    path = write_gguf(tmp_path / f"tiny-{case}.gguf", case, model, bpe)
    ids = bpe.encode("What is the capital of France? Paris").ids
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False
        )
    expected = out[0, len(ids) :].tolist()
    with LLM(model=str(path), overrides=[*SMALL, "kv_cache.dtype=float32"]) as llm:
        assert llm.recipe.name == f"tiny-{case}"
        (result,) = llm.generate(
            [ids], SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
        )
    assert list(result.token_ids) == expected
    # Every shape and scalar the header states reads back as the model's own config says.
    derived = read_gguf_config(path)
    stated = model.config.to_dict()
    rope = stated.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    stated.setdefault("rope_theta", rope.get("rope_theta"))
    stated.setdefault("partial_rotary_factor", rope.get("partial_rotary_factor"))
    # (a null the class fills in at use, like Mixtral's head_dim, states nothing)
    compared = [k for k in derived if stated.get(k) is not None and k not in NOT_IN_THE_HEADER]
    assert len(compared) >= 10
    assert set(HEADER_KEYS.get(case, HEADER_KEYS.get(arch_of(case), ()))) <= set(compared)
    for key in compared:
        assert derived[key] == pytest.approx(stated[key]), key
    if rope.get("rope_type") == "longrope":  # the factors come from tensors, not the header
        scaling = derived["rope_scaling"]
        for key in ("long_factor", "short_factor", "original_max_position_embeddings"):
            assert scaling[key] == pytest.approx(rope[key]), key


def test_quantized_experts_load_in_float_with_a_warning_naming_the_cost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bpe: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Q8_0 attention stays in blocks; Q8_0 stacked experts are dequantized (the decoder runs
    experts in float) and one log line says so, with the size it costs: never silently."""
    monkeypatch.setenv("LLMRT_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_model("qwen3moe", bpe.get_vocab_size())
    path = write_gguf(tmp_path / "q.gguf", "qwen3moe", model, bpe, q8_0=("_exps", "attn_q."))
    with caplog.at_level(logging.WARNING, logger="llmrt.weights.gguf"):
        contents = read_gguf(path, keep_quantized=True)
    (warned,) = [r.getMessage() for r in caplog.records if "expert tensors" in r.getMessage()]
    layers = COMMON["num_hidden_layers"]
    assert f"{3 * layers} stacked expert tensors (Q8_0) dequantized to float32" in warned
    floats = 4 * 3 * layers * 4 * 32 * 64 / 1e6  # gate, up, down: 4 experts of 32 x 64
    assert f"{floats:.1f} MB from" in warned
    assert isinstance(contents.tensors["model.layers.0.self_attn.q_proj.weight"], QuantizedWeight)
    experts = contents.tensors["model.layers.0.mlp.experts.gate_up_proj"]
    assert isinstance(experts, torch.Tensor) and experts.shape == (4, 64, 64)
    original = model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.allclose(experts, original, atol=0.02)  # Q8_0's rounding only
