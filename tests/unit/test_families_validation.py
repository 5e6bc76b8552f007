"""Config/checkpoint validation, KV binding and the Model protocol of the built-in families."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

from llmrt.errors import CheckpointError, ConfigError, KVCacheStateError
from llmrt.families import gpt2, llama, registry
from llmrt.families.base import CausalLM, Family, ModelConfig
from llmrt.families.hfconfig import HFConfig
from llmrt.families.rope import inverse_frequencies, read_rope

LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
}
GPT2: dict[str, Any] = {
    "model_type": "gpt2",
    "vocab_size": 64,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 64,
    "eos_token_id": 5,
}
FAMILIES: dict[str, tuple[Family, dict[str, Any]]] = {
    "llama": (llama.FAMILY, LLAMA),
    "gpt2": (gpt2.FAMILY, GPT2),
}


def _tensors(family: Family, config: dict[str, Any], *, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    optional = family.optional_tensors(config)
    return {
        name: torch.randn(shape, generator=gen) * 0.2
        for name, shape in family.expected_tensors(config).items()
        if name not in optional
    }


def _build(family: Family, config: dict[str, Any], **kw: Any) -> Any:
    tensors = kw.pop("tensors", None) or _tensors(family, config)
    return family.build(
        hf_config=config, tensors=tensors, dtype=kw.pop("dtype", torch.float32), device="cpu"
    )


@attrs.define
class _KV:
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    block_size: int


def _kv(model: Any, *, num_blocks: int = 8, block_size: int = 4, **kw: Any) -> _KV:
    meta = model.attention_metadata()
    dtype = kw.get("dtype", meta.kv_dtypes[0])
    shape = meta.kv_shape(num_blocks, block_size)
    return _KV(
        keys=[torch.zeros(shape, dtype=dtype) for _ in range(meta.num_layers)],
        values=[torch.zeros(shape, dtype=dtype) for _ in range(meta.num_layers)],
        block_size=block_size,
    )


def _prefill(model: Any, tokens: list[int], table: list[int]) -> torch.Tensor:
    return model.prefill_forward(
        tokens=torch.tensor([tokens]),
        start_pos=torch.tensor([0], dtype=torch.int32),
        seq_lens=torch.tensor([len(tokens)], dtype=torch.int32),
        page_table=torch.tensor([table], dtype=torch.int32),
        last_token_index=torch.tensor([len(tokens) - 1]),
    )


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_built_model_follows_the_model_protocol(name: str) -> None:
    family, config = FAMILIES[name]
    model = _build(family, config)
    assert isinstance(family, Family) and isinstance(model, CausalLM)
    assert model.config == family.model_config(config, dtype=torch.float32)
    assert model.config.family == name and model.supports_batched_prefill_outputs
    meta = model.attention_metadata()
    assert meta.kv_shape(10, 16) == (10, model.config.num_kv_heads, 16, model.config.head_dim)
    assert meta.kv_dtypes == (torch.float32,) * model.config.num_layers
    modules = dict(model.named_modules())
    names = [n for n, _ in model.iter_executor_named_modules()]
    assert all(modules[n] is m for n, m in model.iter_executor_named_modules())
    assert len(names) == model.config.num_layers + (4 if name == "gpt2" else 3)


def test_model_config_reads_token_ids_and_head_dim() -> None:
    cfg = llama.FAMILY.model_config({**LLAMA, "head_dim": 16}, dtype=torch.bfloat16)
    assert cfg == ModelConfig(
        family="llama",
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        dtype=torch.bfloat16,
        bos_token_id=1,
        eos_token_ids=(2, 3),
    )
    assert gpt2.FAMILY.model_config(GPT2, dtype=torch.float32).eos_token_ids == (5,)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_missing_tensor_is_named(name: str) -> None:
    family, config = FAMILIES[name]
    tensors = _tensors(family, config)
    victim = sorted(tensors)[3]
    del tensors[victim]
    with pytest.raises(CheckpointError, match="missing") as info:
        _build(family, config, tensors=tensors)
    assert info.value.item == victim


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_wrong_shape_is_named(name: str) -> None:
    family, config = FAMILIES[name]
    tensors = _tensors(family, config)
    victim = sorted(tensors)[-2]
    tensors[victim] = torch.zeros((*tensors[victim].shape, 2))
    with pytest.raises(CheckpointError, match="shape") as info:
        _build(family, config, tensors=tensors)
    assert info.value.item == victim


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (torch.full((1,), float("nan")), "non-finite"),
        (torch.full((1,), float("inf")), "non-finite"),
        (torch.full((1,), -float("inf")), "non-finite"),
        (torch.zeros((1,), dtype=torch.int64), "floating-point"),
    ],
)
@pytest.mark.parametrize("where", [0, -1])
def test_bad_values_are_named(name: str, bad: torch.Tensor, reason: str, where: int) -> None:
    family, config = FAMILIES[name]
    tensors = _tensors(family, config)
    victim = sorted(tensors)[0]
    tensors[victim] = tensors[victim].to(bad.dtype)
    tensors[victim].view(-1)[where] = bad[0]
    with pytest.raises(CheckpointError, match=reason) as info:
        _build(family, config, tensors=tensors)
    assert info.value.item == victim


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_unexpected_tensor_is_named(name: str) -> None:
    family, config = FAMILIES[name]
    tensors = _tensors(family, config)
    tensors["model.layers.9.extra.weight"] = torch.zeros(3)
    with pytest.raises(CheckpointError, match="unexpected") as info:
        _build(family, config, tensors=tensors)
    assert info.value.item == "model.layers.9.extra.weight"


def test_legacy_buffers_are_ignored_and_tied_head_is_optional() -> None:
    tensors = _tensors(llama.FAMILY, LLAMA)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    _build(llama.FAMILY, LLAMA, tensors=tensors)
    tensors = _tensors(gpt2.FAMILY, GPT2)
    tensors["transformer.h.0.attn.bias"] = torch.ones((1, 1, 64, 64))
    model = _build(gpt2.FAMILY, GPT2, tensors=tensors)
    assert model.backbone.lm_head.weight is model.backbone.embed_tokens.weight
    assert "lm_head.weight" in gpt2.FAMILY.optional_tensors(GPT2)
    tied = {**LLAMA, "tie_word_embeddings": True}
    assert llama.FAMILY.optional_tensors(tied) == {"lm_head.weight"}
    assert llama.FAMILY.optional_tensors(LLAMA) == frozenset()


def _without(config: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k != key}


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
BAD_CONFIGS: list[tuple[str, dict[str, Any], str]] = [
    ("llama", _without(LLAMA, "hidden_size"), "config.hidden_size"),
    ("llama", {**LLAMA, "hidden_size": "32"}, "config.hidden_size"),
    ("llama", {**LLAMA, "vocab_size": 0}, "config.vocab_size"),
    ("llama", {**LLAMA, "num_key_value_heads": 3}, "config.num_key_value_heads"),
    (
        "llama",
        {**LLAMA, "num_attention_heads": 5, "num_key_value_heads": 5},
        "config.num_attention_heads",
    ),
    ("llama", {**LLAMA, "hidden_act": "mish"}, "config.hidden_act"),
    ("llama", {**LLAMA, "rms_norm_eps": -1.0}, "config.rms_norm_eps"),
    ("llama", {**LLAMA, "tie_word_embeddings": "yes"}, "config.tie_word_embeddings"),
    ("llama", {**LLAMA, "model_type": "gpt2"}, "config.model_type"),
    ("llama", {**LLAMA, "quantization_config": {"bits": 4}}, "config.quantization_config"),
    ("llama", {**LLAMA, "partial_rotary_factor": 0.5}, "config.partial_rotary_factor"),
    (
        "llama",
        {**LLAMA, "rope_scaling": {"rope_type": "su", "factor": 2.0}},
        "config.rope_scaling.rope_type",
    ),
    (
        "llama",
        {**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
        "config.rope_scaling.original_max_position_embeddings",
    ),
    (
        "llama",
        {**LLAMA, "rope_scaling": _without(LLAMA3, "low_freq_factor")},
        "config.rope_scaling.low_freq_factor",
    ),
    (
        "llama",
        {**LLAMA, "rope_parameters": {**LLAMA3, "rope_theta": 0}},
        "config.rope_parameters.rope_theta",
    ),
    (
        "mistral",
        {**LLAMA, "model_type": "mistral", "sliding_window": 0},
        "config.sliding_window",
    ),
    (
        "qwen2",
        {
            **LLAMA,
            "model_type": "qwen2",
            "use_sliding_window": True,
            "sliding_window": 32,
            "max_window_layers": -1,
        },
        "config.max_window_layers",
    ),
    (
        "llama",
        {**LLAMA, "layer_types": ["full_attention", "sliding_attention"]},
        "config.layer_types",
    ),
    ("gpt2", _without(GPT2, "n_embd"), "config.n_embd"),
    ("gpt2", {**GPT2, "n_head": 5}, "config.n_head"),
    ("gpt2", {**GPT2, "activation_function": "tanh"}, "config.activation_function"),
    (
        "gpt2",
        {**GPT2, "scale_attn_by_inverse_layer_idx": True},
        "config.scale_attn_by_inverse_layer_idx",
    ),
    ("gpt2", {**GPT2, "model_type": "llama"}, "config.model_type"),
]


@pytest.mark.parametrize(("name", "config", "field"), BAD_CONFIGS, ids=[b[2] for b in BAD_CONFIGS])
def test_bad_config_field_is_named(name: str, config: dict[str, Any], field: str) -> None:
    family = FAMILIES[name][0] if name in FAMILIES else registry.get_family(name)
    with pytest.raises(CheckpointError) as info:
        family.model_config(config, dtype=torch.float32)
    assert info.value.item == field
    with pytest.raises(CheckpointError):
        family.build(hf_config=config, tensors={}, dtype=torch.float32, device="cpu")


def test_sliding_windows_follow_the_model_type() -> None:
    mistral = registry.get_family("mistral").spec(
        {**LLAMA, "model_type": "mistral", "sliding_window": 64}, dtype=torch.float32
    )
    assert [layer.window for layer in mistral.layers] == [64, 64]
    qwen2 = {**LLAMA, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 32}
    family = registry.get_family("qwen2")
    spec = family.spec({**qwen2, "max_window_layers": 1}, dtype=torch.float32)
    assert [layer.window for layer in spec.layers] == [None, 32]
    spec = family.spec({**qwen2, "use_sliding_window": False}, dtype=torch.float32)
    assert [layer.window for layer in spec.layers] == [None, None]


def test_qwen2_has_qkv_bias_but_no_o_bias() -> None:
    names = registry.get_family("qwen2").expected_tensors({**LLAMA, "model_type": "qwen2"})
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    assert "model.layers.0.self_attn.q_proj.bias" not in llama.FAMILY.expected_tensors(LLAMA)


def test_unsupported_dtype_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        llama.FAMILY.model_config(LLAMA, dtype=torch.int8)


def test_rope_parameters_and_legacy_rope_scaling_agree() -> None:
    legacy = read_rope(HFConfig(raw={"rope_theta": 5e5, "rope_scaling": LLAMA3}), head_dim=16)
    v5 = read_rope(HFConfig(raw={"rope_parameters": {**LLAMA3, "rope_theta": 5e5}}), head_dim=16)
    assert legacy == v5 and legacy.kind == "llama3"
    inv = inverse_frequencies(legacy)
    plain = inverse_frequencies(read_rope(HFConfig(raw={"rope_theta": 5e5}), head_dim=16))
    assert torch.equal(inv[:1], plain[:1])  # high frequencies untouched
    torch.testing.assert_close(inv[-1], plain[-1] / 8.0)  # low frequencies divided by factor


def test_kv_binding_is_validated_and_transactional() -> None:
    model = _build(llama.FAMILY, LLAMA)
    with pytest.raises(KVCacheStateError, match="set_kv_cache"):
        _prefill(model, [1, 2, 3], [0])
    good = _kv(model)
    model.set_kv_cache(good)
    bad = _kv(model)
    bad.values[1] = torch.zeros((8, 2, 4, 9))
    with pytest.raises(ConfigError, match=r"kv_cache\.values\[1\]"):
        model.set_kv_cache(bad)
    short = _kv(model)
    short.keys.pop()
    with pytest.raises(ConfigError, match=r"kv_cache\.keys"):
        model.set_kv_cache(short)
    with pytest.raises(ConfigError, match=r"kv_cache\.keys\[0\]"):
        model.set_kv_cache(_kv(model, dtype=torch.int32))
    with pytest.raises(ConfigError, match="block_size"):
        model.set_kv_cache(_KV(keys=good.keys, values=good.values, block_size=0))
    _prefill(model, [1, 2, 3], [5])
    assert good.keys[0][5].abs().sum() > 0 and bad.keys[0].abs().sum() == 0  # old binding kept
    model.set_kv_cache(None)
    with pytest.raises(KVCacheStateError):
        model.decode_forward(
            tokens=torch.tensor([1]),
            positions=torch.tensor([0], dtype=torch.int32),
            page_table=torch.tensor([[0]], dtype=torch.int32),
        )


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_bfloat16_model_and_cache_stay_close_to_float32(name: str) -> None:
    family, config = FAMILIES[name]
    tensors = _tensors(family, config)
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = _build(family, config, tensors=tensors, dtype=dtype)
        model.set_kv_cache(_kv(model, dtype=dtype))
        first = _prefill(model, [3, 1, 4, 1, 5], [6, 2])
        step = model.decode_forward(
            tokens=torch.tensor([9]),
            positions=torch.tensor([5], dtype=torch.int32),
            page_table=torch.tensor([[6, 2]], dtype=torch.int32),
        )
        assert first.dtype == step.dtype == torch.float32
        logits[dtype] = torch.cat([first, step])
    torch.testing.assert_close(logits[torch.bfloat16], logits[torch.float32], atol=0.1, rtol=0.05)


def test_bfloat16_cache_under_float32_model_is_accepted() -> None:
    model = _build(llama.FAMILY, LLAMA)
    kv = _kv(model, dtype=torch.bfloat16)
    model.set_kv_cache(kv)
    _prefill(model, [1, 2, 3, 4, 5], [3, 1])
    assert kv.keys[1][1, :, 0].abs().sum() > 0
