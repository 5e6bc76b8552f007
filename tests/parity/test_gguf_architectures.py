"""Every llama.cpp architecture llmrt reads: a tiny random transformers model written as a GGUF
the way llama.cpp's converter writes it (gguf-py's writer and tensor-name map, the
converter's layout changes), run by ``LLM(model=FILE)`` with no recipe, gives transformers'
greedy tokens on the original model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from lane_fixtures import module_torch_thread  # noqa: F401  (autouse fixture)
from model_files import add_bpe_tokenizer, llama_permute, train_bpe

from llmrt.sampling.params import SamplingParams
from llmrt.serving.llm import LLM
from llmrt.weights.gguf import read_gguf_config
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


def _gemma_norms(name: str, array: np.ndarray) -> np.ndarray:
    """llama.cpp's Gemma converters store RMSNorm weights as ``1 + w``."""
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


#: architecture -> (transformers config class, extra config, converter change, metadata).
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("LlamaConfig", {}, "llama"),
    "qwen2": ("Qwen2Config", {}, ""),
    "qwen3": ("Qwen3Config", {"head_dim": 16}, ""),
    "starcoder2": ("Starcoder2Config", {"use_bias": True}, ""),
    "phi3": ("Phi3Config", {"pad_token_id": 0}, ""),
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
        "gemma",
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
    "gemma": ("GemmaConfig", {"head_dim": 16}, "gemma"),
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 64,
            "attn_logit_softcapping": 0.5,
            "final_logit_softcapping": 1.0,
        },  # caps that bite
        "gemma",
    ),
}


@pytest.fixture(scope="module")
def bpe() -> Any:
    return train_bpe()


def tiny_model(arch: str, vocab: int) -> Any:
    config_class, extra, _ = CASES[arch]
    config = getattr(transformers, config_class)(vocab_size=vocab, **{**COMMON, **extra})
    if arch == "starcoder2":
        config.norm_epsilon = 1e-5
    torch.manual_seed(0)
    # eager: the attention that applies Gemma 2's logit soft-capping (sdpa skips it)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5) if arch not in ("gemma", "gemma2") else param.uniform_(
                    -0.5, 0.5
                )
    return model


def write_gguf(path: Path, arch: str, model: Any, bpe: Any) -> Path:
    """``model`` as llama.cpp's converter writes an ``arch`` file."""
    cfg = model.config
    _, _, change = CASES[arch]
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
    else:
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
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
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        array = tensor.detach().float().numpy().copy()
        if permute is not None:
            array = permute(gguf_name, array)
        if change == "gemma":
            array = _gemma_norms(gguf_name, array)
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


#: Architectures whose GGUF parity is tested elsewhere: gpt2 in tests/parity/test_gpt2_parity.py,
#: olmo and phi2 (families that declare their own mapping) in tests/unit/test_weights_gguf.py.
TESTED_ELSEWHERE = ("gpt2", "olmo", "phi2")


def test_every_readable_architecture_is_tested() -> None:
    assert sorted(CASES) == [a for a in supported_architectures() if a not in TESTED_ELSEWHERE]


@pytest.mark.parametrize("arch", sorted(CASES))
def test_a_gguf_of_each_architecture_runs_like_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bpe: Any, arch: str
) -> None:
    monkeypatch.setenv("LLMRT_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_model(arch, bpe.get_vocab_size())
    path = write_gguf(tmp_path / f"tiny-{arch}.gguf", arch, model, bpe)
    ids = bpe.encode("What is the capital of France? Paris").ids
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False
        )
    expected = out[0, len(ids) :].tolist()
    with LLM(model=str(path), overrides=[*SMALL, "kv_cache.dtype=float32"]) as llm:
        assert llm.recipe.name == f"tiny-{arch}"
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
    compared = [k for k in derived if k in stated and k not in NOT_IN_THE_HEADER]
    assert len(compared) >= 10
    assert set(HEADER_KEYS.get(arch, ())) <= set(compared)
    for key in compared:
        assert derived[key] == pytest.approx(stated[key]), key
