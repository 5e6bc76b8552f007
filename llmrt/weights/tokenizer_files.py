"""Tokenizers from Hugging Face files: `tokenizer.json` plus its optional companions.

`tokenizer_config.json` gives the bos/eos tokens and the chat template (also read from
`chat_template.jinja`), `generation_config.json` and `config.json` more end-of-generation ids.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tokenizers

from llmrt.errors import CheckpointError
from llmrt.weights.tokenizer import Tokenizer


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer at `path`: a `tokenizer.json` file or a directory holding one."""
    location = Path(path).expanduser()
    directory = location if location.is_dir() else location.parent
    file = location / "tokenizer.json" if location.is_dir() else location
    if not file.is_file():
        raise CheckpointError(str(file), "tokenizer file not found")
    hf_config = read_json(directory / "config.json", required=False)
    return _read(file=file, directory=directory, hf_config=hf_config)


def read_tokenizer_dir(directory: Path, *, hf_config: Mapping[str, Any]) -> Tokenizer | None:
    """The tokenizer of a checkpoint directory, or None without `tokenizer.json`."""
    file = directory / "tokenizer.json"
    if not file.is_file():
        return None
    return _read(file=file, directory=directory, hf_config=hf_config)


def read_json(path: Path, *, required: bool) -> dict[str, Any]:
    """The JSON object in `path` ({} when absent and not `required`)."""
    if not path.is_file():
        if required:
            raise CheckpointError(str(path), "file not found")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(str(path), f"unreadable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(str(path), f"expected a JSON object, got {type(data).__name__}")
    return data


def _read(*, file: Path, directory: Path, hf_config: Mapping[str, Any]) -> Tokenizer:
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers reports malformed files as a bare Exception
        raise CheckpointError(str(file), f"unreadable tokenizer: {exc}") from exc
    config_file = directory / "tokenizer_config.json"
    config = read_json(config_file, required=False)
    generation = read_json(directory / "generation_config.json", required=False)

    bos_token = _token_content(config.get("bos_token"))
    if bos_token is None and isinstance(hf_config.get("bos_token_id"), int):
        bos_token = backend.id_to_token(hf_config["bos_token_id"])
    eos_token = _token_content(config.get("eos_token"))
    size = backend.get_vocab_size(with_added_tokens=True)
    eos_ids = []
    for source, ids in (
        ("config.json", _ids(hf_config.get("eos_token_id"))),
        ("generation_config.json", _ids(generation.get("eos_token_id"))),
    ):
        for token_id in ids:  # named here: Tokenizer.create would blame tokenizer_config.json
            if not 0 <= token_id < size:
                raise CheckpointError(
                    f"{directory / source}.eos_token_id",
                    f"{token_id} outside the tokenizer's vocab of {size} ({file.name})",
                )
        eos_ids.extend(ids)
    if eos_token is None and eos_ids:
        eos_token = backend.id_to_token(eos_ids[0])
    return Tokenizer.create(
        backend=backend,
        bos_token=bos_token,
        eos_tokens=[] if eos_token is None else [eos_token],
        extra_eos_token_ids=eos_ids,
        chat_template=_chat_template(directory, config, item=str(config_file)),
        item=str(config_file),
    )


def _chat_template(directory: Path, config: dict[str, Any], *, item: str) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return str(named["default"])
    raise CheckpointError(f"{item}: chat_template", "expected a string or a 'default' entry")


def _token_content(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: object) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []
