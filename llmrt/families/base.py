"""The seams between model families and the runtime (see docs/contracts.md).

A family turns a Hugging Face ``config.json`` mapping plus HF-named tensors into a
tensor model (a ``torch.nn.Module``) that computes over a paged KV cache it borrows
from the runtime.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from llmrt.errors import ConfigError
from llmrt.kernels.formats import CheckpointTensor

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


def _positive(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(attribute.name, value, "must be a positive integer")


def _dtype(instance: object, attribute: attrs.Attribute[Any], value: torch.dtype) -> None:
    if value not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise ConfigError(attribute.name, value, f"must be one of {names}")


@attrs.frozen(kw_only=True)
class ModelConfig:
    """What the runtime needs to know about a built model, independent of its family."""

    family: str
    vocab_size: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    num_layers: int = attrs.field(validator=_positive)
    num_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    max_position_embeddings: int = attrs.field(validator=_positive)
    dtype: torch.dtype = attrs.field(validator=_dtype)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                "num_kv_heads", self.num_kv_heads, f"must divide num_heads={self.num_heads}"
            )


@attrs.frozen(kw_only=True)
class AttentionMetadata:
    """The geometry of the paged KV cache a model expects, one K and one V tensor per layer."""

    num_layers: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    kv_dtypes: tuple[torch.dtype, ...]
    kv_dim_order: tuple[int, int, int, int] | None = None
    """Memory order of each K/V tensor's dimensions, outermost first (None: row-major).
    ``(0, 2, 1, 3)`` stores a block's tokens outermost, so a row's pages read back as one
    ``[tokens, heads, head_dim]`` run without a transposing copy; the shape stays ``kv_shape``."""
    tensor_parallel: int = attrs.field(default=1, validator=_positive)
    """Chips the model's KV heads are split over (a ttnn lane's tensor-parallel layers): each
    chip's K/V holds ``num_kv_heads / tensor_parallel`` heads, or one head when the chips
    outnumber the heads (each head replicated on the ``tensor_parallel / num_kv_heads``
    chips whose query heads read it), as the vLLM TT plugin sizes it
    (``num_kv_heads // min(devices, num_kv_heads)``)."""

    def __attrs_post_init__(self) -> None:
        heads, chips = self.num_kv_heads, self.tensor_parallel
        if (heads % chips) if heads >= chips else (chips % heads):
            raise ConfigError(
                "num_kv_heads",
                heads,
                f"must divide over the {chips} tensor-parallel chips, or divide them "
                "(each head replicated on an equal share of the chips)",
            )
        if len(self.kv_dtypes) != self.num_layers:
            raise ConfigError(
                "kv_dtypes", self.kv_dtypes, f"needs one dtype per layer ({self.num_layers})"
            )
        if self.kv_dim_order is not None and sorted(self.kv_dim_order) != [0, 1, 2, 3]:
            raise ConfigError("kv_dim_order", self.kv_dim_order, "must be a permutation of 0..3")

    @property
    def kv_heads_per_device(self) -> int:
        return self.num_kv_heads // min(self.tensor_parallel, self.num_kv_heads)

    def kv_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """One layer's K (or V) shape on each chip: ``(num_blocks, kv_heads_per_device,
        block_size, head_dim)`` (every head with one chip)."""
        return (num_blocks, self.kv_heads_per_device, block_size, self.head_dim)


@runtime_checkable
class KVCacheView(Protocol):
    """Borrowed per-layer K/V tensors of shape ``AttentionMetadata.kv_shape(...)``."""

    @property
    def keys(self) -> Sequence[torch.Tensor]: ...

    @property
    def values(self) -> Sequence[torch.Tensor]: ...

    @property
    def block_size(self) -> int: ...


@runtime_checkable
class CausalLM(Protocol):
    """A tensor model built by a family; computes over a borrowed paged KV cache."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def supports_batched_prefill_outputs(self) -> bool: ...

    def attention_metadata(self) -> AttentionMetadata: ...

    def iter_executor_named_modules(self) -> Iterator[tuple[str, torch.nn.Module]]: ...

    def set_kv_cache(self, cache: KVCacheView | None) -> None: ...

    def prefill_forward(
        self,
        *,
        tokens: torch.Tensor,
        start_pos: torch.Tensor,
        seq_lens: torch.Tensor,
        page_table: torch.Tensor,
        last_token_index: torch.Tensor,
    ) -> torch.Tensor: ...

    def decode_forward(
        self, *, tokens: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor
    ) -> torch.Tensor: ...


@runtime_checkable
class Family(Protocol):
    """A model family registered under the ``llmrt.families`` entry-point group.

    A family may declare ``backends`` (e.g. ``("ttnn",)``; torch only when absent): a recipe
    pairing it with another ``device.backend`` fails validation. ``build`` receives the lane's
    torch device on the torch backend and the lane's port device (a ``TtnnDevice``, with
    ``mesh_device`` and ``ttnn_module``) on ttnn.
    """

    @property
    def name(self) -> str: ...

    @property
    def model_types(self) -> tuple[str, ...]: ...

    def model_config(self, hf_config: Mapping[str, Any], *, dtype: torch.dtype) -> ModelConfig: ...

    def expected_tensors(self, hf_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]: ...

    def optional_tensors(self, hf_config: Mapping[str, Any]) -> frozenset[str]: ...

    def build(
        self,
        *,
        hf_config: Mapping[str, Any],
        tensors: Mapping[str, CheckpointTensor],
        dtype: torch.dtype,
        device: Any,
    ) -> CausalLM: ...
