"""Precompiled steps on disk: one file per compiled step geometry, loaded without re-tracing.

Inductor's own caches (FX graph, AOTAutograd) make a warm start skip code generation, but
Dynamo still re-traces the model's Python every start (8 of 14 s on SmolLM2's 30-layer
decode step). torch's precompile, ``torch.compile(...).aot_compile``, captures the traced
graph, its guards and the inductor kernels in one serializable function; this module keys,
writes and reads those functions under ``<compile cache dir>/steps/``.

A key covers everything that changes the graph: the operation, the input geometry and
dtypes (with the dimensions traced as dynamic), the inductor options, torch, Python and
the CPU's vector ISA, a digest of llmrt's sources (Python and C++ kernels) and of any
model class defined outside llmrt, and the model's traced state (its config, every
parameter, buffer and tensor it holds by shape, dtype and stride, the bound KV cache
among them, and its plain attributes). Weight values are not in it: with ``freezing``
off they are graph inputs, so one file serves any checkpoint of the same geometry.

A file is a magic line, a JSON header line (format, key digest and parts, payload size
and SHA-256), then torch's pickled function. Anything that does not check out
(truncated, edited, saved for another key, a payload torch cannot load) raises
:class:`StepArtifactError` naming the file and the problem; the caller recompiles and
overwrites. Files are written to a temporary name and moved into place with
``os.replace``. They are pickles: the cache directory is as trusted as inductor's own.

Every key change (a new llmrt, torch or recipe geometry) writes new files beside the old
ones (~5 MB each for SmolLM2), so the store is bounded: a load marks its file used, and a
save then deletes the least recently used files beyond ``MAX_STORE_BYTES`` (and temporary
files a crashed save left behind).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import io
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, cast

import attrs
import torch

from llmrt.errors import LLMRTError

#: Bumped when the file layout or the key's parts change meaning.
ARTIFACT_FORMAT = 1
MAGIC = b"llmrt-step-artifact"
SUFFIX = ".aot"
_LLMRT_ROOT = Path(__file__).resolve().parent
_SOURCE_SUFFIXES = (".py", ".cpp", ".h")
#: The store's size bound: least recently used files beyond it are deleted after a save.
MAX_STORE_BYTES = 1 << 30
#: A temporary file older than this is a crashed save's, not one in progress.
STALE_TEMPORARY_S = 3600.0
#: Module attributes Dynamo never reads for a forward (torch's own bookkeeping).
_SKIPPED_ATTRIBUTES = frozenset(
    {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "__dict__"}
)


class StepArtifactError(LLMRTError):
    """A precompiled step file that cannot be used; names the file and why."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"precompiled step {path}: {reason}")
        self.path = path
        self.reason = reason


