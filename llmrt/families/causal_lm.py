"""The Model protocol (docs/contracts.md) implemented once, around a family's backbone.

A backbone is the family-specific network (embeddings, layers, head); this wrapper
owns the contract: KV binding, request planning and the prefill/decode entry points.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from llmrt.families.base import AttentionMetadata, KVCacheView, ModelConfig
from llmrt.families.kvbinding import BoundKV, check_kv_cache, require_bound
from llmrt.families.paged_attention import (
    TOKEN_MAJOR,
    DecodePlan,
    PrefillPlan,
    plan_decode,
    plan_prefill,
)


class Backbone(Protocol):
    """What a family provides: hidden states over paged KV, logits, and its modules in order."""

    def hidden_states(
        self,
        *,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        plan: PrefillPlan | DecodePlan,
        kv: BoundKV,
    ) -> torch.Tensor:
        """``tokens``/``positions`` ``[B, S]`` -> ``[B, S, hidden]``; writes K/V via ``plan``
        (a packed prefill passes ``[1, T]``, its real tokens)."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: ``[B, hidden]`` -> float32 ``[B, vocab]``."""
        ...

    def executor_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """Top-level modules in execution order, named relative to the backbone."""
        ...

    def device(self) -> torch.device:
        """The device the weights live on."""
        ...

    def reserve_positions(self, count: int) -> None:
        """Prepare per-position tables for positions below ``count`` (the bound KV's span)."""
        ...


class PagedCausalLM(nn.Module):
    """A causal LM over a borrowed paged KV cache; satisfies ``llmrt.families.base.CausalLM``.

    Borrows the KV tensors bound with ``set_kv_cache`` (the runtime owns them); owns
    its weights through ``backbone``.
    """

    supports_batched_prefill_outputs: bool = True
    #: Eager prefill runs its layers on the real tokens only, packed back to back
    #: (``PackedTokens``): padding costs nothing in the linears, so a wave may hold prompts
    #: of any lengths (``prefill.wave_rules: ragged``). False keeps the padded rows (the
    #: architecture parity tests compare the two). Compiled and captured steps never pack
    #: (no host reads there; their shapes are static).
    pack_prefill: bool = True
    backbone: Backbone

    def __init__(self, *, config: ModelConfig, backbone: nn.Module) -> None:
        super().__init__()
        self.config: ModelConfig = config
        self.backbone = backbone  # type: ignore[assignment]
        self._kv: BoundKV | None = None

    def attention_metadata(self) -> AttentionMetadata:
        """The paged KV geometry this model needs (one K and one V tensor per layer)."""
        return AttentionMetadata(
            num_layers=self.config.num_layers,
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            kv_dtypes=(self.config.dtype,) * self.config.num_layers,
            kv_dim_order=TOKEN_MAJOR,
        )

    def iter_executor_named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """Top-level modules in execution order, named as in ``named_modules()``."""
        for name, module in self.backbone.executor_modules():
            yield f"backbone.{name}", module

    def set_kv_cache(self, cache: KVCacheView | None) -> None:
        """Bind (borrow) ``cache`` after validating every layer, or unbind with None.

        Transactional: a rejected cache raises ``ConfigError`` and leaves the previous
        binding in place.
        """
        if cache is None:
            self._kv = None
            self._release_fused_cache()
            return
        bound = check_kv_cache(
            cache=cache, metadata=self.attention_metadata(), device=self.backbone.device()
        )
        self.backbone.reserve_positions(bound.keys[0].shape[0] * bound.block_size)
        self._kv = bound
        self._release_fused_cache()

    def _release_fused_cache(self) -> None:
        """A fused decode op borrowed the previous binding's caches: it lets go of them."""
        release = getattr(self.backbone, "release_fused_cache", None)
        if release is not None:
            release()

    def prefill_forward(
        self,
        *,
        tokens: torch.Tensor,
        start_pos: torch.Tensor,
        seq_lens: torch.Tensor,
        page_table: torch.Tensor,
        last_token_index: torch.Tensor,
    ) -> torch.Tensor:
        """Run a (chunked, ragged) prefill; float32 logits ``[B, vocab]`` at the last tokens."""
        kv = require_bound(self._kv)
        with torch.no_grad():
            rows, chunk = tokens.shape
            plan = plan_prefill(
                start_pos=start_pos,
                seq_lens=seq_lens,
                page_table=page_table,
                block_size=kv.block_size,
                chunk_len=chunk,
                pack=self.pack_prefill,
            )
            packed = plan.packed
            if packed is not None:
                hidden = self.backbone.hidden_states(
                    tokens=packed.pack(tokens.to(packed.flat_index.device)),
                    positions=packed.pack(plan.positions),
                    plan=plan,
                    kv=kv,
                )
                return self.backbone.logits(hidden[0, packed.last_tokens(last_token_index)])
            hidden = self.backbone.hidden_states(
                tokens=tokens, positions=plan.positions, plan=plan, kv=kv
            )
            index = last_token_index.to(device=hidden.device, dtype=torch.long)
            index = index.clamp(0, max(chunk - 1, 0))
            last = hidden[torch.arange(rows, device=hidden.device), index]
            return self.backbone.logits(last)

    def decode_forward(
        self, *, tokens: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor
    ) -> torch.Tensor:
        """One token per row at ``positions``; float32 logits ``[B, vocab]``."""
        # The fused op's bound step, called straight while it holds this binding: a step
        # runs right after ~100 MB of weights went through the caches, so every Python frame
        # and TorchScript call on the way is mostly cache misses (~4-8% of SmolLM2's
        # batch-1 step with the frames below; in-process A/B).
        if not torch.compiler.is_compiling():
            fast = getattr(self.backbone, "decode_fast", None)
            if (
                fast is not None
                and fast.bound_kv is self._kv
                and 0 < tokens.shape[0] < fast.max_rows
                and getattr(self.backbone, "fused_decode", False)
            ):
                return fast.step_bound(tokens=tokens, positions=positions, page_table=page_table)
        kv = require_bound(self._kv)
        with torch.no_grad():
            fused = getattr(self.backbone, "decode_fused", None)
            if fused is not None:
                logits: torch.Tensor | None = fused(
                    tokens=tokens, positions=positions, page_table=page_table, kv=kv
                )
                if logits is not None:
                    return logits
            plan = plan_decode(positions=positions, page_table=page_table, block_size=kv.block_size)
            hidden = self.backbone.hidden_states(
                tokens=tokens[:, None], positions=plan.positions[:, None], plan=plan, kv=kv
            )
            return self.backbone.logits(hidden[:, 0])
