"""The one place family knowledge is looked up: installed entry points plus families
registered in-process.

``get_family("llama")`` picks a family by name; ``family_for_model_type("qwen2")``
resolves ``family: auto`` from a checkpoint's ``config.json`` ``model_type``;
``register(family)`` adds one in-process (a test, a notebook) and, used as a context
manager, removes it again on exit. What the registry knows about each family (model
types, the config keys a random checkpoint needs, tensor names and shapes, random-weight
initialisation, GGUF architecture, backends) is read from the family object itself.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from importlib.metadata import EntryPoint, entry_points
from types import TracebackType
from typing import Any

from llmrt.errors import FamilyError, RecipeError
from llmrt.families.base import Family

GROUP = "llmrt.families"
#: Where a user learns to add a family (named by errors about a model no family reads).
WRITING_A_FAMILY = "docs/writing-a-family.md"
#: Modules whose families exist for tests (fakes), never listed to a user as supported.
TEST_ONLY_MODULES = ("llmrt.testing.",)
#: Entry points a package adds parts through (activations, norms: ``forms.register_*``);
#: each names a module or a callable, imported (called) once before any family is looked up.
PARTS_GROUP = "llmrt.parts"
#: Backends a family supports when it does not declare ``backends``.
DEFAULT_BACKENDS: tuple[str, ...] = ("torch",)

_REGISTERED: dict[str, Family] = {}


@functools.cache
def load_parts() -> tuple[str, ...]:
    """Import every ``llmrt.parts`` entry point (calling it when it is callable), once, so the
    parts a package registers exist before a family reads a config that names them; returns
    their names. A plugin that fails is a ``FamilyError`` naming it."""
    loaded = []
    for ep in sorted(entry_points(group=PARTS_GROUP), key=lambda ep: ep.name):
        try:
            target = ep.load()
            if callable(target):
                target()
        except Exception as exc:
            why = f"parts plugin {ep.name!r} ({ep.value}) failed to load: {exc}"
            raise FamilyError(why) from exc
        loaded.append(ep.name)
    return tuple(loaded)


@functools.cache
def _entry_points() -> tuple[EntryPoint, ...]:
    """The group's entry points, sorted by name (read once; installs do not change at runtime)."""
    load_parts()
    found = sorted(entry_points(group=GROUP), key=lambda ep: ep.name)
    names = [ep.name for ep in found]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise FamilyError(f"family name(s) registered more than once in {GROUP}: {duplicates}")
    return tuple(found)


class Registration:
    """A family registered in-process; ``with`` it (or call ``remove``) to unregister."""

    def __init__(self, family: Family) -> None:
        self.family = family

    def remove(self) -> None:
        """Unregister the family (idempotent)."""
        if _REGISTERED.get(self.family.name) is self.family:
            del _REGISTERED[self.family.name]

    def __enter__(self) -> Family:
        return self.family

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()


def register(family: Any) -> Registration:
    """Register ``family`` under its own name, beside the installed entry points.

    A name already installed or registered is a ``FamilyError`` (families are never
    silently shadowed). ``with register(f): ...`` unregisters it on exit.
    """
    checked = _check(family, source="register()", name=getattr(family, "name", None))
    if checked.name in _REGISTERED or checked.name in (ep.name for ep in _entry_points()):
        raise FamilyError(f"family {checked.name!r} is already registered")
    _REGISTERED[checked.name] = checked
    return Registration(checked)


def family_names() -> tuple[str, ...]:
    """Names of every installed or registered family, sorted."""
    return tuple(sorted({ep.name for ep in _entry_points()} | set(_REGISTERED)))


def families() -> tuple[Family, ...]:
    """Every family, by name."""
    return tuple(get_family(name) for name in family_names())