class PrecompiledStep(Protocol):
    """What ``aot_compile`` returns (``torch._dynamo.aot_compile.AOTCompiledFunction``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def guard_check(self, *args: Any, **kwargs: Any) -> bool: ...

    def disable_guard_check(self) -> None: ...


@attrs.frozen(kw_only=True)
class ArtifactKey:
    """What a precompiled step was built for; ``digest`` names its file."""

    operation: str
    parts: Mapping[str, Any]
    digest: str

    @property
    def filename(self) -> str:
        return f"{self.operation}-{self.digest[:32]}{SUFFIX}"


def artifact_key(
    *,
    operation: str,
    geometry: Any,
    dtypes: Mapping[str, torch.dtype],
    dynamic: Mapping[str, Any],
    options: Mapping[str, Any],
    model: torch.nn.Module,
) -> ArtifactKey:
    """The key of ``operation`` over ``geometry`` (the untrimmed input shapes) and input
    ``dtypes`` for ``model``; ``dynamic`` names the dimensions traced as dynamic and their
    ranges."""
    parts: dict[str, Any] = {
        "format": ARTIFACT_FORMAT,
        "operation": operation,
        "geometry": _jsonable(geometry),
        "dtypes": _jsonable(dict(sorted(dtypes.items()))),
        "dynamic": _jsonable(dynamic),
        "inductor_options": _jsonable(dict(sorted(options.items()))),
        "torch": torch.__version__,
        "python": sys.version,
        "machine": platform.machine(),
        "cpu_isa": _cpu_isa(),
        "sources": source_digest(model),
        "model": model_fingerprint(model),
    }
    text = json.dumps(parts, sort_keys=True)
    return ArtifactKey(
        operation=operation, parts=parts, digest=hashlib.sha256(text.encode()).hexdigest()
    )


def _cpu_isa() -> str:
    """The vector ISA torch's CPU kernels may use, read from the CPU (inductor's own pick
    compiles and loads a probe in a subprocess, which can time out on a loaded machine)."""
    return f"{torch.backends.cpu.get_cpu_capability()} vnni={torch.cpu._is_vnni_supported()}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


@functools.cache
def _llmrt_sources() -> str:
    digest = hashlib.sha256()
    for path in sorted(_LLMRT_ROOT.rglob("*")):
        if path.suffix in _SOURCE_SUFFIXES and "_build" not in path.parts:
            digest.update(str(path.relative_to(_LLMRT_ROOT)).encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()


def source_digest(model: torch.nn.Module) -> str:
    """llmrt's sources (Python and the C++ kernels), plus the source file of every module
    class of ``model`` defined outside llmrt and torch (a plugin family's code)."""
    digest = hashlib.sha256(_llmrt_sources().encode())
    files: set[Path] = set()
    for module in model.modules():
        for cls in type(module).__mro__:
            name = cls.__module__ or ""
            if name.split(".")[0] in ("llmrt", "torch", "builtins"):
                continue
            with contextlib.suppress(TypeError, OSError):
                source = inspect.getsourcefile(cls)
                if source is not None:
                    files.add(Path(source).resolve())
    for path in sorted(files):
        digest.update(str(path).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def model_fingerprint(model: torch.nn.Module) -> str:
    """A digest of what a trace of ``model`` specializes on: each module's class, its plain
    attributes and every tensor it holds (shape, dtype, stride, device), not the values."""
    digest = hashlib.sha256()
    for line in _model_state(model):
        digest.update(line.encode() + b"\n")
    return digest.hexdigest()


def _model_state(model: torch.nn.Module) -> Iterator[str]:
    for prefix, module in model.named_modules():
        cls = type(module)
        yield f"{prefix}: {cls.__module__}.{cls.__qualname__}"
        for name, tensor in module.named_parameters(recurse=False):
            yield f"{prefix}.{name} = parameter {_tensor(tensor)}"
        for name, tensor in module.named_buffers(recurse=False):
            yield f"{prefix}.{name} = buffer {_tensor(tensor)}"
        for name, value in sorted(vars(module).items()):
            if name in _SKIPPED_ATTRIBUTES or name.endswith("_hooks") or "hook" in name:
                continue
            yield f"{prefix}.{name} = {_describe(value, depth=0)}"


def _tensor(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)}/{tensor.dtype}/{tuple(tensor.stride())}/{tensor.device}"


def _describe(value: Any, *, depth: int) -> str:
    if isinstance(value, torch.Tensor):
        return _tensor(value)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return repr(value)
    if depth >= 3:
        return type(value).__qualname__
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_describe(v, depth=depth + 1) for v in value) + "]"
    if isinstance(value, Mapping):
        items = sorted(value.items(), key=lambda kv: str(kv[0]))
        return "{" + ", ".join(f"{k}: {_describe(v, depth=depth + 1)}" for k, v in items) + "}"
    if attrs.has(type(value)):
        fields = attrs.fields(type(value))
        inner = ", ".join(
            f"{f.name}={_describe(getattr(value, f.name), depth=depth + 1)}" for f in fields
        )
        return f"{type(value).__qualname__}({inner})"
    name: str = type(value).__qualname__  # functions, submodules, opaque objects: the type
    return name


