"""vLLM glue without a model: recipe choice from hf_config, sampling columns, registration."""

from __future__ import annotations

import importlib
import json
import pathlib
from types import SimpleNamespace

import pytest
import tomllib

from llmrt.errors import ConfigError, RequestError
from llmrt.sampling.params import SamplingParams
from llmrt.vllm.recipe import merge_overrides, select_recipe
from llmrt.vllm.registration import MAIN_CLASS, main, register, write_bundle
from llmrt.vllm.sampling import params_from_columns, per_row_params

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _hf(name: str, arch: str = "TTLlamaForCausalLM") -> SimpleNamespace:
    return SimpleNamespace(_name_or_path=name, architectures=[arch], model_type="llama")


# -- recipe choice ------------------------------------------------------------------------


def test_a_bundled_checkpoint_is_found_by_its_hub_name() -> None:
    choice = select_recipe(hf_config=_hf("HuggingFaceTB/SmolLM2-135M-Instruct"), env={})
    assert (choice.recipe, choice.overrides) == ("smollm2-135m", ())


def test_a_local_checkpoint_of_a_served_architecture_uses_the_hf_recipe(
    tmp_path: pathlib.Path,
) -> None:
    choice = select_recipe(
        hf_config=_hf(str(tmp_path)), env={"LLMRT_VLLM_OVERRIDES": "lanes=2 'trace.mode=all'"}
    )
    assert choice.recipe == "hf"
    assert choice.overrides == (f"checkpoint.path={tmp_path}", "lanes=2", "trace.mode=all")


#: The Hugging Face classes of the sixteen architectures llmrt's families serve.
SERVED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GraniteForCausalLM", "GemmaForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM",
    "GPTNeoXForCausalLM", "StableLmForCausalLM", "Starcoder2ForCausalLM", "GPT2LMHeadModel",
    "PhiForCausalLM", "CohereForCausalLM", "NemotronForCausalLM", "OlmoForCausalLM",
    "HeliumForCausalLM", "GlmForCausalLM", "SmolLM3ForCausalLM", "Qwen2MoeForCausalLM",
)  # fmt: skip


def test_the_served_architectures_are_every_registered_familys() -> None:
    from llmrt.families.registry import families

    declared = {a for f in families() for a in getattr(f, "architectures", ())}
    assert declared == set(SERVED_ARCHITECTURES)


@pytest.mark.parametrize("arch", ["TTQwen3MoeForCausalLM", "TTGemma2ForCausalLM"])
def test_any_registered_familys_architecture_is_served_from_a_local_directory(
    tmp_path: pathlib.Path, arch: str
) -> None:
    choice = select_recipe(hf_config=_hf(str(tmp_path), arch), env={})
    assert (choice.recipe, choice.overrides) == ("hf", (f"checkpoint.path={tmp_path}",))


def test_the_environment_recipe_wins_and_an_unknown_model_names_the_variable() -> None:
    env = {"LLMRT_VLLM_RECIPE": "tiny-llama"}
    assert select_recipe(hf_config=_hf("org/Unknown-7B", "MysteryLM"), env=env).recipe == (
        "tiny-llama"
    )
    with pytest.raises(ConfigError, match=r"^hf_config: no llmrt recipe .*LLMRT_VLLM_RECIPE"):
        select_recipe(hf_config=_hf("org/Unknown-7B", "MysteryLM"), env={})
    with pytest.raises(ConfigError, match="is a LlamaForCausalLM but neither a local"):
        select_recipe(hf_config=_hf("meta-llama/Llama-3.1-8B"), env={"HF_HUB_CACHE": "/none"})


def _cache_snapshot(cache: pathlib.Path, repo: str, *, weights: bool) -> pathlib.Path:
    """The layout huggingface_hub writes: ``models--org--name/{refs/main,snapshots/<sha>}``."""
    root = cache / ("models--" + repo.replace("/", "--"))
    sha = "0123456789abcdef0123456789abcdef01234567"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(sha)
    snapshot = root / "snapshots" / sha
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    if weights:
        (snapshot / "model.safetensors").write_bytes(b"")
    return snapshot


@pytest.mark.parametrize("arch", SERVED_ARCHITECTURES)
def test_a_hub_name_of_every_served_architecture_resolves_to_its_cached_snapshot(
    tmp_path: pathlib.Path, arch: str
) -> None:
    snapshot = _cache_snapshot(tmp_path / "hub", "org/model", weights=True)
    for env in ({"HF_HUB_CACHE": str(tmp_path / "hub")}, {"HF_HOME": str(tmp_path)}):
        choice = select_recipe(hf_config=_hf("org/model", f"TT{arch}"), env=env)
        assert (choice.recipe, choice.overrides) == ("hf", (f"checkpoint.path={snapshot}",))


