"""What a user points llmrt at with ``-m`` / ``LLM(model=...)``, resolved to local files.

A source is a GGUF file, a Hugging Face checkpoint directory (``config.json`` plus
safetensors), or a Hub id ``org/name[@revision]`` found in ``huggingface_hub``'s local cache
(``HF_HUB_CACHE`` / ``HF_HOME``). A Hub download happens only when the caller allows it
(``download=True``, the CLI's ``--download``) and ``HF_HUB_OFFLINE`` is unset; it shows
``huggingface_hub``'s own progress bars. A GGUF is recognised by its magic bytes, never by
its name, and nothing past the first bytes of a file is read here.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import attrs

from llmrt.errors import MISSING, CheckpointError, ConfigError

SourceKind = Literal["gguf", "safetensors"]

GGUF_MAGIC = b"GGUF"
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")
_TRUE = frozenset({"1", "on", "yes", "true"})


@attrs.frozen(kw_only=True)
class ModelSource:
    """A model resolved to local files: ``path`` is the GGUF file or the checkpoint directory;
    ``name`` is the id it is served under (the file's stem, the directory's name, the Hub id)."""

    given: str
    kind: SourceKind
    path: Path
    name: str


def resolve_model_source(
    source: str,
    *,
    field: str = "model",
    gguf_file: str | None = None,
    download: bool = False,
) -> ModelSource:
    """Resolve ``source`` (a path or a Hub id) to local files; ``field`` names it in errors.

    ``gguf_file`` picks one GGUF of a directory or Hub repo holding several.
    """
    if not isinstance(source, str) or not source.strip():
        raise ConfigError(field, source, "must be a GGUF file, a checkpoint directory or a Hub id")
    path = Path(source).expanduser()
    if path.exists() or _path_like(source):
        return _local(source, path, field=field, gguf_file=gguf_file)
    hub_id = parse_hub_id(source)
    if hub_id is None:
        raise ConfigError(
            field, source, "no such file or directory, and not a Hub id (org/name[@revision])"
        )
    repo, revision = hub_id
    return _hub(
        source, repo=repo, revision=revision, field=field, gguf_file=gguf_file, download=download
    )


def parse_hub_id(text: str) -> tuple[str, str | None] | None:
    """``(repo, revision)`` of a Hub id ``org/name[@revision]``; None when ``text`` is none."""
    match = _HUB_ID.fullmatch(text)
    return None if match is None else (match.group("repo"), match.group("revision"))


def cached_snapshot(
    repo: str, *, revision: str | None = None, env: Mapping[str, str] | None = None
) -> Path | None:
    """The snapshot directory of ``repo`` (at ``revision``) in the local Hub cache that
    ``env`` (default: the process environment) names; None when it is not cached. The one
    place llmrt looks a Hub id up without the network (``-m`` and the vLLM plugin)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        found = snapshot_download(
            repo, revision=revision, cache_dir=hub_cache_dir(env), local_files_only=True
        )
    except (LocalEntryNotFoundError, FileNotFoundError):
        return None
    return Path(found)


