"""Model families discovered through the ``llmrt.families`` entry-point group.

``get_family("llama")`` picks a family by name; ``family_for_model_type("qwen2")``
resolves ``family: auto`` from a checkpoint's ``config.json`` ``model_type``.
"""

from __future__ import annotations

import functools
from importlib.metadata import EntryPoint, entry_points

from llmrt.errors import FamilyError
from llmrt.families.base import Family

GROUP = "llmrt.families"


@functools.cache
def _entry_points() -> tuple[EntryPoint, ...]:
    """The group's entry points, sorted by name (read once; installs do not change at runtime)."""
    found = sorted(entry_points(group=GROUP), key=lambda ep: ep.name)
    names = [ep.name for ep in found]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise FamilyError(f"family name(s) registered more than once in {GROUP}: {duplicates}")
    return tuple(found)


def family_names() -> tuple[str, ...]:
    """Names of every installed family, sorted."""
    return tuple(ep.name for ep in _entry_points())


def get_family(name: str) -> Family:
    """The family registered as ``name``; ``FamilyError`` listing the known ones otherwise."""
    for ep in _entry_points():
        if ep.name == name:
            return _load(ep)
    raise FamilyError(f"unknown model family {name!r}; known families: {', '.join(family_names())}")


def family_for_model_type(model_type: str) -> Family:
    """The one family whose ``model_types`` include ``model_type`` (for ``family: auto``)."""
    matches = [
        family
        for family in (_load(ep) for ep in _entry_points())
        if model_type in family.model_types
    ]
    if len(matches) == 1:
        return matches[0]
    if matches:
        claimants = ", ".join(family.name for family in matches)
        raise FamilyError(f"model_type {model_type!r} is claimed by several families: {claimants}")
    known = sorted({t for ep in _entry_points() for t in _load(ep).model_types})
    raise FamilyError(
        f"no installed family handles model_type {model_type!r}; "
        f"known model types: {', '.join(known)} (families: {', '.join(family_names())})"
    )


def _load(ep: EntryPoint) -> Family:
    try:
        family = ep.load()
    except Exception as exc:
        raise FamilyError(f"family {ep.name!r} ({ep.value}) failed to load: {exc}") from exc
    if not isinstance(family, Family):
        raise FamilyError(
            f"family {ep.name!r} ({ep.value}) is a {type(family).__name__}, "
            "not a Family (needs name, model_types, model_config, expected_tensors, "
            "optional_tensors, build)"
        )
    if family.name != ep.name:
        raise FamilyError(
            f"family entry point {ep.name!r} ({ep.value}) names itself {family.name!r}"
        )
    return family