def get_family(name: str) -> Family:
    """The family registered as ``name``; ``FamilyError`` listing the known ones otherwise."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    for ep in _entry_points():
        if ep.name == name:
            return _load(ep)
    raise FamilyError(f"unknown model family {name!r}; known families: {', '.join(family_names())}")


def model_types() -> tuple[str, ...]:
    """Every model type some family claims, sorted."""
    return tuple(sorted({t for family in families() for t in family.model_types}))


def user_families() -> tuple[Family, ...]:
    """The families a user can run: every loadable one but the test-only fakes (defined
    under ``TEST_ONLY_MODULES``, e.g. ``toy_ttnn``)."""
    return tuple(
        family
        for family in _loadable_families()
        if not type(family).__module__.startswith(TEST_ONLY_MODULES)
        and not _entry_value(family.name).startswith(TEST_ONLY_MODULES)
    )


def _entry_value(name: str) -> str:
    return next((ep.value for ep in _entry_points() if ep.name == name), "")


def family_for_model_type(model_type: str) -> Family:
    """The one family whose ``model_types`` include ``model_type`` (for ``family: auto``)."""
    everything = families()
    matches = [family for family in everything if model_type in family.model_types]
    if len(matches) == 1:
        return matches[0]
    if matches:
        claimants = ", ".join(family.name for family in matches)
        raise FamilyError(f"model_type {model_type!r} is claimed by several families: {claimants}")
    supported = user_families()
    types = sorted({t for family in supported for t in family.model_types})
    raise FamilyError(
        f"no installed family handles model_type {model_type!r}; "
        f"known model types: {', '.join(types)} "
        f"(families: {', '.join(f.name for f in supported)}). To add one, write a family "
        f"({WRITING_A_FAMILY}) or declare the parts in the recipe (model.parts)"
    )


def claimed_by(model_type: str) -> str:
    """``"; family 'x' reads it (family: x or auto)"`` naming the families that claim
    ``model_type`` (for an error about a recipe naming another family), else ``""``."""
    names = [family.name for family in _loadable_families() if model_type in family.model_types]
    if not names:
        return ""
    which = " or ".join(f"family: {name}" for name in names)
    return f"; family {' / '.join(repr(n) for n in names)} reads it ({which}, or family: auto)"


def family_table(gguf: Mapping[str, Sequence[str]] | None = None) -> str:
    """The served families as a Markdown table: each with its model types and the GGUF
    architectures it runs (its own ``gguf`` declaration, and ``gguf``: family name -> the
    ``general.architecture`` names of llama.cpp's table that map onto it). README's list is
    ``llmrt.weights.gguf_architectures.family_table()``, which passes that table."""
    rows = [
        "| family | `model_type` | GGUF architecture |",
        "| --- | --- | --- |",
    ]
    for family in user_families():
        own = getattr(family, "gguf_architecture", None)
        archs = sorted({*([own] if own else []), *(gguf or {}).get(family.name, ())})
        types = ", ".join(f"`{t}`" for t in family.model_types)
        runs = ", ".join(f"`{arch}`" for arch in archs) or "-"
        rows.append(f"| `{family.name}` | {types} | {runs} |")
    return "\n".join(rows) + "\n"


def required_keys(family: Family) -> tuple[str, ...]:
    """``config.json`` keys a random checkpoint of ``family`` must give (beyond model_type)."""
    keys = getattr(family, "required_keys", ("vocab_size",))
    return tuple(keys)


def _load(ep: EntryPoint) -> Family:
    try:
        family = ep.load()
    except Exception as exc:
        raise FamilyError(f"family {ep.name!r} ({ep.value}) failed to load: {exc}") from exc
    return _check(family, source=ep.value, name=ep.name)


def _check(family: Any, *, source: str, name: Any) -> Family:
    if not isinstance(family, Family):
        raise FamilyError(
            f"family {name!r} ({source}) is a {type(family).__name__}, "
            "not a Family (needs name, model_types, model_config, expected_tensors, "
            "optional_tensors, build)"
        )
    if family.name != name:
        raise FamilyError(f"family entry point {name!r} ({source}) names itself {family.name!r}")
    return family


def _loadable_families() -> Iterator[Family]:
    """Every family that loads (a broken plugin is skipped here; ``get_family`` names it)."""
    for name in family_names():
        try:
            yield get_family(name)
        except FamilyError:
            continue


def gguf_architectures() -> dict[str, Any]:
    """GGUF ``general.architecture`` -> the ``GGUFArchitecture`` the family that reads it
    declares (``gguf``); families that fail to load are left out (named by ``get_family``)."""
    out: dict[str, Any] = {}
    for family in _loadable_families():
        gguf = getattr(family, "gguf", None)
        if gguf is None:
            continue
        if gguf.name in out:
            raise FamilyError(f"GGUF architecture {gguf.name!r} is claimed by several families")
        out[gguf.name] = gguf
    return out


def hf_architectures() -> dict[str, str]:
    """Hugging Face architecture (``LlamaForCausalLM``) -> the family serving it, from
    each family's ``architectures``; families that fail to load are left out."""
    out: dict[str, str] = {}
    for family in _loadable_families():
        for arch in getattr(family, "architectures", ()):
            out.setdefault(arch, family.name)
    return out


def family_backends(family: Family) -> tuple[str, ...]:
    """The device backends ``family`` builds models for (``backends``; torch when undeclared)."""
    declared = getattr(family, "backends", DEFAULT_BACKENDS)
    return tuple(declared)


def check_family_backend(family: Family, backend: str) -> None:
    """``RecipeError`` on ``device.backend`` unless ``family`` supports ``backend``."""
    supported = family_backends(family)
    if backend not in supported:
        raise RecipeError(
            "device.backend",
            backend,
            f"family {family.name!r} supports {', '.join(supported)} only",
        )
