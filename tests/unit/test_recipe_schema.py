"""Recipe schema rules: every rule rejects a bad value with an error naming its field path."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from llmrt.errors import ConfigError, RecipeError
from llmrt.recipe import schema as recipe_schema
from llmrt.recipe.loader import (
    CheckpointSpec,
    DeviceSpec,
    Recipe,
    TokenizerSpec,
    load_recipe,
    recipe_from_dict,
)
from llmrt.runtime.config import PagedKVCacheConfig, TraceConfig


def tiny() -> dict[str, Any]:
    """A minimal valid random-llama recipe as plain data."""
    return {
        "name": "t",
        "family": "llama",
        "checkpoint": {"format": "random"},
        "model": {
            "model_type": "llama", "vocab_size": 258, "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "max_position_embeddings": 512,
        },
        "tokenizer": {"source": "byte"},
        "kv_cache": {"block_size": 16, "max_num_blocks": 64},
        "prefill": {"max_chunk_size": 128, "max_batch_size": 4, "seq_len_buckets": "fine"},
        "decode": {"lane_capacity": 4},
        "warmup": {"prefill_seq_lens": [32, 64], "prefill_batch_sizes": [1, 2]},
        "serving": {"max_model_len": 512},
    }


GGUF = {"checkpoint": {"format": "gguf", "package": "pkg", "file": "m.gguf"},
        "tokenizer": {"source": "checkpoint"}}


#: Overrides turning ``tiny()`` into a ttnn recipe of the toy TTTv2 family (llama is torch-only).
TT: dict[str, Any] = {
    "family": "toy_ttnn",
    "device.backend": "ttnn",
    "model": None,
    "model.model_type": "toy_ttnn",
    "model.vocab_size": 258,
    "model.hidden_size": 4,
    "model.num_hidden_layers": 2,
    "model.max_position_embeddings": 512,
}


def build(**overrides: Any) -> Recipe:
    """``tiny()`` with dotted-path overrides (``model=None`` empties ``model`` first)."""
    data = tiny()
    if "model" in overrides and overrides.pop("model") is None:
        data["model"] = {}
    return recipe_from_dict(data, overrides=overrides)


def test_minimal_recipe_is_valid_and_defaults_fill_in() -> None:
    recipe = build()
    assert recipe.lanes == 1
    assert recipe.device == DeviceSpec()
    assert recipe.device.torch_device == "cpu"
    assert recipe.trace == TraceConfig(mode="none")
    assert recipe.kv_cache == PagedKVCacheConfig(block_size=16, max_num_blocks=64)
    assert recipe.decode_slots == 4
    assert recipe.max_num_seqs == 4


def test_the_step_token_budget_follows_the_device_unless_given() -> None:
    # Unset: 512 prompt tokens a step on the CPU (a CPU step's prefill stalls every stream),
    # 2048 where a prefill takes milliseconds; a value in the recipe wins on every device.
    assert build().serving.max_num_batched_tokens is None
    assert build().max_num_batched_tokens == 512
    assert build(**{"device.kind": "cuda"}).max_num_batched_tokens == 2048
    assert build(**{"device.backend": "ttnn"}).max_num_batched_tokens == 2048
    # A larger prefill chunk asked for raises the unset budget with it (else it never runs whole).
    assert build(**{"prefill.max_chunk_size": 1024}).max_num_batched_tokens == 1024
    given = {"serving.max_num_batched_tokens": 300}
    assert build(**given).max_num_batched_tokens == 300
    assert build(**given, **{"device.kind": "cuda"}).max_num_batched_tokens == 300


def test_the_context_length_follows_the_kv_cache_unless_given() -> None:
    # Unset: 4096 tokens, or what the cache holds when that is less (a smaller cache is
    # not an error about a value nobody wrote); a given value must still fit.
    def unset(**overrides: Any) -> Recipe:
        data = tiny()
        data["serving"].pop("max_model_len")
        return recipe_from_dict(data, overrides=overrides)

    assert unset().serving.max_model_len is None
    assert unset().max_model_len == 64 * 16
    large = {"kv_cache.max_num_blocks": 1024}
    assert unset(**large).max_model_len == 4096
    assert unset(**{"kv_cache.max_num_blocks": 4}).max_model_len == 64
    assert unset(**large, **{"serving.max_model_len": 8192}).max_model_len == 8192
    assert build(**large, **{"serving.max_model_len": 100}).max_model_len == 100
    with pytest.raises(ConfigError, match=r"serving\.max_model_len"):
        build(**{"kv_cache.max_num_blocks": 4, "serving.max_model_len": 65})
    # The bundled templates leave it unset, so a smaller cache on them starts too.
    smaller = load_recipe("smollm2-135m", overrides={"kv_cache.max_num_blocks": 8})
    assert smaller.max_model_len == 8 * smaller.kv_cache.block_size


#: (overrides, field, reason). ``"model": None`` empties ``model`` first (overrides merge).
RULES: list[tuple[dict[str, Any], str, str]] = [
    # section-level rules
    ({"name": ""}, "name", "non-empty"),
    ({"family": "nope"}, "family", "not a registered model family"),
    ({"lanes": 0}, "lanes", "positive integer"),
    ({"checkpoint.format": "pickle"}, "checkpoint.format", "must be one of"),
    ({"checkpoint.dtype": "float16"}, "checkpoint.dtype", "must be one of"),
    ({"checkpoint.seed": -1}, "checkpoint.seed", "non-negative"),
    ({"checkpoint.path": "/w"}, "checkpoint.path", "not used by checkpoint.format=random"),
    ({"tokenizer.source": "path"}, "tokenizer.path", "required for tokenizer.source=path"),
    ({"tokenizer.path": "/t.json"}, "tokenizer.path", "only used with tokenizer.source=path"),
    ({"device.backend": "tpu"}, "device.backend", "must be one of"),
    ({"device.kind": "mps"}, "device.kind", "must be one of"),
    ({"device.index": -1}, "device.index", "non-negative"),
    ({"device.index": 1}, "device.index", "must be 0 for a cpu device"),
    ({"device.compile": "jit"}, "device.compile", "must be one of"),
    ({"device.inductor.mode": "turbo"}, "device.inductor.mode", "must be one of"),
    ({"device.num_threads": 0}, "device.num_threads", "positive integer"),
    ({"device.linear": "blas"}, "device.linear", "must be one of"),
    ({"device.retain_freed_memory": "yes"}, "device.retain_freed_memory", "true or false"),
    ({"device.huge_pages": "yes"}, "device.huge_pages", "true or false"),
    ({"kv_cache.huge_pages": "yes"}, "kv_cache.huge_pages", "true or false"),
    ({"prefill.wave_rules": "loose"}, "prefill.wave_rules", "must be one of"),
    ({"decode.lane_capacity": 8, "decode.batch_sizes": [1, 16]}, "decode.batch_sizes",
     "up to decode.lane_capacity=8"),
    ({"decode.lane_capacity": 8, "decode.batch_sizes": [4, 2, 8]}, "decode.batch_sizes",
     "increasing"),
    ({"device.backend": "ttnn", "prefill.wave_rules": "packed"}, "prefill.wave_rules",
     "needs device.backend=torch"),
    ({"device.backend": "ttnn", "prefill.wave_rules": "ragged"}, "prefill.wave_rules",
     "needs device.backend=torch"),
    ({"device.kind": "cuda", "device.linear": "onednn"}, "device.linear", "cpu kernel"),
    ({"device.backend": "ttnn", "device.linear": "aten"}, "device.linear", "only used with"),
    ({"device.decode_kernel": "fast"}, "device.decode_kernel", "must be one of"),
    ({"device.attention_kernel": "flash"}, "device.attention_kernel", "must be one of"),
    ({"device.kind": "cuda", "device.attention_kernel": "native"}, "device.attention_kernel",
     "cpu"),
    (
        {"device.backend": "ttnn", "device.attention_kernel": "sdpa"},
        "device.attention_kernel",
        "only used with",
    ),
    ({"device.gemm_dtype": "float16"}, "device.gemm_dtype", "must be one of"),
    ({"device.gemm_dtype_min_rows": 0}, "device.gemm_dtype_min_rows", "positive integer"),
    ({"device.gemm_dtype": "bfloat16"}, "device.gemm_dtype", "block-quantized"),
    ({"device.kind": "cuda", "device.decode_kernel": "fused"}, "device.decode_kernel", "cpu"),
    ({"device.weight_layout": "tiled"}, "device.weight_layout", "must be one of"),
    ({"device.weight_layout": "interleaved"}, "device.weight_layout", "block-quantized"),
    (
        {"device.kind": "cuda", "device.weight_layout": "interleaved"},
        "device.weight_layout",
        "cpu layout",
    ),
    (
        {"device.backend": "ttnn", "device.weight_layout": "ggml"},
        "device.weight_layout",
        "only used with",
    ),
    (
        {"device.backend": "ttnn", "device.decode_kernel": "ops"},
        "device.decode_kernel",
        "only used with",
    ),
    ({"device.mesh_shape": [1, 2]}, "device.mesh_shape", "only used with device.backend=ttnn"),
    ({"device.backend": "ttnn", "device.kind": "cpu"}, "device.kind", "only used with"),
    ({"device.backend": "ttnn", "device.compile": "inductor"}, "device.compile", "eager"),
    ({"device.backend": "ttnn", "device.mesh_shape": [0, 2]}, "device.mesh_shape[0]",
     "positive integer"),
    ({"kv_cache.block_size": 24}, "kv_cache.block_size", "power of two"),
    ({"kv_cache.num_blocks": 65}, "kv_cache.num_blocks", "must not exceed"),
    ({"prefill.max_chunk_size": 0}, "prefill.max_chunk_size", "positive integer"),
    ({"prefill.max_batch_size": 3}, "prefill.max_batch_size", "must be one of"),
    ({"prefill.seq_len_buckets": "coarse"}, "prefill.seq_len_buckets", "must be one of"),
    ({"prefill.fine_step": 0}, "prefill.fine_step", "positive multiple of 8"),
    ({"prefill.fine_step": 12}, "prefill.fine_step", "positive multiple of 8"),
    ({"decode.lane_capacity": 0}, "decode.lane_capacity", "positive integer"),
    ({"trace.mode": "sometimes"}, "trace.mode", "must be one of"),
    ({"warmup.prefill_seq_lens": [64, 32]}, "warmup.prefill_seq_lens", "strictly increasing"),
    ({"warmup.prefill_batch_sizes": [3]}, "warmup.prefill_batch_sizes[0]", "must be one of"),
    ({"serving.max_num_batched_tokens": 0}, "serving.max_num_batched_tokens", "positive"),
    ({"serving.max_num_seqs": 0}, "serving.max_num_seqs", "positive integer"),
    ({"device.num_threads": 1025}, "device.num_threads", "at most 1024"),
    # cross-field rules
    ({"prefill.max_chunk_size": 120}, "prefill.max_chunk_size",
     "multiple of kv_cache.block_size=16"),
    ({"serving.max_model_len": 1025}, "serving.max_model_len",
     "kv_cache.max_num_blocks * kv_cache.block_size = 64 * 16 = 1024"),
    ({"serving.max_num_seqs": 5}, "serving.max_num_seqs", "lanes * decode.lane_capacity"),
    ({"device.backend": "ttnn", "device.mesh_shape": [1, 3], "lanes": 2}, "lanes",
     "must divide the 3 chips"),
    ({"device.ttnn.weight_dtype": "bfloat4_b", "device.backend": "ttnn"},
     "device.ttnn.weight_dtype", "must be one of"),
    ({**TT, "device.backend": "torch"}, "device.backend", "family 'toy_ttnn' supports ttnn only"),
    ({**TT, "family": "auto", "device.backend": "torch"}, "device.backend",
     "family 'toy_ttnn' supports ttnn only"),
    ({"device.ttnn.trace_region_size": 1024}, "device.ttnn", "only used with device.backend=ttnn"),
    ({**TT, "device.ttnn.l1_small_size": -1}, "device.ttnn.l1_small_size", "non-negative"),
    ({**TT, "device.ttnn.trace_region_size": 1.5}, "device.ttnn.trace_region_size",
     "expected int"),
    ({**TT, "device.ttnn.num_command_queues": 3}, "device.ttnn.num_command_queues",
     "must be 1 or 2"),
    ({**TT, "device.ttnn.dispatch_core_type": "tensix"}, "device.ttnn.dispatch_core_type",
     "must be one of"),
    ({**TT, "device.ttnn.fabric_config": "fabric_3d"}, "device.ttnn.fabric_config",
     "must be one of"),
    ({**TT, "device.ttnn.fabric_config": "fabric_1d"}, "device.ttnn.fabric_config",
     "needs a mesh of two chips or more (this recipe opens 1)"),
    ({**TT, "trace.mode": "decode_only", "device.ttnn.trace_region_size": 0},
     "device.ttnn.trace_region_size", "must be positive when trace.mode=decode_only"),
    ({"tokenizer.source": "checkpoint"}, "tokenizer.source", "random checkpoint has no tokenizer"),
    ({"model.vocab_size": 200}, "model.vocab_size", "at least 258 for the byte tokenizer"),
    # checkpoint format requirements
    ({"model.model_type": None}, "model.model_type", "required for checkpoint.format=random"),
    ({"model.hidden_size": None}, "model.hidden_size", "positive integer"),
    ({"model.num_hidden_layers": "2"}, "model.num_hidden_layers", "positive integer"),
    ({"model.hidden_size": 66}, "model.num_attention_heads", "must divide hidden_size=66"),
    ({"model.num_key_value_heads": 3}, "model.num_key_value_heads", "divide"),
    ({"model.rope_scaling": {"factor": {1, 2}}}, "model.rope_scaling.factor", "must be a number"),
    ({"model": None, "checkpoint.format": "safetensors", "tokenizer.source": "checkpoint"},
     "checkpoint.path",
     "--set checkpoint.path=DIR"),
    ({"model": None, "checkpoint": {"format": "gguf"}, "tokenizer.source": "checkpoint"},
     "checkpoint.package",
     "checkpoint.package + checkpoint.file"),
    ({"model": None, "checkpoint": {"format": "gguf", "package": "p"},
      "tokenizer.source": "checkpoint"}, "checkpoint.file", "required without checkpoint.path"),
    ({"model": None, "checkpoint": {"format": "gguf", "path": "/m.gguf", "file": "m.gguf"},
      "tokenizer.source": "checkpoint"}, "checkpoint.path", "not both"),
    ({"model": None, "checkpoint": {"format": "safetensors", "path": "/d", "package": "p"},
      "tokenizer.source": "checkpoint"}, "checkpoint.package",
     "only used by checkpoint.format=gguf"),
    ({"model": None, **GGUF, "tokenizer.source": "byte"}, "tokenizer.source",
     "byte is only for random checkpoints"),
    ({**GGUF}, "model", "only used by checkpoint.format=random"),
    # weight formats
    ({"checkpoint.weights": "int2"}, "checkpoint.weights", "must be one of"),
    ({"checkpoint.weights": "gguf-native"}, "checkpoint.weights",
     "checkpoint.format is random"),
    ({"checkpoint.weights": "int8", "checkpoint.dtype": "bfloat16"}, "checkpoint.weights",
     "set checkpoint.dtype=float32"),
    ({"checkpoint.weights": "bfloat16"}, "checkpoint.weights",
     "compute dtype checkpoint.dtype=float32"),
    ({"checkpoint.weights": "int4", "device.kind": "cuda"}, "checkpoint.weights",
     "this recipe runs on torch cuda"),
    ({"checkpoint.weights": "int8", "device.backend": "ttnn"}, "checkpoint.weights",
     "this recipe runs on ttnn"),
]


@pytest.mark.parametrize(("overrides", "field", "reason"), RULES,
                         ids=[f"{f}-{i}" for i, (_, f, _) in enumerate(RULES)])
def test_rule_names_the_field_path(overrides: dict[str, Any], field: str, reason: str) -> None:
    data = tiny()
    if "model" in overrides and overrides["model"] is None:
        data["model"] = {}
        overrides = {k: v for k, v in overrides.items() if k != "model"}
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(data, overrides=overrides)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert reason in info.value.reason


def test_gguf_and_safetensors_recipes_validate() -> None:
    data = tiny()
    data["model"] = {}
    gguf = recipe_from_dict(data, overrides=GGUF)
    assert gguf.checkpoint == CheckpointSpec(format="gguf", package="pkg", file="m.gguf")
    safetensors = recipe_from_dict(data, overrides={
        "checkpoint": {"format": "safetensors", "path": "/ckpt"},
        "tokenizer": {"source": "path", "path": "/ckpt/tokenizer.json"},
    })
    assert safetensors.checkpoint.path == "/ckpt"
    assert safetensors.tokenizer == TokenizerSpec(source="path", path="/ckpt/tokenizer.json")


def test_ttnn_mesh_splits_into_lanes() -> None:
    recipe = build(**TT, **{"device.mesh_shape": [2, 4], "lanes": 4})
    assert recipe.device.mesh_shape == (2, 4)
    assert recipe.lanes == 4
    assert recipe.device.ttnn.tensor_parallel == 2  # two chips of a row each


@pytest.mark.parametrize(
    ("mesh", "lanes", "tensor_parallel", "fabric"),
    [
        ([1, 1], 1, 1, "disabled"),  # one chip (N150)
        ([1, 2], 1, 2, "fabric_1d"),  # N300: one lane over both chips
        ([1, 2], 2, 1, "disabled"),  # N300 as two data-parallel lanes
        ([1, 8], 1, 8, "fabric_1d"),  # T3K
        ([4, 8], 4, 8, "fabric_1d"),  # Galaxy: four 1x8 lanes
        ([4, 8], 32, 1, "disabled"),  # Galaxy: 32 one-chip lanes
        ([4, 8], 1, 32, "fabric_1d"),  # Galaxy as one 2-D lane of 32 chips
        ([4, 8], 2, 16, "fabric_1d"),  # Galaxy as two 2x8 lanes
    ],
    ids=["n150", "n300", "n300-dp2", "t3k", "galaxy-dp4", "galaxy-dp32", "galaxy-2d", "2x8"],
)
def test_tensor_parallel_degree_and_fabric_follow_the_mesh_and_lanes(
    mesh: list[int], lanes: int, tensor_parallel: int, fabric: str
) -> None:
    """Left unset, ``device.ttnn.tensor_parallel`` is a lane's chips and the fabric is
    ``fabric_1d`` exactly when a lane's layers span chips (their collectives need it)."""
    recipe = build(**TT, **{"device.mesh_shape": mesh, "lanes": lanes})
    assert recipe.device.ttnn.tensor_parallel == tensor_parallel
    assert recipe.device.ttnn.fabric_config == fabric
    stated = build(
        **TT, **{"device.mesh_shape": mesh, "lanes": lanes,
                 "device.ttnn.tensor_parallel": tensor_parallel}
    )  # fmt: skip
    assert stated == recipe


@pytest.mark.parametrize(
    ("settings", "field", "message"),
    [
        ({"device.mesh_shape": [1, 8], "device.ttnn.tensor_parallel": 4},
         "device.ttnn.tensor_parallel", r"lanes \(1\) x tensor_parallel must be the 8 chips.*"
         r"lanes=2 with tensor_parallel=4"),
        ({"device.mesh_shape": [4, 8], "device.ttnn.tensor_parallel": 8},
         "device.ttnn.tensor_parallel", r"lanes=4 with tensor_parallel=8"),
        ({"device.mesh_shape": [4, 6], "lanes": 3},
         "device.ttnn.tensor_parallel", r"one mesh row .* or whole rows .* 8 chips are neither"),
        ({"device.mesh_shape": [1, 8], "device.ttnn.fabric_config": "disabled"},
         "device.ttnn.fabric_config", r"tensor_parallel=8 needs a fabric"),
        ({"device.ttnn.tensor_parallel": 0}, "device.ttnn.tensor_parallel", "positive integer"),
    ],
    ids=["t3k-half", "galaxy-one-lane-of-8", "rows-split-unevenly", "no-fabric", "zero"],
)  # fmt: skip
def test_invalid_mesh_lane_and_tensor_parallel_combinations_are_named(
    settings: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(RecipeError, match=message) as error:
        build(**TT, **settings)
    assert error.value.field == field


def test_decoder_families_run_on_ttnn_and_gguf_blocks_are_dequantized_there() -> None:
    """A decoder family validates on ttnn (its parts are checked at build); gguf-native
    weights are accepted there (dequantized once at load), int8/int4 are not."""
    recipe = build(**{"device.backend": "ttnn"})
    assert (recipe.family, recipe.device.ttnn.weight_dtype) == ("llama", "bfloat8_b")
    data = tiny()
    data["model"] = {}
    overrides = {
        **GGUF,
        "tokenizer.source": "checkpoint",
        "checkpoint.weights": "gguf-native",
        "device.backend": "ttnn",
    }
    assert recipe_from_dict(data, overrides=overrides).device.backend == "ttnn"


def test_cuda_device_takes_an_index() -> None:
    recipe = build(**{"device.kind": "cuda", "device.index": 1})
    assert recipe.device.torch_device == "cuda:1"


def test_family_and_model_type_must_agree_before_anything_loads() -> None:
    data = tiny()
    data["model"]["model_type"] = "gemma2"
    with pytest.raises(RecipeError, match=r"^model\.model_type: is not handled by family llama"):
        recipe_from_dict(data)
    data["family"] = "auto"
    assert recipe_from_dict(data).model["model_type"] == "gemma2"
    data["model"]["model_type"] = "mamba"
    refusal = r"^model\.model_type: no installed family handles"
    with pytest.raises(RecipeError, match=refusal) as err:
        recipe_from_dict(data)
    # It points to the guide and lists what a user can run, not the test-only families.
    assert "docs/writing-a-family.md" in str(err.value)
    assert "gemma2" in str(err.value) and "toy_ttnn" not in str(err.value)


@pytest.mark.parametrize(
    ("override", "field", "reason"),
    [
        (
            {"model.rope_scaling": {"rope_type": "su"}},
            "model.rope_scaling.rope_type",
            "unsupported RoPE",
        ),
        ({"model.hidden_act": "mish"}, "model.hidden_act", "unsupported activation"),
        ({"model.partial_rotary_factor": 0.5}, "model.partial_rotary_factor", "rotary"),
        ({"model.quantization_config": {"bits": 4}}, "model.quantization_config", "quantized"),
    ],
)
def test_unsupported_model_options_are_named_at_validation(
    override: dict[str, Any], field: str, reason: str
) -> None:
    with pytest.raises(RecipeError, match=reason) as info:
        build(**override)
    assert info.value.field == field


def test_a_family_needs_its_required_config_keys() -> None:
    data = tiny()
    del data["model"]["intermediate_size"]
    with pytest.raises(RecipeError, match=r"^model\.intermediate_size: is required"):
        recipe_from_dict(data)


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(RecipeError, match=r"^checkpoint\.format: must be one of"):
        CheckpointSpec(format="pickle")  # type: ignore[arg-type]
    ok = build()
    with pytest.raises(RecipeError, match=r"^lanes: "):
        attrs.evolve(ok, lanes=-1)
    with pytest.raises(RecipeError, match=r"^kv_cache: must be a PagedKVCacheConfig"):
        attrs.evolve(ok, kv_cache={"block_size": 16})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^kv_cache\.block_size: must be a power of two"):
        attrs.evolve(ok, kv_cache=PagedKVCacheConfig(block_size=12, max_num_blocks=4))


def test_family_registered_in_process_is_usable_by_recipes() -> None:
    from llmrt.families import llama, registry

    plugin = attrs.evolve(llama.FAMILY, name="mamba", model_types=("mamba",))
    with registry.register(plugin):
        assert "mamba" in recipe_schema.registered_families()
        data = tiny()
        data["family"] = "mamba"
        data["model"]["model_type"] = "mamba"
        assert recipe_from_dict(data).family == "mamba"
        with pytest.raises(RecipeError, match=r"known: auto, .*gemma, .*gpt2, .*mamba"):
            build(family="rwkv")
    assert "mamba" not in recipe_schema.registered_families()


def test_builtin_families_are_registered_entry_points() -> None:
    assert {"auto", "llama", "gpt2"} <= set(recipe_schema.registered_families())


def test_wave_rules_default_to_ragged_for_eager_cpu_prefill_packed_elsewhere_on_torch() -> None:
    assert build().prefill_runs_eagerly and build().wave_rules == "ragged"
    assert build(**{"trace.mode": "decode_only"}).wave_rules == "ragged"
    # Captured or compiled prefill steps have fixed shapes: one padded length per wave.
    assert build(**{"trace.mode": "all"}).wave_rules == "packed"
    assert build(**{"device.compile": "inductor"}).wave_rules == "packed"
    decode_only = build(**{"device.compile": "inductor", "device.inductor.operations": ["decode"]})
    assert decode_only.wave_rules == "ragged"
    assert build(**{"device.kind": "cuda"}).wave_rules == "packed"
    assert build(**{"device.kind": "cuda", "prefill.wave_rules": "ragged"}).wave_rules == "ragged"
    assert build(**TT).wave_rules == "spec"
    assert build(**{"prefill.wave_rules": "spec"}).wave_rules == "spec"


@pytest.mark.parametrize(
    "overrides",
    [
        {"trace.mode": "all"},
        {"device.compile": "inductor"},
        {"device.compile": "inductor", "device.inductor.operations": ["prefill"]},
    ],
)
def test_ragged_wave_rules_need_eager_prefill_steps(overrides: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="ragged needs eager prefill steps") as err:
        build(**overrides, **{"prefill.wave_rules": "ragged"})
    assert err.value.field == "prefill.wave_rules"


def test_decode_batch_sizes_default_to_powers_of_two_on_torch_and_the_capacity_on_ttnn() -> None:
    assert build(**{"decode.lane_capacity": 12}).decode_batch_sizes == (1, 2, 4, 8, 12)
    assert build(**{"decode.lane_capacity": 1}).decode_batch_sizes == (1,)
    ttnn = build(**TT, **{"decode.lane_capacity": 8})
    assert ttnn.decode_batch_sizes == (8,)
    given = build(**{"decode.lane_capacity": 8, "decode.batch_sizes": [2, 8]})
    assert given.decode_batch_sizes == (2, 8)
    assert build(**{"decode.batch_sizes": [1], "decode.lane_capacity": 4}).decode_batch_sizes == (
        1,
        4,
    )
    assert build(**{"decode.batch_sizes": [], "decode.lane_capacity": 4}).decode_batch_sizes == (4,)


@pytest.mark.parametrize(
    ("overrides", "lengths", "batches"),
    [
        ({"prefill.max_chunk_size": 32}, (32,), (1, 2)),  # 64 runs in 32-token chunks
        ({"warmup.prefill_seq_lens": [32, 256]}, (32, 128), (1, 2)),
        ({"warmup.prefill_seq_lens": [32, 48]}, (32, 64), (1, 2)),  # 48 pads to 64
        ({"prefill.seq_len_buckets": "tile"}, (128,), (1, 2)),
        ({"warmup.prefill_batch_sizes": [1, 8]}, (32, 64), (1,)),
        ({"warmup.prefill_batch_sizes": [8], "prefill.max_batch_size": 2}, (32, 64), (2,)),
        ({"decode.lane_capacity": 1}, (32, 64), (1,)),  # a wave holds at most a lane's rows
        ({"warmup.prefill_batch_sizes": [4], "decode.lane_capacity": 3}, (32, 64), (2,)),
    ],
)
def test_warmup_follows_the_prefill_fields_it_depends_on(
    overrides: dict[str, Any], lengths: tuple[int, ...], batches: tuple[int, ...]
) -> None:
    """Overriding a prefill field never fails on the warmup fields derived from it."""
    recipe = build(**overrides)
    assert recipe.warmup.prefill_seq_lens == lengths
    assert recipe.warmup.prefill_batch_sizes == batches


def test_bundled_recipe_takes_a_smaller_chunk_override() -> None:
    from llmrt.recipe.loader import load_recipe

    recipe = load_recipe("smollm2-135m", overrides=["prefill.max_chunk_size=32"])
    assert recipe.prefill.max_chunk_size == 32
    assert max(recipe.warmup.prefill_seq_lens) <= 32


def test_weight_format_defaults_to_the_compute_dtype() -> None:
    assert build().checkpoint.weight_format == "float32"
    assert build(**{"checkpoint.dtype": "bfloat16"}).checkpoint.weight_format == "bfloat16"
    assert build(**{"checkpoint.weights": "int4"}).checkpoint.weight_format == "int4"
    data = tiny()
    data["model"] = {}
    overrides = {**GGUF, "tokenizer.source": "checkpoint", "checkpoint.weights": "gguf-native"}
    native = recipe_from_dict(data, overrides=overrides)
    assert native.checkpoint.weight_format == "gguf-native"


def test_more_threads_than_cpus_run_as_many_as_the_cpus_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch
    from llmrt.containers import factories

    monkeypatch.setattr(factories, "usable_cpus", lambda: 2)
    before = torch.get_num_threads()
    try:
        with pytest.warns(RuntimeWarning, match="num_threads=8 is more than the 2 CPUs"):
            threads = factories.set_torch_threads(recipe=build(**{"device.num_threads": 8}))
        assert (threads.wanted, torch.get_num_threads()) == (2, 2)
        threads = factories.set_torch_threads(recipe=build(**{"device.num_threads": 1}))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
