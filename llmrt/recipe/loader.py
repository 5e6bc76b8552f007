"""Recipe loading: bundled names or file paths, ``${ENV}`` expansion and dotted overrides.

The pipeline is: YAML text (safe loader, duplicate keys rejected) -> plain dict ->
``${VAR}`` / ``${VAR:default}`` expanded in string values (``$${`` is a literal
``${``) -> overrides applied to the dict -> structured by cattrs into a ``Recipe``
that validates itself. Every failure surfaces as one ``RecipeError`` whose field is
the dotted path inside the recipe (``kv_cache.block_size``, ``warmup.prefill_seq_lens[1]``).

Overrides are dotted paths, ``["trace.mode=all", "lanes=2"]`` (CLI ``--set``; values
are parsed as YAML, so numbers, booleans, lists and ``null`` convert) or a mapping
``{"trace.mode": "all"}`` (values used as given). A mapping value merges into the
section it names, so ``{"kv_cache": {"num_blocks": 64}}`` equals ``kv_cache.num_blocks=64``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any, Literal, Union, cast, get_args, get_origin, get_type_hints

import attrs
import cattrs
import yaml
from cattrs.errors import (
    AttributeValidationNote,
    BaseValidationError,
    ForbiddenExtraKeysError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn

from llmrt.errors import ConfigError, RecipeError
from llmrt.recipe.schema import (
    BYTE_TOKENIZER_VOCAB_SIZE,
    CheckpointSpec,
    DecodeSpec,
    DeviceSpec,
    InductorSpec,
    ModelConfig,
    PrefillSpec,
    Recipe,
    ServingSpec,
    TokenizerSpec,
    TtnnSpec,
    registered_families,
)
from llmrt.weights.model_source import (
    ModelSource,
    is_gguf_file,
    model_facts,
    resolve_model_source,
)

__all__ = [
    "BYTE_TOKENIZER_VOCAB_SIZE",
    "RECIPES_PACKAGE",
    "CheckpointSpec",
    "DecodeSpec",
    "DeviceSpec",
    "InductorSpec",
    "Overrides",
    "PrefillSpec",
    "Recipe",
    "ServingSpec",
    "TokenizerSpec",
    "TtnnSpec",
    "dump_recipe_yaml",
    "list_recipes",
    "load_recipe",
    "load_recipe_with",
    "recipe_data",
    "recipe_from_dict",
    "recipe_to_dict",
    "registered_families",
]

#: The package whose ``*.yaml`` files are the bundled recipes (``recipes/`` in the repo).
RECIPES_PACKAGE = "llmrt.recipes"

Overrides = Mapping[str, Any] | Sequence[str]

_RECIPE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_ENV_TOKEN = re.compile(r"\$\$\{|\$\{([^}]*)\}|\$\{")
_ENV_WHOLE = re.compile(r"\$\{[^}]*\}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NONE_TYPE = type(None)

_FieldPath = Sequence[str | int]


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


class _Invalid(Exception):
    """A structuring hook's complaint: the value, why, and the path below the hook."""

    def __init__(self, value: Any, reason: str, path: Sequence[str | int] = ()) -> None:
        super().__init__(reason)
        self.value = value
        self.reason = reason
        self.path = tuple(path)


# ---------------------------------------------------------------------------- public API


def load_recipe(
    name_or_path: str,
    *,
    overrides: Overrides | None = None,
    env: Mapping[str, str] = os.environ,
) -> Recipe:
    """Load, expand, override and validate a recipe.

    A bare name (``smollm2-135m``) is a bundled recipe; anything containing a path
    separator, ending in ``.yaml``/``.yml`` or naming an existing file is read from disk.
    A GGUF file, a checkpoint directory or a cached Hub id instead is a model: the recipe is
    derived from it (``llmrt.recipe.derived``), then ``overrides`` apply.
    """
    model = model_in_place_of_recipe(name_or_path)
    if model is not None:
        template, derived = derived_recipe_args(model)
        return load_recipe_with(template, derived, overrides, env=env)
    return load_recipe_with(name_or_path, None, overrides, env=env)


