"""Declared checkpoint renames (``llmrt.families.renames``): what GPT-2's and GPT-NeoX's
families state as data instead of a hand-written function."""

from __future__ import annotations

import pytest
import torch

from llmrt.errors import CheckpointError
from llmrt.families import gpt2, gpt_neox
from llmrt.families.renames import BaseModelPrefix, LegacyNames

ONE = torch.ones(1)
TWO = torch.full((1,), 2.0)


def test_bare_names_get_the_prefix_only_where_the_plan_expects_it() -> None:
    rename = BaseModelPrefix("transformer.")
    expected = {"transformer.wte.weight": (1,), "lm_head.weight": (1,)}
    out = rename({"wte.weight": ONE, "lm_head.weight": TWO}, expected=expected, config={})
    assert out == {"transformer.wte.weight": ONE, "lm_head.weight": TWO}


def test_a_bare_and_a_prefixed_name_of_one_tensor_is_an_error() -> None:
    rename = BaseModelPrefix("transformer.")
    tensors = {"transformer.wte.weight": ONE, "wte.weight": TWO}
    with pytest.raises(CheckpointError, match=r"duplicates transformer\.wte\.weight"):
        rename(tensors, expected={"transformer.wte.weight": (1,)}, config={})


def test_a_legacy_name_becomes_the_current_one_and_both_are_an_error() -> None:
    rename = LegacyNames({"embed_out.weight": "lm_head.weight"})
    assert rename({"embed_out.weight": ONE}, expected={}, config={}) == {"lm_head.weight": ONE}
    assert rename({"lm_head.weight": TWO}, expected={}, config={}) == {"lm_head.weight": TWO}
    with pytest.raises(CheckpointError, match=r"duplicates lm_head\.weight"):
        rename({"embed_out.weight": ONE, "lm_head.weight": TWO}, expected={}, config={})


def test_the_families_declare_them() -> None:
    """GPT-2's original files hold bare names; older GPT-NeoX files call the head embed_out."""
    assert gpt2.FAMILY.rename == BaseModelPrefix("transformer.")
    assert gpt_neox.FAMILY.rename == LegacyNames({"embed_out.weight": "lm_head.weight"})
