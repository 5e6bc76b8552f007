"""Exclusive ownership of the physical paged-KV tensors of one lane.

The manager moves through ``unresolved -> configured -> bound -> released``.
It allocates every per-layer K/V tensor from the model's attention metadata,
hands the model an immutable *borrowed* :class:`PagedKVCacheContext`, and is the
only object that ever deallocates those tensors.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import torch

from llmrt.device.base import Device
from llmrt.errors import ConfigError, KVCacheStateError
from llmrt.families.base import AttentionMetadata
from llmrt.lifecycle.events import component_logger, emit
from llmrt.runtime.config import PagedKVCacheConfig
from llmrt.runtime.tensor_resources import (
    ReleaseLedger,
    TensorResourceOrphan,
    release_tensors,
    retry_orphans,
)


class KVCacheState(enum.Enum):
    UNRESOLVED = "unresolved"
    CONFIGURED = "configured"
    BOUND = "bound"
    RELEASED = "released"


class KVBindableModel(Protocol):
    def attention_metadata(self) -> AttentionMetadata: ...

    def set_kv_cache(self, cache: Any) -> None: ...


@attrs.frozen(kw_only=True, eq=False)
class PagedKVCacheContext:
    """Borrowed view of the bound cache. The manager owns the tensors; never deallocate them."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    block_size: int
    num_blocks: int
    dtype: torch.dtype
    device_id: str

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def tensor_ids(self) -> tuple[int, ...]:
        return tuple(id(t) for t in (*self.keys, *self.values))


_TRANSITIONS: dict[KVCacheState, tuple[KVCacheState, ...]] = {
    KVCacheState.UNRESOLVED: (KVCacheState.CONFIGURED, KVCacheState.RELEASED),
    KVCacheState.CONFIGURED: (KVCacheState.BOUND, KVCacheState.RELEASED),
    KVCacheState.BOUND: (KVCacheState.RELEASED,),
    KVCacheState.RELEASED: (KVCacheState.RELEASED,),
}


class PagedKVCacheManager:
    """Owns one lane's physical KV; borrows the model and the device."""

    def __init__(
        self,
        *,
        model: KVBindableModel,
        device: Device,
        config: PagedKVCacheConfig,
        lane: int = 0,
    ) -> None:
        self.borrowed_model = model
        self.borrowed_device = device
        self.config = config
        self.lane = lane
        self.state = KVCacheState.UNRESOLVED
        self._context: PagedKVCacheContext | None = None
        self._context_ids: tuple[int, ...] = ()
        self._unbound = False
        self._ledger = ReleaseLedger()
        self._orphans: list[TensorResourceOrphan] = []
        self._log = component_logger("paged_kv_cache", lane=lane, object_id=f"{id(self):#x}")

    # -- state machine -------------------------------------------------------------------

    def _move(self, target: KVCacheState) -> None:
        if target not in _TRANSITIONS[self.state]:
            raise KVCacheStateError(
                f"paged KV cache cannot move from {self.state.value} to {target.value}",
                current=self.state.value,
                requested=target.value,
            )
        self.state = target

    def configure(self, config: PagedKVCacheConfig | None = None) -> PagedKVCacheConfig:
        """Fix the physical capacity once; a replacement config may only shrink it.

        Configuring again with the capacity already fixed (or ``None``) is a no-op, so a
        start-up that failed later can be retried; another capacity is refused.
        """
        if self.state in (KVCacheState.CONFIGURED, KVCacheState.BOUND):
            if config is None or config == self.config:
                return self.config
            raise KVCacheStateError(
                f"paged KV cache is already {self.state.value} ({self.config.num_blocks} "
                f"blocks); cannot reconfigure it to {config.num_blocks}",
                current=self.state.value,
                requested=KVCacheState.CONFIGURED.value,
            )
        if self.state is not KVCacheState.UNRESOLVED:
            self._move(KVCacheState.CONFIGURED)  # raises: bound or released
        new = self.config if config is None else config
        if config is not None:
            self.config.check_replacement(new)
        if new.num_blocks is None:
            raise ConfigError(
                "kv_cache.num_blocks",
                None,
                "must be resolved (a physical block count) before configure()",
            )
        self._move(KVCacheState.CONFIGURED)
        self.config = new
        emit(
            self._log,
            "kv.configured",
            num_blocks=new.num_blocks,
            block_size=new.block_size,
            dtype=new.dtype,
        )
        return new

    def allocate(self) -> PagedKVCacheContext:
        """Allocate every layer's K/V, bind it to the model transactionally, return the handle."""
        if self.state is not KVCacheState.CONFIGURED:
            raise KVCacheStateError(
                f"allocate() needs a configured cache, state is {self.state.value}",
                current=self.state.value,
                requested=KVCacheState.BOUND.value,
            )
        meta = self.borrowed_model.attention_metadata()
        num_blocks = self.config.num_blocks
        assert num_blocks is not None  # configure() guarantees it
        shape = meta.kv_shape(num_blocks, self.config.block_size)
        dtypes = self._layer_dtypes(meta)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        try:
            for dtype in dtypes:
                for tensors in (keys, values):
                    tensors.append(
                        self.borrowed_device.allocate(
                            shape=shape, dtype=dtype, dim_order=meta.kv_dim_order
                        )
                    )
            context = PagedKVCacheContext(
                keys=tuple(keys),
                values=tuple(values),
                block_size=self.config.block_size,
                num_blocks=num_blocks,
                dtype=dtypes[0],
                device_id=self.borrowed_device.id,
            )
            self.borrowed_model.set_kv_cache(context)
        except BaseException:
            self._orphans.extend(
                release_tensors((keys, values), device=self.borrowed_device, ledger=self._ledger)
            )
            raise
        self._context = context
        self._context_ids = context.tensor_ids()
        self._move(KVCacheState.BOUND)
        emit(
            self._log,
            "kv.allocated",
            layers=len(keys),
            shape=list(shape),
            dtype=str(dtypes[0]),
            device=self.borrowed_device.id,
        )
        emit(self._log, "kv.bound", model=type(self.borrowed_model).__name__)
        return context

    def _layer_dtypes(self, meta: AttentionMetadata) -> tuple[torch.dtype, ...]:
        wanted = self.config.torch_dtype
        dtypes = tuple(meta.kv_dtypes) if meta.kv_dtypes else (wanted,) * meta.num_layers
        if len(dtypes) != meta.num_layers:
            raise ConfigError(
                "model.kv_dtypes", len(dtypes), f"must list one dtype per layer ({meta.num_layers})"
            )
        # The recipe's kv_cache.dtype is the policy; the model's per-layer dtypes say which
        # layers may differ from it. A uniform model takes the configured dtype.
        if len(set(dtypes)) == 1:
            return (wanted,) * meta.num_layers
        return dtypes

    # -- borrowed handle -----------------------------------------------------------------

    @property
    def context(self) -> PagedKVCacheContext:
        if self.state is not KVCacheState.BOUND or self._context is None:
            raise KVCacheStateError(
                f"the KV cache is not bound (state {self.state.value})",
                current=self.state.value,
            )
        return self._context

    @property
    def is_bound(self) -> bool:
        return self.state is KVCacheState.BOUND

    def validate_handle(self, handle: object) -> PagedKVCacheContext:
        """Accept only the exact handle ``allocate()`` returned, with unchanged tensors."""
        context = self.context
        if handle is not context:
            raise KVCacheStateError(
                f"foreign KV cache handle {type(handle).__name__}@{id(handle):#x}; "
                f"this lane's cache is PagedKVCacheContext@{id(context):#x}",
                current=self.state.value,
            )
        if context.tensor_ids() != self._context_ids:
            raise KVCacheStateError(
                "the bound KV cache's tensors were replaced", current=self.state.value
            )
        return context

    def validate_vllm_cache_spec(
        self, *, block_size: int, dtype: torch.dtype | str, num_blocks: int
    ) -> None:
        """Check a server's cache spec against this manager's policy (before allocation)."""
        if block_size != self.config.block_size:
            raise ConfigError(
                "kv_cache.block_size",
                block_size,
                f"server block size does not match the model's {self.config.block_size}",
            )
        wanted = self.config.torch_dtype
        got = (
            dtype
            if isinstance(dtype, torch.dtype)
            else getattr(torch, str(dtype).replace("torch.", ""), None)
        )
        if got != wanted:
            raise ConfigError("kv_cache.dtype", str(dtype), f"server dtype does not match {wanted}")
        ceiling = (
            self.config.num_blocks
            if self.config.num_blocks is not None
            else self.config.max_num_blocks
        )
        if not 0 < num_blocks <= ceiling:
            raise ConfigError(
                "kv_cache.num_blocks", num_blocks, f"server block count must be in [1, {ceiling}]"
            )

    # -- release -------------------------------------------------------------------------

    @property
    def orphans(self) -> Sequence[TensorResourceOrphan]:
        return tuple(self._orphans)

    def release(self) -> None:
        """Unbind and deallocate; idempotent, and a retry releases only what is left."""
        if self._orphans:  # left by an earlier release or by a failed allocate()
            self._orphans = retry_orphans(
                self._orphans, device=self.borrowed_device, ledger=self._ledger
            )
        if self.state is KVCacheState.RELEASED:
            self._raise_orphans()
            return
        context = self._context
        errors: list[BaseException] = []
        if self.state is KVCacheState.BOUND and not self._unbound:
            try:
                self.borrowed_model.set_kv_cache(None)
            except Exception as exc:  # keep going: the tensors must still be released
                errors.append(exc)
            else:
                self._unbound = True
                emit(self._log, "kv.unbound", model=type(self.borrowed_model).__name__)
        if context is not None:
            # The state moves only after every tensor was attempted: an interrupt in between
            # leaves the cache bound, and the retry releases what the ledger has not seen.
            self._orphans.extend(
                release_tensors(
                    (context.keys, context.values), device=self.borrowed_device, ledger=self._ledger
                )
            )
        self._move(KVCacheState.RELEASED)
        self._context = None
        if context is not None:  # a cache that was never allocated has nothing to release
            emit(self._log, "kv.released", orphans=len(self._orphans))
        if errors:
            raise errors[0]
        self._raise_orphans()

    def _raise_orphans(self) -> None:
        if self._orphans:
            first = self._orphans[0]
            raise KVCacheStateError(
                f"{len(self._orphans)} KV tensor(s) failed to deallocate (first at {first.path}: "
                f"{first.error}); call release() again to retry",
                current=self.state.value,
            )
