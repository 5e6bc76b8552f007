"""Family discovery through the ``llmrt.families`` entry-point group."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import attrs
import pytest
import torch

from llmrt.errors import FamilyError
from llmrt.families import gpt2, llama, registry
from llmrt.families.base import Family


@attrs.frozen
class _Impostor:
    """A second family claiming ``llama`` checkpoints (for the ambiguity check)."""

    name: str = "impostor"
    model_types: tuple[str, ...] = ("llama",)
    model_config = llama.FAMILY.model_config
    expected_tensors = llama.FAMILY.expected_tensors
    optional_tensors = llama.FAMILY.optional_tensors
    build = llama.FAMILY.build


IMPOSTOR = _Impostor()


def _use(monkeypatch: pytest.MonkeyPatch, *points: tuple[str, str]) -> None:
    eps = tuple(EntryPoint(name=n, value=v, group=registry.GROUP) for n, v in points)
    monkeypatch.setattr(registry, "_entry_points", lambda: eps)


def test_installed_families_are_discovered() -> None:
    assert {"llama", "gpt2"} <= set(registry.family_names())
    assert registry.get_family("llama") is llama.FAMILY
    assert registry.get_family("gpt2") is gpt2.FAMILY
    assert isinstance(llama.FAMILY, Family) and isinstance(gpt2.FAMILY, Family)


def test_unknown_family_lists_the_known_ones() -> None:
    with pytest.raises(FamilyError, match=r"unknown model family 'nope'.*gpt2.*llama"):
        registry.get_family("nope")


@pytest.mark.parametrize(
    ("model_type", "family"),
    [
        ("llama", "llama"), ("mistral", "mistral"), ("mixtral", "mistral"), ("qwen2", "qwen2"),
        ("qwen3_moe", "qwen3"), ("granite", "granite"), ("gemma3_text", "gemma3"),
        ("gpt2", "gpt2"),
    ],
)  # fmt: skip
def test_auto_resolves_model_types(model_type: str, family: str) -> None:
    assert registry.family_for_model_type(model_type).name == family


def test_unknown_model_type_names_it_and_the_known_ones() -> None:
    with pytest.raises(FamilyError, match=r"'bert'.*gpt2, .*llama, mistral, .*qwen2"):
        registry.family_for_model_type("bert")


def test_broken_entry_point_is_a_family_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _use(monkeypatch, ("broken", "llmrt_no_such_module:FAMILY"))
    with pytest.raises(FamilyError, match=r"'broken'.*failed to load"):
        registry.get_family("broken")


def test_entry_point_must_be_a_family_named_like_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    _use(
        monkeypatch,
        ("types", "llmrt.families.llama:MODEL_TYPES"),
        ("llama", "llmrt.families.gpt2:FAMILY"),
    )
    with pytest.raises(FamilyError, match="not a Family"):
        registry.get_family("types")
    with pytest.raises(FamilyError, match="names itself 'gpt2'"):
        registry.get_family("llama")


def test_model_type_claimed_twice_is_ambiguous(monkeypatch: pytest.MonkeyPatch) -> None:
    _use(
        monkeypatch,
        ("llama", "llmrt.families.llama:FAMILY"),
        ("gpt2", "llmrt.families.gpt2:FAMILY"),
        ("impostor", f"{__name__}:IMPOSTOR"),
    )
    with pytest.raises(
        FamilyError, match="'llama' is claimed by several families: impostor, llama"
    ):
        registry.family_for_model_type("llama")
    assert registry.family_for_model_type("gpt2") is gpt2.FAMILY


def test_register_is_a_context_manager_and_never_shadows() -> None:
    family = attrs.evolve(llama.FAMILY, name="toy", model_types=("toy",))
    with registry.register(family) as registered:
        assert registered is family
        assert registry.get_family("toy") is family
        assert registry.family_for_model_type("toy") is family
        assert "toy" in registry.family_names()
        with pytest.raises(FamilyError, match="'toy' is already registered"):
            registry.register(family)
    assert "toy" not in registry.family_names()
    with pytest.raises(FamilyError, match="already registered"):
        registry.register(attrs.evolve(llama.FAMILY))  # the installed llama
    with pytest.raises(FamilyError, match="not a Family"):
        registry.register(object())


def test_every_family_declares_what_the_registry_records() -> None:
    """Model types, required keys, tensor plan and backends come from each family."""
    for family in registry.families():
        assert family.model_types and registry.required_keys(family)
        backends = family.backends  # type: ignore[attr-defined]
        assert backends and set(backends) <= {"torch", "ttnn"}
        assert registry.family_backends(family) == tuple(backends)
    assert registry.family_backends(registry.get_family("toy_ttnn")) == ("ttnn",)


def test_each_familys_architectures_are_transformers_classes_of_its_model_types() -> None:
    """``family.architectures`` (what vLLM registers) name, per model type, the class
    transformers builds for it; gguf maps are served by the registry, by architecture."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    served = registry.hf_architectures()
    for family in registry.families():
        declared = getattr(family, "architectures", ())
        if family.name == "toy_ttnn":
            continue
        assert set(declared) == {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[t] for t in family.model_types}
        assert all(served[arch] == family.name for arch in declared)
    # llama.cpp's architectures are the weights layer's table, none a shipped family's own;
    # each runs under the one family claiming each model type its files state.
    from llmrt.weights.gguf_architectures import LLAMA_CPP_ARCHITECTURES

    assert registry.gguf_architectures() == {}
    for name, gguf in LLAMA_CPP_ARCHITECTURES.items():
        assert gguf.name == name and gguf.model_types, name
        for model_type in gguf.model_types:
            registry.family_for_model_type(model_type)


def test_a_recipe_naming_the_old_family_of_a_model_type_is_told_the_new_one() -> None:
    """Llama's family once claimed Mistral, Mixtral, Qwen2/3 and Granite; each now has its
    own family, and the error for ``family: llama`` over such a config names it."""
    from llmrt.errors import CheckpointError

    qwen2 = {
        "model_type": "qwen2",
        "vocab_size": 32,
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "max_position_embeddings": 64,
    }
    with pytest.raises(CheckpointError, match=r"not handled by family 'llama'.*family: qwen2"):
        llama.FAMILY.model_config(qwen2, dtype=torch.float32)
    assert registry.get_family("qwen2").model_config(qwen2, dtype=torch.float32).num_layers == 1


def test_readme_lists_exactly_the_registered_families() -> None:
    """README's family table is ``gguf_architectures.family_table()`` (regenerate it from
    there): every family, its model types and the GGUF architectures it runs."""
    import re
    from pathlib import Path

    from llmrt.weights.gguf_architectures import family_table

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"<!-- families:begin[^>]*-->\n(.*?)<!-- families:end -->", readme, re.S)
    assert block is not None, "README lost its families block"
    assert block.group(1) == family_table()


@pytest.mark.parametrize(
    "module",
    ["cohere", "nemotron", "helium", "glm", "smollm3", "qwen2_moe", "olmo2",
     "phi3", "stablelm", "starcoder2"],
)  # fmt: skip
def test_a_family_is_one_short_module_of_parts(module: str) -> None:
    """A family is a config mapping: one module of at most 60 lines, a plain
    ``DecoderFamily`` (no ``build`` override, nothing replaced after the build)."""
    import importlib
    import inspect

    from llmrt.families.decoder_family import DecoderFamily

    loaded = importlib.import_module(f"llmrt.families.{module}")
    assert len(inspect.getsource(loaded).splitlines()) <= 60
    assert type(loaded.FAMILY) is DecoderFamily