def load_recipe_with(
    name_or_path: str,
    first: Overrides | None,
    then: Overrides | None,
    *,
    env: Mapping[str, str] = os.environ,
) -> Recipe:
    """``load_recipe`` with two rounds of overrides (a model's checkpoint, then the user's)."""
    source, text = _read_source(name_or_path)
    raw = _parse_yaml(text, source)
    expanded = _expand_env(raw, [], env)
    given = _apply_overrides(expanded, first) | _apply_overrides(expanded, then)
    _follow_overrides(expanded, given)
    return _structure(expanded)


def recipe_data(name_or_path: str, *, env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """A recipe file's data, ``${ENV}`` expanded, not validated (it may lack a checkpoint
    path that ``-m`` gives)."""
    source, text = _read_source(name_or_path)
    expanded: dict[str, Any] = _expand_env(_parse_yaml(text, source), [], env)
    return expanded


def recipe_from_dict(data: Mapping[str, Any], *, overrides: Overrides | None = None) -> Recipe:
    """Validate a recipe given as plain data (no ``${ENV}`` expansion; ``data`` is copied)."""
    raw = _plain(data)
    if not isinstance(raw, dict):
        raise RecipeError("recipe", data, "must be a mapping of recipe sections")
    _follow_overrides(raw, _apply_overrides(raw, overrides))
    return _structure(raw)


def list_recipes() -> list[str]:
    """Names of the bundled recipes, sorted."""
    root = files(RECIPES_PACKAGE)
    return sorted(
        entry.name.removesuffix(".yaml")
        for entry in root.iterdir()
        if entry.name.endswith(".yaml") and entry.is_file()
    )


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """The recipe as plain YAML/JSON-ready data (lists, dicts, scalars), every field shown."""
    return cast("dict[str, Any]", _plain(_converter().unstructure(recipe)))


def dump_recipe_yaml(recipe: Recipe) -> str:
    """The recipe as YAML that ``load_recipe`` reads back to an equal recipe."""
    return yaml.dump(
        _escape_env(recipe_to_dict(recipe)),
        Dumper=_RecipeYamlDumper,
        sort_keys=False,
        allow_unicode=True,
        default_flow_style=False,
    )


# ---------------------------------------------------------------------- derived recipes

#: The bundled recipe a model of each kind starts from.
TEMPLATES = {"gguf": "gguf", "safetensors": "hf"}


def model_in_place_of_recipe(name_or_path: str) -> ModelSource | None:
    """The model ``name_or_path`` names where a recipe was expected (``llmrt generate
    FILE.gguf``, ``LLM.from_recipe(DIR)``), or None when it is a recipe (a bundled name, a
    YAML file) or names nothing (the recipe loader reports it)."""
    if not isinstance(name_or_path, str) or not name_or_path:
        return None
    if "/" not in name_or_path and (files(RECIPES_PACKAGE) / f"{name_or_path}.yaml").is_file():
        return None
    path = Path(name_or_path).expanduser()
    if path.is_dir() or (path.is_file() and is_gguf_file(path)):
        return resolve_model_source(name_or_path, field="recipe")
    if path.exists() or name_or_path.endswith((".yaml", ".yml")) or "/" not in name_or_path:
        return None
    if name_or_path.startswith(("/", ".", "~")):
        return None
    try:
        return resolve_model_source(name_or_path, field="recipe")
    except ConfigError as exc:
        raise RecipeError(
            "recipe",
            name_or_path,
            f"is no bundled recipe, file or directory; as a Hub id: {exc.reason}",
        ) from exc


def derived_recipe_args(source: ModelSource) -> tuple[str, list[str]]:
    """The template and overrides that describe ``source`` with the fastest defaults."""
    overrides = [
        f"name={quoted(source.name)}",
        f"description={quoted(f'{source.name} ({source.kind}), derived by llmrt')}",
        f"checkpoint.path={quoted(str(source.path))}",
    ]
    facts = model_facts(source)
    overrides.append(f"family={facts.family}")
    if source.kind == "gguf" and not facts.runs_blocks:
        overrides.append("checkpoint.weights=float32")
    return TEMPLATES[source.kind], overrides


def quoted(text: str) -> str:
    """``text`` as a YAML scalar that parses back to the same string (for overrides)."""
    return json.dumps(text, ensure_ascii=False)


# ----------------------------------------------------------------------------- reading


def _read_source(name_or_path: str) -> tuple[str, str]:
    if not isinstance(name_or_path, str) or not name_or_path:
        raise RecipeError("recipe", name_or_path, "must be a recipe name or a path")
    if _looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser()
        try:
            return str(path), path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise RecipeError(
                "recipe",
                name_or_path,
                "is neither a recipe (YAML text) nor a GGUF file (no GGUF magic bytes) nor a "
                "checkpoint directory",
            ) from exc
        except OSError as exc:
            raise RecipeError(
                "recipe", name_or_path, f"cannot read the file: {exc.strerror or exc}"
            ) from exc
    entry = files(RECIPES_PACKAGE) / f"{name_or_path}.yaml"
    if not _RECIPE_NAME.fullmatch(name_or_path) or not entry.is_file():
        raise RecipeError(
            "recipe",
            name_or_path,
            f"is not a bundled recipe (bundled: {', '.join(list_recipes())}); "
            "pass a path to load a file",
        )
    return f"{RECIPES_PACKAGE}/{name_or_path}.yaml", entry.read_text(encoding="utf-8")


def _looks_like_path(text: str) -> bool:
    return (
        "/" in text
        or os.sep in text
        or text.endswith((".yaml", ".yml"))
        or Path(text).expanduser().is_file()
    )


class _RecipeYamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also rejects duplicate mapping keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _RecipeYamlDumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that double-quotes strings holding Unicode line breaks.

    PyYAML's plain/single-quoted output folds NEL/LS/PS into spaces on reload.
    """


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = '"' if any(ch in text for ch in "\x85\u2028\u2029") else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_RecipeYamlDumper.add_representer(str, _represent_str)


def _parse_yaml(text: str, source: str) -> dict[str, Any]:
    try:
        data = yaml.load(text, Loader=_RecipeYamlLoader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise RecipeError("recipe", source, f"is not valid YAML: {problem}{where}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError("recipe", data, f"{source} must hold a mapping of recipe sections")
    return data


# ---------------------------------------------------------------------- env expansion


def _expand_env(node: Any, path: _FieldPath, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        expanded = _expand_string(node, _format_path(path), env)
        if _ENV_WHOLE.fullmatch(node):
            return _coerce_text(_schema_type(path), expanded, keep_str=True)
        return expanded
    if isinstance(node, dict):
        return {key: _expand_env(value, [*path, key], env) for key, value in node.items()}
    if isinstance(node, list):
        return [_expand_env(value, [*path, i], env) for i, value in enumerate(node)]
    return node


def _expand_string(text: str, field: str, env: Mapping[str, str]) -> str:
    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$${":
            return "${"
        body = match.group(1)
        if body is None:
            raise RecipeError(field, text, "has an unterminated ${ (write $${ for a literal ${)")
        name, has_default, default = body.partition(":")
        if not _ENV_NAME.fullmatch(name):
            raise RecipeError(
                field,
                text,
                f"${{{body}}} is not an environment reference (use ${{VAR}} or ${{VAR:default}})",
            )
        if name in env:
            return env[name]
        if has_default:
            return default
        raise RecipeError(
            field,
            text,
            f"environment variable {name} is not set (write ${{{name}:default}} to give a default)",
        )

    return _ENV_TOKEN.sub(substitute, text)


def _escape_env(node: Any) -> Any:
    if isinstance(node, str):
        return node.replace("${", "$${")
    if isinstance(node, dict):
        return {key: _escape_env(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_escape_env(value) for value in node]
    return node


# --------------------------------------------------------------------------- overrides


def _override_items(overrides: Overrides | None) -> list[tuple[str, Any, bool]]:
    """(dotted key, value, value-is-text) for each override, in order."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        items: list[tuple[str, Any, bool]] = []
        for key, value in overrides.items():
            if not isinstance(key, str):
                raise RecipeError("overrides", key, "keys must be dotted field paths")
            items.append((key, value, False))
        return items
    if isinstance(overrides, (str, bytes)):
        raise RecipeError(
            "overrides",
            overrides,
            "expected a list of KEY=VALUE strings or a mapping, not one string",
        )
    items = []
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise RecipeError("overrides", item, "expected KEY=VALUE (e.g. trace.mode=all)")
        key, _, text = item.partition("=")
        items.append((key.strip(), text, True))
    return items


def _apply_overrides(raw: dict[str, Any], overrides: Overrides | None) -> set[str]:
    """Apply ``overrides`` to ``raw``; the dotted keys they set."""
    keys: set[str] = set()
    for key, given, is_text in _override_items(overrides):
        keys.add(key)
        parts = key.split(".")
        if not all(parts):
            raise RecipeError("overrides", key, "is not a dotted field path (e.g. trace.mode)")
        target = _schema_type_strict(parts, given)
        value = _plain(_coerce_text(target, given, keep_str=False) if is_text else given)
        if isinstance(value, dict):
            _check_override_keys(parts, value)
        _set_path(raw, parts, value)
    return keys


def _follow_overrides(raw: dict[str, Any], given: set[str]) -> None:
    """Dependent fields follow an override that makes the file's value meaningless.

    ``device.kind`` picks a torch device: a recipe written for the CPU says ``kind: cpu``,
    and ``--set device.backend=ttnn`` on it means "this model on ttnn", not a conflict, so
    the file's ``kind`` is dropped unless an override set it too (then the schema says why
    the pair is invalid).
    """
    device = raw.get("device")
    if (
        "device.backend" in given
        and "device.kind" not in given
        and isinstance(device, dict)
        and device.get("backend", "torch") != "torch"
    ):
        device.pop("kind", None)


def _check_override_keys(path: _FieldPath, mapping: dict[Any, Any]) -> None:
    if _schema_type(path) is Any:
        return
    for key, value in mapping.items():
        child: _FieldPath = [*path, str(key)]
        _schema_type_strict(child, value)
        if isinstance(value, dict):
            _check_override_keys(child, value)


def _set_path(raw: dict[str, Any], parts: list[str], value: Any) -> None:
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    last = parts[-1]
    current = node.get(last)
    if isinstance(value, dict) and isinstance(current, dict):
        _merge(current, value)
    else:
        node[last] = value


def _merge(into: dict[Any, Any], update: dict[Any, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _coerce_text(target: Any, text: str, *, keep_str: bool) -> Any:
    """Turn override/env text into the value the schema expects at ``target``.

    Text is parsed as YAML (``2`` -> int, ``[1, 2]`` -> list, ``null`` -> None), but a
    field that takes strings keeps the text whenever the parsed value would not fit
    (``name=123`` stays ``"123"``). ``keep_str`` keeps text for string fields outright.
    """
    kinds = _accepted_kinds(target)
    if keep_str and kinds is not None and str in kinds:
        return text
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if kinds is None or _kind_of(parsed) in kinds:
        return parsed
    return text if str in kinds else parsed


def _plain(value: Any) -> Any:
    """Deep copy as plain data: attrs instances unstructured, tuples as lists."""
    if attrs.has(type(value)):
        return _plain(_converter().unstructure(value))
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


# ------------------------------------------------------------------------ schema walk


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {field.name: hints[field.name] for field in attrs.fields(cls)}


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _without_none(tp: Any) -> Any:
    if _is_union(tp):
        rest = [arg for arg in get_args(tp) if arg is not _NONE_TYPE]
        if len(rest) == 1:
            return rest[0]
    return tp


def _child_type(tp: Any, part: str | int) -> Any:
    """The schema type below ``tp`` at ``part``; ``_MISSING`` when there is none."""
    if tp is Any:
        return Any
    tp = _without_none(tp)
    if tp == ModelConfig or get_origin(tp) is dict:
        return Any
    if isinstance(tp, type) and attrs.has(tp):
        return _field_types(tp).get(part, _MISSING) if isinstance(part, str) else _MISSING
    if get_origin(tp) is tuple and isinstance(part, int):
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return args[0]
        return args[part] if 0 <= part < len(args) else _MISSING
    return _MISSING


def _schema_type(path: _FieldPath) -> Any:
    tp: Any = Recipe
    for part in path:
        tp = _child_type(tp, part)
        if tp is _MISSING:
            return _MISSING
    return tp


def _schema_type_strict(parts: _FieldPath, value: Any) -> Any:
    """Like ``_schema_type`` but raise a ``RecipeError`` naming the first unknown part."""
    tp: Any = Recipe
    for depth, part in enumerate(parts):
        child = _child_type(tp, part)
        if child is _MISSING:
            field = _format_path(parts[: depth + 1])
            section = _without_none(tp)
            if isinstance(section, type) and attrs.has(section):
                known = ", ".join(_field_types(section))
                raise RecipeError(field, value, f"unknown key (known: {known})")
            raise RecipeError(
                field,
                value,
                f"unknown key: {_format_path(parts[:depth]) or 'recipe'} is a value, not a section",
            )
        tp = child
    return tp


def _accepted_kinds(tp: Any) -> frozenset[type] | None:
    """The plain-data kinds a schema type accepts; None means anything."""
    if tp is Any or tp is _MISSING:
        return None
    if _is_union(tp):
        kinds: set[type] = set()
        for arg in get_args(tp):
            sub = _accepted_kinds(arg)
            if sub is None:
                return None
            kinds |= sub
        return frozenset(kinds)
    origin = get_origin(tp)
    if origin is Literal:
        return frozenset(type(arg) for arg in get_args(tp))
    if tp is float:
        return frozenset((float, int))
    if tp in (int, bool, str, _NONE_TYPE):
        return frozenset((tp,))
    if origin in (tuple, list) or tp in (tuple, list):
        return frozenset((list,))
    if origin is dict or tp is dict or (isinstance(tp, type) and attrs.has(tp)):
        return frozenset((dict,))
    return None


def _kind_of(value: Any) -> type:
    if isinstance(value, Mapping):
        return dict
    if isinstance(value, (list, tuple)):
        return list
    return type(value)


def _format_path(path: Sequence[str | int]) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


# ------------------------------------------------------------------------ structuring


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _structure_int(value: Any, _: type) -> int:
    if _is_int(value):
        return int(value)
    raise _Invalid(value, "expected int")


def _structure_float(value: Any, _: type) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise _Invalid(value, "expected a number")


def _structure_bool(value: Any, _: type) -> bool:
    if isinstance(value, bool):
        return value
    raise _Invalid(value, "expected true or false")


def _structure_str(value: Any, _: type) -> str:
    if isinstance(value, str):
        return value
    raise _Invalid(value, "expected a string")


def _structure_literal(value: Any, tp: Any) -> Any:
    choices = get_args(tp)
    if any(type(value) is type(choice) and value == choice for choice in choices):
        return value
    raise _Invalid(value, f"must be one of {choices}")


def _structure_model(value: Any, _: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise _Invalid(value, "expected a mapping of Hugging Face config.json keys")
    return cast("dict[str, Any]", _plain(value))


def _tuple_hook(converter: cattrs.Converter) -> Callable[[Any, Any], tuple[Any, ...]]:
    def structure(value: Any, tp: Any) -> tuple[Any, ...]:
        if not isinstance(value, (list, tuple)):
            raise _Invalid(value, "expected a list")
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            item_types = [args[0]] * len(value)
        elif len(value) != len(args):
            raise _Invalid(value, f"expected a list of {len(args)} items")
        else:
            item_types = list(args)
        items = []
        for i, (item, item_type) in enumerate(zip(value, item_types, strict=True)):
            try:
                items.append(converter.structure(item, item_type))
            except _Invalid as exc:
                raise _Invalid(exc.value, exc.reason, (i, *exc.path)) from None
        return tuple(items)

    return structure


def _attrs_hook(converter: cattrs.Converter, cls: type) -> Callable[[Any, Any], Any]:
    structure_fields: Callable[[Any, Any], Any] = make_dict_structure_fn(cls, converter)
    known = ", ".join(_field_types(cls))

    def structure(value: Any, tp: Any) -> Any:
        if not isinstance(value, Mapping):
            raise _Invalid(value, f"expected a mapping (keys: {known})")
        return structure_fields(value, tp)

    return structure


@functools.cache
def _converter() -> cattrs.Converter:
    """The recipe converter: strict scalars, unknown keys forbidden, detailed errors."""
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    converter.register_structure_hook(int, _structure_int)
    converter.register_structure_hook(float, _structure_float)
    converter.register_structure_hook(bool, _structure_bool)
    converter.register_structure_hook(str, _structure_str)
    converter.register_structure_hook_func(lambda tp: get_origin(tp) is Literal, _structure_literal)
    converter.register_structure_hook_func(
        lambda tp: get_origin(tp) is tuple, _tuple_hook(converter)
    )
    converter.register_structure_hook_func(lambda tp: tp == ModelConfig, _structure_model)
    converter.register_structure_hook_factory(
        lambda tp: isinstance(tp, type) and attrs.has(tp),
        lambda cls: _attrs_hook(converter, cls),
    )
    return converter


def _structure(raw: dict[str, Any]) -> Recipe:
    try:
        return _converter().structure(raw, Recipe)
    except (BaseValidationError, ConfigError, _Invalid, ForbiddenExtraKeysError) as exc:
        raise _recipe_error(exc, raw) from exc


def _note_path(exc: BaseException) -> _FieldPath:
    for note in getattr(exc, "__notes__", ()):
        if isinstance(note, AttributeValidationNote):
            return [note.name]
        if isinstance(note, IterableValidationNote):
            return [note.index]
    return []


def _leaves(exc: BaseException, path: _FieldPath) -> Iterator[tuple[_FieldPath, BaseException]]:
    if isinstance(exc, BaseValidationError):
        for sub in exc.exceptions:
            yield from _leaves(sub, [*path, *_note_path(sub)])
    else:
        yield path, exc


def _lookup(raw: Any, path: _FieldPath) -> Any:
    node = raw
    for part in path:
        in_map = isinstance(node, Mapping) and part in node
        in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if not (in_map or in_list):
            return _MISSING
        node = node[part]
    return node


def _recipe_error(exc: BaseException, raw: dict[str, Any]) -> RecipeError:
    """The first leaf of a (nested) structuring failure, as one ``RecipeError``."""
    path, leaf = next(_leaves(exc, []))
    if isinstance(leaf, RecipeError):
        return leaf
    if isinstance(leaf, ConfigError):
        return RecipeError(leaf.field, leaf.value, leaf.reason)
    if isinstance(leaf, ForbiddenExtraKeysError):
        key = sorted(map(str, leaf.extra_fields))[0]
        field_path: _FieldPath = [*path, key]
        known = ", ".join(_field_types(leaf.cl))
        return RecipeError(
            _format_path(field_path), _lookup(raw, field_path), f"unknown key (known: {known})"
        )
    if isinstance(leaf, _Invalid):
        full: _FieldPath = [*path, *leaf.path]
        return RecipeError(_format_path(full) or "recipe", leaf.value, leaf.reason)
    if isinstance(leaf, KeyError):
        return RecipeError(_format_path(path), _MISSING, "is required")
    return RecipeError(
        _format_path(path) or "recipe", _lookup(raw, path), f"{type(leaf).__name__}: {leaf}"
    )