class ArtifactStore:
    """Precompiled step files in one directory (created on first save)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, key: ArtifactKey) -> Path:
        return self.directory / key.filename

    def load(self, key: ArtifactKey, *, f_globals: dict[str, Any]) -> PrecompiledStep | None:
        """The step saved under ``key`` (None when there is none); raises
        :class:`StepArtifactError` when the file is there but unusable."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StepArtifactError(path, f"cannot be read ({exc})") from exc
        payload = _unpack(path, data, key)
        with contextlib.suppress(OSError):
            os.utime(path)  # used: the last to be pruned
        try:
            loaded = cast(
                PrecompiledStep,
                torch.compiler.load_compiled_function(io.BytesIO(payload), f_globals=f_globals),
            )
        except Exception as exc:  # torch raises anything from pickle to a version mismatch
            raise StepArtifactError(
                path, f"torch cannot load it ({type(exc).__name__}: {exc})"
            ) from exc
        return loaded

    def save(self, key: ArtifactKey, step: PrecompiledStep) -> Path:
        """Write ``step`` under ``key`` atomically; returns the path."""
        from torch._dynamo.aot_compile import AOTCompiledFunction

        if not isinstance(step, AOTCompiledFunction):
            raise TypeError(f"expected an aot_compile result, got {type(step).__name__}")
        payload = AOTCompiledFunction.serialize(step).serialized_data
        path = self.path(key)
        self.directory.mkdir(parents=True, exist_ok=True)
        data = _pack(key, payload)
        fd, temporary = tempfile.mkstemp(dir=self.directory, prefix=f".{path.name}.")
        try:
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide it from a shared cache's users
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        self.prune(keep=path)
        return path

    def prune(self, *, keep: Path | None = None, max_bytes: int = MAX_STORE_BYTES) -> list[Path]:
        """Delete the least recently used step files beyond ``max_bytes`` (never ``keep``)
        and stale temporary files; returns what was deleted. Files another process deletes
        meanwhile are skipped; a file deleted under a process that was about to load it
        only costs that process a recompile."""
        now = time.time()
        files: list[tuple[float, int, Path]] = []
        removed: list[Path] = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.directory):
                try:
                    info = entry.stat()
                except OSError:
                    continue
                path = Path(entry.path)
                if entry.name.startswith("."):  # a save's temporary (see ``save``)
                    if now - info.st_mtime > STALE_TEMPORARY_S and _unlink(path):
                        removed.append(path)
                elif entry.name.endswith(SUFFIX) and entry.is_file():
                    files.append((info.st_mtime, info.st_size, path))
        total = 0
        for _, size, path in sorted(files, key=lambda f: f[0], reverse=True):
            total += size
            if total > max_bytes and path != keep and _unlink(path):
                removed.append(path)
        return removed


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
    except OSError:
        return False
    return True


def _pack(key: ArtifactKey, payload: bytes) -> bytes:
    header = {
        "format": ARTIFACT_FORMAT,
        "key": key.digest,
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
        "payload_bytes": len(payload),
        "parts": key.parts,
    }
    return MAGIC + b"\n" + json.dumps(header, sort_keys=True).encode() + b"\n" + payload


def _unpack(path: Path, data: bytes, key: ArtifactKey) -> bytes:
    magic, _, rest = data.partition(b"\n")
    if magic != MAGIC:
        raise StepArtifactError(path, f"does not start with {MAGIC.decode()!r}")
    line, newline, payload = rest.partition(b"\n")
    if not newline:
        raise StepArtifactError(path, "has no header line (truncated)")
    try:
        header = json.loads(line)
    except ValueError as exc:
        raise StepArtifactError(path, f"has a damaged header ({exc})") from exc
    if not isinstance(header, dict):
        raise StepArtifactError(path, "has a damaged header (not an object)")
    if header.get("format") != ARTIFACT_FORMAT:
        raise StepArtifactError(
            path, f"is format {header.get('format')!r}, this llmrt reads {ARTIFACT_FORMAT}"
        )
    if header.get("key") != key.digest:
        raise StepArtifactError(path, f"was saved for key {header.get('key')}, not {key.digest}")
    if header.get("payload_bytes") != len(payload):
        raise StepArtifactError(
            path,
            f"holds {len(payload)} payload bytes, its header says {header.get('payload_bytes')}"
            " (truncated or appended to)",
        )
    if header.get("payload_sha256") != hashlib.sha256(payload).hexdigest():
        raise StepArtifactError(path, "payload does not match its SHA-256 (damaged)")
    return payload


def guard_failure(step: PrecompiledStep, *args: Any, **kwargs: Any) -> str:
    """Why ``step``'s guards reject these inputs, in Dynamo's words (call after
    ``guard_check`` returned False)."""
    try:
        step(*args, **kwargs)
    except RuntimeError as exc:
        return str(exc)
    return "guards passed on a second check"
