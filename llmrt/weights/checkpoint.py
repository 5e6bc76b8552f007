"""`Checkpoint` and `load_checkpoint`: model weights, config and tokenizer in Hugging Face form.

Every format (seeded random, a Hugging Face safetensors directory, a GGUF file) yields the same
thing: a `config.json`-style dict with `model_type`, float32 CPU tensors under Hugging Face
parameter names, and a `Tokenizer` when the source has one. When the caller (a model family)
supplies `expected_tensors`, the checkpoint is checked against it before it is returned:
a missing or mis-shaped tensor is a `CheckpointError` naming it, never a partial checkpoint.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Literal

import attrs
import torch

from llmrt.errors import CheckpointError, ConfigError, LLMRTError
from llmrt.families import registry
from llmrt.kernels.formats import ROW_LAYOUTS, CheckpointTensor, QuantizedWeight
from llmrt.paths import default_cache_dir
from llmrt.weights.gguf import load_gguf, read_gguf_config
from llmrt.weights.mapped_pages import PageRelease, mapping_address, release_clean_pages
from llmrt.weights.package_data import package_file
from llmrt.weights.random import random_config, random_tensors
from llmrt.weights.safetensors_dir import read_safetensors_dir
from llmrt.weights.tokenizer import (
    BYTE_BOS_TOKEN_ID,
    BYTE_EOS_TOKEN_ID,
    BYTE_VOCAB_SIZE,
    Tokenizer,
    byte_tokenizer,
)

CheckpointFormat = Literal["random", "safetensors", "gguf"]
ExpectedTensors = Callable[[dict[str, Any]], Mapping[str, tuple[int, ...]]]
OptionalTensors = Callable[[dict[str, Any]], Collection[str]]
TensorInits = Callable[[dict[str, Any]], Mapping[str, Any]]
Renamer = Callable[..., Mapping[str, torch.Tensor]]

_log = logging.getLogger(__name__)


def _has_model_type(instance: Any, attribute: attrs.Attribute[Any], value: dict[str, Any]) -> None:
    if not isinstance(value.get("model_type"), str):
        raise CheckpointError("config.model_type", f"missing field in checkpoint {instance.source}")


def _float32_cpu(
    instance: Any, attribute: attrs.Attribute[Any], value: dict[str, CheckpointTensor]
) -> None:
    for name, tensor in value.items():
        if isinstance(tensor, QuantizedWeight):
            if tensor.device.type != "cpu":
                raise CheckpointError(name, f"must be on CPU, got {tensor.device}")
            continue
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
            reason = f"must be float32 on CPU, got {tensor.dtype} on {tensor.device}"
            raise CheckpointError(name, reason)


@attrs.frozen(kw_only=True, eq=False)
class Checkpoint:
    """A loaded checkpoint; owns its tensors (float32, CPU, Hugging Face names).

    `hf_config` is in Hugging Face `config.json` form with `model_type` set; `source`
    says where it came from (for logs and errors).
    """

    source: str
    hf_config: dict[str, Any] = attrs.field(validator=_has_model_type)
    tensors: dict[str, CheckpointTensor] = attrs.field(validator=_float32_cpu)
    tokenizer: Tokenizer | None
    #: File mappings tensors view (a GGUF's quantized blocks), for ``release_mapped_pages``.
    mappings: tuple[mmap.mmap, ...] = ()

    def release_mapped_pages(self) -> PageRelease:
        """Give back the resident pages of the file mappings (``mapped_pages``): for a caller
        whose model copied its weights out; a tensor read later faults its bytes back in."""
        released, skipped = 0, []
        for mapping in self.mappings:
            done = release_clean_pages(mapping)
            released += done.released_bytes
            if done.skipped is not None:
                skipped.append(done.skipped)
        return PageRelease(released_bytes=released, skipped="; ".join(skipped) or None)

    def follow_relayout(self, old: QuantizedWeight, new: QuantizedWeight) -> int:
        """Point the tensors that view rows of ``old`` at the same rows of ``new``, the same
        matrix in a layout that keeps rows apart (``ROW_LAYOUTS``); returns how many moved.

        Why: a model build fuses checkpoint tensors into one copy (q/k/v, gate/up) and moves
        them onto it (``concat_rows``); once the model reads an interleaved copy instead,
        these views were all that kept the fused buffer alive (342 MiB for a 1B Q4_0). A
        lane built later from this checkpoint reads the new rows (their layout says so), so
        the bytes are held once. Views of the file's mapping stay: their pages were given
        back and cost nothing held, and the file's own bytes stay the checkpoint's."""
        if new.layout not in ROW_LAYOUTS or old.layout not in ROW_LAYOUTS:
            return 0
        if new.shape != old.shape or new.kind != old.kind or not old.blocks.is_contiguous():
            return 0
        storage = old.blocks.untyped_storage().data_ptr()
        if self._in_mapping(storage):
            return 0
        row_bytes = int(old.blocks.shape[1])
        moved = 0
        for name, tensor in self.tensors.items():
            if not isinstance(tensor, QuantizedWeight) or tensor.blocks.numel() == 0:
                continue
            blocks = tensor.blocks
            if blocks.untyped_storage().data_ptr() != storage or not blocks.is_contiguous():
                continue
            same = (tensor.kind, tensor.layout, tensor.shape[1])
            if same != (old.kind, old.layout, old.shape[1]):
                continue
            offset = int(blocks.storage_offset()) - int(old.blocks.storage_offset())
            start, rest = divmod(offset, row_bytes)
            if rest or start < 0 or start + tensor.shape[0] > old.shape[0]:
                continue
            self.tensors[name] = new.rows(start, tensor.shape[0])
            moved += 1
        return moved

    def storage_views(self) -> tuple[torch.Tensor, ...]:
        """The tensors holding the checkpoint's bytes (a quantized weight's blocks), for a
        caller that moves a model's storages and the checkpoint's views of them with it
        (``place_module_weights``)."""
        return tuple(
            t.blocks if isinstance(t, QuantizedWeight) else t for t in self.tensors.values()
        )

    def _in_mapping(self, address: int) -> bool:
        """Whether ``address`` lies in one of the file mappings (a view of the file)."""
        for mapping in self.mappings:
            if mapping.closed:
                continue
            begin = mapping_address(mapping)
            if begin <= address < begin + len(mapping):
                return True
        return False


def load_checkpoint(
    *,
    format: CheckpointFormat,
    path: str | os.PathLike[str] | None = None,
    package: str | None = None,
    file: str | None = None,
    model: Mapping[str, Any] | None = None,
    seed: int = 0,
    expected_tensors: ExpectedTensors | None = None,
    optional_tensors: OptionalTensors | None = None,
    model_types: Collection[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    tensor_init: TensorInits | None = None,
    rename: Renamer | None = None,
    keep_quantized: bool = False,
    requantize: str | None = None,
) -> Checkpoint:
    """Load a checkpoint.

    - `random`: `model` gives the config keys (`model_type` required); tensors are drawn
      from `seed` for every name `expected_tensors(config)` lists (optional ones skipped);
      the tokenizer is the byte tokenizer.
    - `safetensors`: `path` is a local Hugging Face checkpoint directory.
    - `gguf`: `path` is a GGUF file, or `package` + `file` name one inside an installed
      package; the dequantized result is cached under `cache_dir` (default: `default_cache_dir()`).
      With `keep_quantized`, weights in a block layout llmrt's kernels run stay quantized
      (`QuantizedWeight`); the other tensors are float32 as usual. `requantize` (``q8_0``)
      is what a tensor of a type without a kernel becomes (else a `CheckpointError`).

    `model_types` (accepted `model_type` values) and `expected_tensors` / `optional_tensors`
    (from the model family) validate the result; tensors the family does not expect are dropped.
    `tensor_init` (from the family) says how a random checkpoint fills each tensor;
    `rename(tensors, expected=shapes, config=hf_config)` (from the family) maps the
    checkpoint's own names (e.g. per-expert weights) onto the expected ones before they are
    checked.
    """
    if format == "random":
        _forbid(format, path=path, package=package, file=file)
        return _random(
            model=model,
            seed=seed,
            expected_tensors=expected_tensors,
            optional_tensors=optional_tensors,
            model_types=model_types,
            tensor_init=tensor_init,
        )
    mappings: tuple[mmap.mmap, ...] = ()
    if format == "safetensors":
        _forbid(format, package=package, file=file, model=model)
        if path is None:
            raise ConfigError("checkpoint.path", None, "required for format 'safetensors'")
        directory = existing_checkpoint_path(path, directory=True)
        contents = read_safetensors_dir(directory)
        source = f"safetensors:{directory}"
        hf_config, tokenizer = contents.hf_config, contents.tokenizer
        tensors: dict[str, CheckpointTensor] = dict(contents.tensors)
    elif format == "gguf":
        _forbid(format, model=model)
        gguf_path = _gguf_path(path=path, package=package, file=file)
        cache_root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        loaded = load_gguf(
            path=gguf_path,
            cache_dir=cache_root,
            keep_quantized=keep_quantized,
            requantize=requantize,
        )
        source = f"gguf:{gguf_path}"
        hf_config, tensors, tokenizer = loaded.hf_config, loaded.tensors, loaded.tokenizer
        mappings = (loaded.mapping,) if loaded.mapping is not None else ()
    else:
        raise ConfigError(
            "checkpoint.format", format, "must be one of 'random', 'safetensors', 'gguf'"
        )
    _check_model_type(hf_config, model_types)
    if expected_tensors is not None:
        expected = _expected(expected_tensors, optional_tensors, hf_config)
        if rename is not None:
            tensors = dict(
                rename(
                    tensors,
                    expected={**expected.required, **expected.optional},
                    config=hf_config,
                )
            )
        tensors = _conform(tensors, expected=expected, source=source)
    return Checkpoint(
        source=source, hf_config=hf_config, tensors=tensors, tokenizer=tokenizer, mappings=mappings
    )


def existing_checkpoint_path(
    path: str | os.PathLike[str], *, directory: bool, field: str = "checkpoint.path"
) -> Path:
    """``path`` expanded, when it names an existing directory (``directory``) or file;
    otherwise a ``ConfigError`` naming ``field`` and what is missing."""
    location = Path(path).expanduser()
    want = "directory" if directory else "file"
    if not location.exists():
        raise ConfigError(field, os.fspath(path), f"no such {want}")
    if directory and not location.is_dir():
        raise ConfigError(
            field,
            os.fspath(path),
            "is a file; a Hugging Face checkpoint is a directory (config.json, *.safetensors)",
        )
    if not directory and not location.is_file():
        raise ConfigError(field, os.fspath(path), "is a directory, not a GGUF file")
    if not os.access(location, os.R_OK | (os.X_OK if directory else 0)):
        raise ConfigError(field, os.fspath(path), "is not readable (permissions)")
    return location


def gguf_config(
    *,
    path: str | os.PathLike[str] | None = None,
    package: str | None = None,
    file: str | None = None,
) -> dict[str, Any]:
    """The Hugging Face config (with `model_type`) of a GGUF checkpoint, read from its header
    only: `path`, or `package` + `file`, as for `load_checkpoint`."""
    return read_gguf_config(_gguf_path(path=path, package=package, file=file))


def _random(
    *,
    model: Mapping[str, Any] | None,
    seed: int,
    expected_tensors: ExpectedTensors | None,
    optional_tensors: OptionalTensors | None,
    model_types: Collection[str] | None,
    tensor_init: TensorInits | None = None,
) -> Checkpoint:
    if model is None:
        raise ConfigError("checkpoint.model", None, "required for format 'random'")
    if expected_tensors is None:
        raise ConfigError(
            "checkpoint.expected_tensors", None, "required for format 'random' (tensor shapes)"
        )
    tokenizer = byte_tokenizer()
    hf_config = random_config(
        model=model,
        vocab_size=BYTE_VOCAB_SIZE,
        bos_token_id=BYTE_BOS_TOKEN_ID,
        eos_token_id=BYTE_EOS_TOKEN_ID,
    )
    _check_model_type(hf_config, model_types)
    expected = _expected(expected_tensors, optional_tensors, hf_config)
    return Checkpoint(
        source=f"random(model_type={hf_config['model_type']}, seed={seed})",
        hf_config=hf_config,
        tensors=dict[str, CheckpointTensor](
            random_tensors(
                shapes=expected.required,
                seed=seed,
                init=dict(tensor_init(hf_config)) if tensor_init is not None else None,
            )
        ),
        tokenizer=tokenizer,
    )


@attrs.frozen(kw_only=True)
class _Expected:
    required: dict[str, tuple[int, ...]]
    optional: dict[str, tuple[int, ...]]


def _expected(
    expected_tensors: ExpectedTensors,
    optional_tensors: OptionalTensors | None,
    hf_config: dict[str, Any],
) -> _Expected:
    """The family's expectations for `hf_config`; a config it cannot read is a CheckpointError."""
    try:
        shapes = {name: tuple(shape) for name, shape in expected_tensors(hf_config).items()}
        optional = set(optional_tensors(hf_config)) if optional_tensors is not None else set()
    except LLMRTError:
        raise
    except KeyError as exc:
        field = exc.args[0] if exc.args else "?"
        raise CheckpointError(f"config.{field}", "missing field the model family needs") from exc
    except (TypeError, ValueError) as exc:
        raise CheckpointError("config", f"the model family cannot read it: {exc}") from exc
    return _Expected(
        required={n: s for n, s in shapes.items() if n not in optional},
        optional={n: s for n, s in shapes.items() if n in optional},
    )


def _conform(
    tensors: dict[str, CheckpointTensor], *, expected: _Expected, source: str
) -> dict[str, CheckpointTensor]:
    """Tensors named and shaped as `expected` (base-model prefixes restored, extras dropped)."""
    wanted = {**expected.required, **expected.optional}
    unprefixed = {name.split(".", 1)[1]: name for name in wanted if "." in name}
    named: dict[str, CheckpointTensor] = {}
    for name, tensor in tensors.items():
        target = None if name in wanted else unprefixed.get(name)
        named.setdefault(target if target is not None and target not in tensors else name, tensor)
    missing = [name for name in expected.required if name not in named]
    if missing:
        listed = ", ".join(missing[1:4])
        more = f" (and {len(missing) - 1} more: {listed}...)" if missing[1:] else ""
        raise CheckpointError(missing[0], f"missing from {source}{more}")
    result = {}
    for name, shape in wanted.items():
        if name not in named:
            continue
        got = tuple(named[name].shape)
        if got != shape:
            raise CheckpointError(name, f"shape {got} in {source}, expected {shape}")
        result[name] = named[name]
    dropped = sorted(set(named) - set(result))
    if dropped:
        _log.info("%s: ignoring %d unexpected tensors (%s...)", source, len(dropped), dropped[:3])
    return result


def _check_model_type(hf_config: Mapping[str, Any], model_types: Collection[str] | None) -> None:
    model_type = hf_config.get("model_type")
    if model_types is not None and model_type not in model_types:
        raise CheckpointError(
            "config.model_type",
            f"unknown model_type {model_type!r}; expected one of {sorted(model_types)}"
            f"{registry.claimed_by(str(model_type))}",
        )


def _gguf_path(
    *, path: str | os.PathLike[str] | None, package: str | None, file: str | None
) -> Path:
    if path is not None:
        if package is not None or file is not None:
            raise ConfigError(
                "checkpoint.path", os.fspath(path), "give either path or package + file, not both"
            )
        return existing_checkpoint_path(path, directory=False)
    if package is None or file is None:
        raise ConfigError(
            "checkpoint.package" if package is None else "checkpoint.file",
            None,
            "format 'gguf' needs path, or package and file",
        )
    return package_file(package=package, file=file)


def _forbid(format: str, **given: object) -> None:
    for key, value in given.items():
        if value is not None:
            raise ConfigError(f"checkpoint.{key}", value, f"not used by format {format!r}")
