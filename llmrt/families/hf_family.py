"""A family over Hugging Face-named checkpoints, assembled from a family's plain functions.

Each built-in family module supplies four functions (read its spec from ``config.json``,
the tensors a spec needs, which of them may be absent, build the model) and, where
checkpoints name tensors in more than one way, a renaming; :class:`HFFamily` turns
them into the ``Family`` the registry serves, validating every tensor before building.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

import attrs
import torch

from llmrt.families.base import ModelConfig
from llmrt.families.causal_lm import PagedCausalLM
from llmrt.families.tensors import check_tensors


class Spec(Protocol):
    """A family's parsed config: at least the runtime-facing ``ModelConfig``."""

    @property
    def model(self) -> ModelConfig: ...


S = TypeVar("S", bound=Spec)
S_co = TypeVar("S_co", bound=Spec, covariant=True)
S_contra = TypeVar("S_contra", bound=Spec, contravariant=True)

TensorShapes = dict[str, tuple[int, ...]]
Tensors = Mapping[str, torch.Tensor]


class SpecReader(Protocol[S_co]):
    def __call__(self, hf_config: Mapping[str, Any], *, dtype: torch.dtype) -> S_co: ...


class ModelBuilder(Protocol[S_contra]):
    def __call__(
        self, *, spec: S_contra, tensors: Tensors, device: torch.device
    ) -> PagedCausalLM: ...


class Renamer(Protocol):
    def __call__(self, tensors: Tensors, *, expected: TensorShapes) -> dict[str, torch.Tensor]: ...


@attrs.frozen(kw_only=True)
class HFFamily(Generic[S]):
    """Builds ``PagedCausalLM`` models from HF-named tensors through a family's functions.

    ``rename`` maps alternative checkpoint names onto the expected ones before validation
    (None: names are taken as they are).
    """

    name: str
    model_types: tuple[str, ...]
    read_spec: SpecReader[S]
    spec_tensors: Callable[[S], TensorShapes]
    spec_optional_tensors: Callable[[S], frozenset[str]]
    build_model: ModelBuilder[S]
    ignored_suffixes: tuple[str, ...] = ()
    rename: Renamer | None = None

    def model_config(self, hf_config: Mapping[str, Any], *, dtype: torch.dtype) -> ModelConfig:
        """The runtime-facing config of the model ``build`` would return."""
        return self.read_spec(hf_config, dtype=dtype).model

    def expected_tensors(self, hf_config: Mapping[str, Any]) -> TensorShapes:
        """HF tensor names -> shapes this config needs (some may be ``optional_tensors``)."""
        return self.spec_tensors(self.read_spec(hf_config, dtype=torch.float32))

    def optional_tensors(self, hf_config: Mapping[str, Any]) -> frozenset[str]:
        """Names in ``expected_tensors`` that may be absent."""
        return self.spec_optional_tensors(self.read_spec(hf_config, dtype=torch.float32))

    def build(
        self,
        *,
        hf_config: Mapping[str, Any],
        tensors: Tensors,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> PagedCausalLM:
        """Validate config and every tensor, then build; raises ``CheckpointError`` first."""
        spec = self.read_spec(hf_config, dtype=dtype)
        expected = self.spec_tensors(spec)
        used = check_tensors(
            tensors=tensors if self.rename is None else self.rename(tensors, expected=expected),
            expected=expected,
            optional=self.spec_optional_tensors(spec),
            ignored_suffixes=self.ignored_suffixes,
        )
        return self.build_model(spec=spec, tensors=used, device=torch.device(device))