def is_gguf_file(path: Path) -> bool:
    """Whether ``path`` is a regular file starting with the GGUF magic (4 bytes read)."""
    try:
        with path.open("rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _path_like(source: str) -> bool:
    """Written as a path (absolute, relative, home, or with a file suffix): never a Hub id."""
    return source.startswith(("/", ".", "~")) or source.endswith(
        (".gguf", ".yaml", ".yml", ".json", ".safetensors")
    )


def _local(source: str, path: Path, *, field: str, gguf_file: str | None) -> ModelSource:
    if not path.exists():
        raise ConfigError(field, source, "no such file or directory")
    if path.is_dir():
        return _directory(source, path, field=field, gguf_file=gguf_file, name=path.resolve().name)
    if gguf_file is not None:
        raise ConfigError("--gguf-file", gguf_file, "picks a file of a directory or Hub repo")
    try:
        with path.open("rb") as handle:
            head = handle.read(4)
    except OSError as exc:
        raise ConfigError(field, source, f"cannot read it: {exc.strerror or exc}") from exc
    if head == GGUF_MAGIC:
        return ModelSource(given=source, kind="gguf", path=path.resolve(), name=_stem(path))
    if path.suffix in (".yaml", ".yml"):
        raise ConfigError(
            field, source, "is a recipe file; give it as the recipe (llmrt generate RECIPE -m ...)"
        )
    raise ConfigError(
        field,
        source,
        "is neither a GGUF file (no GGUF magic bytes) nor a Hugging Face checkpoint directory "
        "(config.json + *.safetensors)",
    )


def _directory(
    source: str, path: Path, *, field: str, gguf_file: str | None, name: str
) -> ModelSource:
    ggufs = sorted(p.name for p in path.glob("*.gguf") if p.is_file())
    has_config = (path / "config.json").is_file()
    if gguf_file is not None or (ggufs and not has_config):
        chosen = _pick_gguf(path, ggufs, gguf_file=gguf_file, source=source)
        file = path / chosen
        if not is_gguf_file(file):
            raise ConfigError("--gguf-file", chosen, f"{file} is not a GGUF file (bad magic)")
        return ModelSource(given=source, kind="gguf", path=file.resolve(), name=_stem(file))
    if not has_config:
        raise ConfigError(
            field,
            source,
            "is a directory holding neither config.json (a Hugging Face checkpoint) nor a "
            ".gguf file",
        )
    return ModelSource(given=source, kind="safetensors", path=path.resolve(), name=name)


def _pick_gguf(path: Path, ggufs: list[str], *, gguf_file: str | None, source: str) -> str:
    if gguf_file is not None:
        if not (path / gguf_file).is_file():
            listed = ", ".join(ggufs) or "none"
            raise ConfigError("--gguf-file", gguf_file, f"not in {source} (GGUF files: {listed})")
        return gguf_file
    if len(ggufs) > 1:
        raise ConfigError(
            "--gguf-file",
            MISSING,
            f"{source} holds {len(ggufs)} GGUF files; pick one of: " + ", ".join(ggufs),
        )
    return ggufs[0]


def _stem(path: Path) -> str:
    return path.name.removesuffix(".gguf") or path.name


def hub_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The Hub cache ``huggingface_hub`` uses, read from ``env`` (default: the process
    environment) now, not at import."""
    env = os.environ if env is None else env
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids network access."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _hub(
    source: str,
    *,
    repo: str,
    revision: str | None,
    field: str,
    gguf_file: str | None,
    download: bool,
) -> ModelSource:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    cache = hub_cache_dir()
    snapshot = cached_snapshot(repo, revision=revision)
    # A GGUF repo's cached snapshot holds only the files fetched so far: the one asked for
    # must be there, or it is fetched too (when allowed).
    if snapshot is not None and (gguf_file is None or (snapshot / gguf_file).is_file()):
        return _directory(source, snapshot, field=field, gguf_file=gguf_file, name=source)
    if not download or hub_offline():
        why = "HF_HUB_OFFLINE is set" if hub_offline() else "pass --download to fetch it"
        what = f"--gguf-file {gguf_file} is" if gguf_file else "is"
        raise ConfigError(field, source, f"{what} not in the Hugging Face cache {cache} ({why})")
    from llmrt.lifecycle.progress import progress_setting

    if progress_setting() is False:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    try:
        fetched = Path(
            snapshot_download(
                repo,
                revision=revision,
                cache_dir=cache,
                allow_patterns=_download_patterns(repo, revision=revision, gguf_file=gguf_file),
            )
        )
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise CheckpointError(source, f"download failed: {exc}") from exc
    return _directory(source, fetched, field=field, gguf_file=gguf_file, name=source)


def _download_patterns(repo: str, *, revision: str | None, gguf_file: str | None) -> list[str]:
    """What to fetch: the chosen GGUF (one of a GGUF-only repo), else the checkpoint files."""
    from huggingface_hub import list_repo_files

    files = list_repo_files(repo, revision=revision)
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if gguf_file is not None:
        return [gguf_file]
    if "config.json" not in files and ggufs:
        if len(ggufs) > 1:
            raise ConfigError(
                "--gguf-file",
                MISSING,
                f"{repo} holds {len(ggufs)} GGUF files; pick one of: " + ", ".join(ggufs),
            )
        return ggufs
    return ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


@attrs.frozen(kw_only=True)
class ModelFacts:
    """What a derived recipe needs to know of a model, read cheaply: the family that runs it
    (from a GGUF header's ``general.architecture`` or ``config.json``'s ``model_type``) and,
    for a GGUF, whether it holds 2-D weights in a block layout llmrt's CPU kernels run
    (Q4_0, Q4_1, Q8_0: then ``gguf-native`` keeps them so)."""

    family: str
    runs_blocks: bool


def model_facts(source: ModelSource) -> ModelFacts:
    """``ModelFacts`` of ``source``: one pass over a GGUF's header (no tensor data, no
    tokenizer built), or ``config.json`` alone. A model no family runs is a ``FamilyError``
    or ``CheckpointError`` listing the supported ones."""
    from llmrt.families import registry
    from llmrt.kernels.formats import block_kind_of
    from llmrt.weights.gguf_architectures import header_config
    from llmrt.weights.gguf_file import open_gguf

    if source.kind == "safetensors":
        config = source.path / "config.json"
        try:
            model_type = json.loads(config.read_text(encoding="utf-8"))["model_type"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(str(config), f"no readable model_type ({exc})") from exc
        return ModelFacts(
            family=registry.family_for_model_type(str(model_type)).name, runs_blocks=False
        )
    # The loader opens the file next (when a model is built): it takes this parse.
    header = open_gguf(source.path, hand_on=True)
    item = str(source.path)
    model_type = header_config(header, item=item)[1]["model_type"]
    family = registry.family_for_model_type(str(model_type))
    runs_blocks = any(
        len(tensor.dims) == 2 and block_kind_of(int(tensor.tensor_type)) is not None
        for tensor in header.tensors
    )
    return ModelFacts(family=family.name, runs_blocks=runs_blocks)