def test_a_cached_hub_config_without_weights_is_refused_naming_the_download(
    tmp_path: pathlib.Path,
) -> None:
    _cache_snapshot(tmp_path, "org/model", weights=False)
    with pytest.raises(ConfigError, match=r"huggingface-cli download org/model"):
        select_recipe(hf_config=_hf("org/model"), env={"HF_HUB_CACHE": str(tmp_path)})


def test_vllm_sizes_may_not_silently_override_a_users_setting() -> None:
    assert merge_overrides(["lanes=2"], {"lanes": 2}) == ["lanes=2", "lanes=2"]
    with pytest.raises(ConfigError, match=r"^lanes: vLLM's value disagrees .*lanes=1"):
        merge_overrides(["lanes=1"], {"lanes": 2})


# -- sampling columns ---------------------------------------------------------------------


def test_plugin_sampling_columns_become_llmrt_params() -> None:
    columns = SimpleNamespace(
        temperature=[0.0, 0.8, 0.7, 0.6],
        top_k=[1, 258, 40, 1],  # 1: argmax; the vocabulary size: top-k off
        top_p=[0.0, 0.9, 1.0, 0.0],  # the plugin zeroes top_p with top_k == 1
        presence_penalty=0.0,
        frequency_penalty=[0.0, 0.0, 0.5, 0.0],
        repetition_penalty=[1.0, 1.2, 1.0, 1.0],
        seed=[None, 7, -1, 3],  # -1: the plugin's tensor sentinel for no seed
        num_logprobs=[-2, 0, -2, -2],
        enable_log_probs=[False, True, False, False],
    )

    rows = params_from_columns(columns, 4, vocab_size=258)

    assert rows[0] == rows[3] == SamplingParams(temperature=0.0)
    assert rows[1] == SamplingParams(
        temperature=0.8, top_p=0.9, seed=7, repetition_penalty=1.2, logprobs=0
    )
    assert rows[2] == SamplingParams(temperature=0.7, top_k=40, frequency_penalty=0.5)


def test_a_bad_column_names_its_row_and_field() -> None:
    columns = SimpleNamespace(
        temperature=[0.5, 0.5], top_k=[0, 0], top_p=[1.0, 1.0], repetition_penalty=[1.0, 0.0]
    )
    with pytest.raises(RequestError, match=r"^row 1: sampling_params.repetition_penalty"):
        params_from_columns(columns, 2, vocab_size=258)
    short = SimpleNamespace(temperature=[0.5], top_k=[0, 0, 0], top_p=[1.0, 1.0])
    with pytest.raises(RequestError, match=r"^sampling_params.top_p: has 2 entries for 3 rows"):
        per_row_params(short, 3, vocab_size=258)


# -- registration -------------------------------------------------------------------------


class Registry:
    def __init__(self) -> None:
        self.models: dict[str, str] = {"TTLlamaForCausalLM": "models.tt_transformers:Llama"}

    def register_model(self, arch: str, path: str) -> None:
        self.models[arch] = path


def test_registration_is_opt_in_and_then_replaces_the_plugins_class() -> None:
    registry = Registry()
    assert register(registry, env={}) == []
    assert registry.models["TTLlamaForCausalLM"] == "models.tt_transformers:Llama"

    names = register(registry, env={"LLMRT_VLLM_RECIPE": "smollm2-135m"})

    # Every architecture a registered family serves.
    assert names == sorted(f"TT{arch}" for arch in SERVED_ARCHITECTURES)
    assert all(registry.models[n] == MAIN_CLASS for n in names)
    assert register(
        Registry(), env={"LLMRT_VLLM": "1", "LLMRT_VLLM_ARCHITECTURES": "TTQwen2X"}
    ) == ["TTQwen2X"]


def test_the_bundle_is_what_the_plugins_extra_models_dir_reads(tmp_path: pathlib.Path) -> None:
    assert main([str(tmp_path), "--arch", "LlamaForCausalLM"]) == 0
    meta = json.loads((tmp_path / "llmrt-LlamaForCausalLM" / "vllm_metadata.json").read_text())
    assert meta == {"arch": "LlamaForCausalLM", "main_class": MAIN_CLASS}
    module, _, name = meta["main_class"].partition(":")
    cls = getattr(importlib.import_module(module), name)
    assert callable(cls.initialize_vllm_model) and callable(cls.get_max_tokens_all_users)
    assert len(write_bundle(tmp_path / "all")) == len(SERVED_ARCHITECTURES)


def test_the_vllm_entry_point_is_declared() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    assert plugins == {"llmrt": "llmrt.vllm.registration:register"}
