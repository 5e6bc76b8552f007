"""The on-disk checkpoint cache: converted (e.g. dequantized GGUF) checkpoints as safetensors.

Layout under the cache directory (`LLMRT_CACHE_DIR`, else the platform's user cache dir):

- `digests/<key>`: the SHA-256 of a source file, keyed by its path, size and mtime, so an
  unchanged file is not re-hashed on every load;
- `<kind>/<digest>-v<version>/`: one entry per source content hash, holding `tensors.safetensors`,
  optionally `tokenizer.json`, and `meta.json` (config, tensor listing, file sizes).

Every file is written to a temporary name and moved into place with `os.replace`; `meta.json` is
written last, so an entry without a valid `meta.json` matching its files is incomplete and is
rebuilt. Cache write failures are logged and never fail a load.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from llmrt.lifecycle.progress import progress_step

ENTRY_FORMAT = 1

_CHUNK = 8 << 20
_DIGEST = re.compile(r"[0-9a-f]{64}")
_log = logging.getLogger(__name__)


def file_digest(path: Path, *, cache_dir: Path) -> str:
    """SHA-256 of `path`'s content, memoized under `cache_dir` by (real path, inode, size,
    mtime, ctime): a file rewritten in place keeps its size and can be given its old mtime
    back (``cp -p``, ``rsync -a``, ``touch -r``, builds with fixed mtimes), never its ctime."""
    stat = path.stat()
    identity = (
        f"{path.resolve()}\0{stat.st_ino}\0{stat.st_size}\0{stat.st_mtime_ns}\0"
        f"{stat.st_ctime_ns}"
    )
    memo = cache_dir / "digests" / hashlib.sha256(identity.encode()).hexdigest()
    try:
        remembered = memo.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        remembered = ""
    if _DIGEST.fullmatch(remembered):
        return remembered
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    value = digest.hexdigest()
    try:
        atomic_write(memo, lambda tmp: tmp.write_text(value, encoding="ascii"))
    except OSError as exc:
        _log.warning("cannot record digest of %s in %s: %s", path, memo, exc)
    return value


#: A temporary file of ``atomic_write`` untouched this long was left by a writer that was
#: killed (a live one writes it continuously): the next write of that file removes it.
STALE_TMP_S = 600


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Create `path` via a fsync-ed sibling temporary file and `os.replace` (removing the
    temporary files of earlier writers of `path` that were killed before either)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for left in path.parent.glob(f".{path.name}.*.tmp"):
        with contextlib.suppress(OSError):
            if now - left.stat().st_mtime > STALE_TMP_S:
                left.unlink()
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        write(tmp)
        with tmp.open("rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


#: Pages ``sample_digest`` reads, spread evenly over the file.
SAMPLE_PAGES = 256
_PAGE = 4096


def sample_digest(path: Path) -> str:
    """BLAKE2 of ``SAMPLE_PAGES`` pages spread over ``path``: catches a cache file damaged
    in place at its size (zeroed or overwritten ranges, a bad copy) for a ~1 MiB read per
    load, where hashing every byte would add ~0.3 s per GB; single flipped bits can pass."""
    size = path.stat().st_size
    digest = hashlib.blake2b(digest_size=16)
    digest.update(size.to_bytes(8, "little"))
    last = max(0, size - _PAGE)
    with path.open("rb") as handle:
        for i in range(SAMPLE_PAGES):
            handle.seek(last * i // (SAMPLE_PAGES - 1))
            digest.update(handle.read(_PAGE))
    return digest.hexdigest()


@attrs.frozen(kw_only=True)
class CachedCheckpoint:
    """What a cache entry holds: config, float32 tensors, serialized tokenizer (if any)."""

    hf_config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tokenizer_json: str | None


@attrs.frozen(kw_only=True)
class CacheEntry:
    """One cache entry directory, for one source content hash and entry format."""

    directory: Path

    @classmethod
    def for_digest(cls, *, cache_dir: Path, kind: str, digest: str, version: int) -> CacheEntry:
        """The entry for source content `digest` converted by loader `version`."""
        return cls(directory=cache_dir / kind / f"{digest}-v{ENTRY_FORMAT}.{version}")

    @property
    def meta_path(self) -> Path:
        return self.directory / "meta.json"

    @property
    def tensors_path(self) -> Path:
        return self.directory / "tensors.safetensors"

    @property
    def tokenizer_path(self) -> Path:
        return self.directory / "tokenizer.json"

    def read(self) -> CachedCheckpoint | None:
        """The entry's content, or None when it is missing, incomplete or corrupt."""
        if not self.meta_path.is_file():
            return None
        try:
            return self._read()
        except Exception as exc:  # any failure means "rebuild"; the cause is logged
            _log.warning("discarding corrupt cache entry %s: %s", self.directory, exc)
            return None

    def write(self, content: CachedCheckpoint) -> None:
        """Store `content` atomically; failures are logged and leave no half entry behind."""
        try:
            with progress_step(f"writing the weight cache {self.directory}"):
                self._write(content)
        except Exception as exc:  # a cache is an optimisation: never fail the load for it
            _log.warning("cannot write cache entry %s: %s", self.directory, exc)
            with contextlib.suppress(OSError):
                self.meta_path.unlink(missing_ok=True)

    def _read(self) -> CachedCheckpoint:
        meta = json.loads(self.meta_path.read_text(encoding="utf-8"))
        if meta["format"] != ENTRY_FORMAT:
            raise ValueError(f"entry format {meta['format']}")
        if self.tensors_path.stat().st_size != meta["tensors_bytes"]:
            raise ValueError("tensors.safetensors has the wrong size")
        sampled = meta.get("tensors_sample")  # absent in entries written before it was kept
        if sampled is not None and sampled != sample_digest(self.tensors_path):
            raise ValueError("tensors.safetensors changed since it was written (sampled pages)")
        listing: dict[str, list[int]] = meta["tensors"]
        with safe_open(str(self.tensors_path), framework="pt") as handle:
            stored = {name: list(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
        if stored != listing:
            raise ValueError("tensors.safetensors does not match meta.json")
        tensors = load_file(str(self.tensors_path))
        tokenizer_json = None
        if meta["tokenizer_bytes"] is not None:
            raw = self.tokenizer_path.read_bytes()
            if len(raw) != meta["tokenizer_bytes"]:
                raise ValueError("tokenizer.json has the wrong size")
            tokenizer_json = raw.decode("utf-8")
        return CachedCheckpoint(
            hf_config=dict(meta["hf_config"]), tensors=tensors, tokenizer_json=tokenizer_json
        )

    def _write(self, content: CachedCheckpoint) -> None:
        self.meta_path.unlink(missing_ok=True)
        tensors = {name: t.contiguous() for name, t in content.tensors.items()}
        atomic_write(self.tensors_path, lambda tmp: save_file(tensors, str(tmp)))
        tokenizer_bytes = None
        if content.tokenizer_json is not None:
            raw = content.tokenizer_json.encode("utf-8")
            tokenizer_bytes = len(raw)
            atomic_write(self.tokenizer_path, lambda tmp: tmp.write_bytes(raw))
        meta: Mapping[str, Any] = {
            "format": ENTRY_FORMAT,
            "hf_config": content.hf_config,
            "tensors": {name: list(t.shape) for name, t in tensors.items()},
            "tensors_bytes": self.tensors_path.stat().st_size,
            "tensors_sample": sample_digest(self.tensors_path),
            "tokenizer_bytes": tokenizer_bytes,
        }
        text = json.dumps(meta, indent=1, sort_keys=True)
        atomic_write(self.meta_path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
