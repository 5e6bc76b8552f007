"""``ToyTtnnModel``: a tiny TTTv2-style model on ttnn ops, for the runtime's TT call-sequence tests.

It implements the model protocol (``docs/contracts.md``) the way a TTTv2 model does on a mesh:
its weights live on the device (``ttnn.from_torch(..., device=mesh)``, owned by the model until
``close``), every argument arrives as a ttnn device tensor staged by ``TtnnDevice``, K/V are the
runtime's borrowed device tensors, and the forwards call only ttnn functions (never a torch
function on a device tensor), so they run unchanged under ``FakeTtnn(torch_ops="reject")``.

It is not a transformer, but its logits depend on exactly what the runtime must get right:
every valid token's embedding is written into each layer's K (and a scaled copy into V) at
``page_table[b, pos // block_size]``, offset ``pos % block_size``, and a row's logits are
``(sum of its cached K and V at positions 0..p) @ w_out`` for its last position ``p``, read back
through the page table. A missed refresh (stale tokens, positions, offsets or page table), a KV
write in the wrong slot or a skipped write changes them. Weights are small integers, so logits
are exact and ``reference_logits`` (host torch, from a row's token history) matches them bit
for bit.

The ops (``embedding`` with ttnn's signature, ``toy_paged_write``, ``toy_paged_sum``) are added
to a ``FakeTtnn`` with ``register_op``; a real ttnn module has no ``toy_*`` ops.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch

from llmrt.errors import ConfigError
from llmrt.families.base import AttentionMetadata, KVCacheView, ModelConfig

TOY_OPS = ("embedding", "toy_paged_write", "toy_paged_sum")
"""The ops ``install_toy_ops`` registers on a fake ttnn module."""


def _embedding(input_tensor: torch.Tensor, weight: torch.Tensor, **_: Any) -> torch.Tensor:
    """ttnn.embedding: rows of ``weight`` selected by integer ids."""
    return torch.nn.functional.embedding(input_tensor.long(), weight)


def _paged_positions(
    page_table: torch.Tensor, positions: torch.Tensor, *, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(block, offset, mapped)`` of absolute ``positions`` ``[B, N]`` through ``page_table``."""
    width = page_table.shape[1]
    column = torch.div(positions, block_size, rounding_mode="floor")
    inside = (column >= 0) & (column < width)
    block = page_table.long().gather(1, column.clamp(0, width - 1))
    return block.clamp(min=0), positions % block_size, inside & (block >= 0)


def _paged_write(
    cache: torch.Tensor,
    update: torch.Tensor,
    page_table: torch.Tensor,
    start_pos: torch.Tensor,
    seq_lens: torch.Tensor | None = None,
    *,
    block_size: int,
) -> None:
    """Write ``update[b, i]`` at position ``start_pos[b] + i`` for ``i < seq_lens[b]`` (all
    ``i`` without ``seq_lens``), in every KV head; ``-1`` page-table entries skip the write."""
    if update.dim() == 2:
        update = update[:, None]
    batch, steps = update.shape[0], update.shape[1]
    index = torch.arange(steps)[None, :].expand(batch, steps)
    positions = start_pos.long()[:, None] + index
    block, offset, mapped = _paged_positions(page_table, positions, block_size=block_size)
    if seq_lens is not None:
        mapped = mapped & (index < seq_lens.long()[:, None])
    rows, cols = mapped.nonzero(as_tuple=True)
    cache[block[rows, cols], :, offset[rows, cols], :] = update[rows, cols][:, None].to(cache.dtype)


def _paged_sum(
    cache: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor, *, block_size: int
) -> torch.Tensor:
    """``[B, head_dim]``: the sum over KV heads and positions ``< lengths[b]`` of a row's cache."""
    batch = page_table.shape[0]
    positions = torch.arange(page_table.shape[1] * block_size)[None, :].expand(batch, -1)
    block, offset, mapped = _paged_positions(page_table, positions, block_size=block_size)
    mapped = mapped & (positions < lengths.long()[:, None])
    values = cache[block, :, offset, :].to(torch.float32)  # [B, P, heads, head_dim]
    return torch.where(mapped[:, :, None, None], values, 0.0).sum(dim=(1, 2))


def install_toy_ops(ttnn_module: Any) -> None:
    """Register ``TOY_OPS`` on a fake ttnn module (``FakeTtnn.register_op``)."""
    register = getattr(ttnn_module, "register_op", None)
    if register is None:
        raise ConfigError(
            "ttnn_module",
            type(ttnn_module).__name__,
            "the toy model's ops exist only on llmrt.testing.fake_ttnn.FakeTtnn",
        )
    register("embedding", _embedding)
    register("toy_paged_write", _paged_write)
    register("toy_paged_sum", _paged_sum)


@attrs.frozen(kw_only=True)
class ToyModuleConfig:
    """A TTTv2-style module config: what the executor validates inputs against."""

    kind: str
    shape: tuple[int, ...]


@attrs.frozen(kw_only=True, eq=False)
class _BoundKV:
    keys: tuple[Any, ...]
    values: tuple[Any, ...]
    block_size: int


class ToyTtnnModel:
    """The toy model on a borrowed ttnn ``mesh_device``; owns its device weights (``close``).

    ``layer_scales[l]`` is the factor layer ``l`` writes into V (K gets the embedding itself).
    """

    def __init__(
        self,
        *,
        mesh_device: Any,
        ttnn_module: Any,
        vocab_size: int = 32,
        hidden_size: int = 4,
        num_layers: int = 2,
        num_kv_heads: int = 1,
        max_position_embeddings: int = 256,
        seed: int = 0,
    ) -> None:
        self.config = ModelConfig(
            family="toy_ttnn",
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_kv_heads,
            num_kv_heads=num_kv_heads,
            head_dim=hidden_size,
            max_position_embeddings=max_position_embeddings,
            dtype=torch.float32,
        )
        install_toy_ops(ttnn_module)
        self._tt = ttnn_module
        self.borrowed_mesh = mesh_device
        self.layer_scales = tuple(float(layer + 2) for layer in range(num_layers))
        generator = torch.Generator().manual_seed(seed)
        self.embedding_host = torch.randint(
            -3, 4, (vocab_size, hidden_size), generator=generator
        ).to(torch.float32)
        self.w_out_host = torch.randint(-3, 4, (hidden_size, vocab_size), generator=generator).to(
            torch.float32
        )
        self._weights: dict[str, Any] = {
            name: self._upload(value)
            for name, value in (("embedding", self.embedding_host), ("lm_head", self.w_out_host))
        }
        self._kv: _BoundKV | None = None

    def _upload(self, host: torch.Tensor) -> Any:
        tt = self._tt
        return tt.from_torch(
            host,
            dtype=tt.float32,
            layout=tt.ROW_MAJOR_LAYOUT,
            device=self.borrowed_mesh,
            mesh_mapper=tt.replicate_tensor_to_mesh_mapper(self.borrowed_mesh),
        )

    # -- the model protocol --------------------------------------------------------------

    @property
    def supports_batched_prefill_outputs(self) -> bool:
        return True

    def attention_metadata(self) -> AttentionMetadata:
        cfg = self.config
        return AttentionMetadata(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            kv_dtypes=(torch.float32,) * cfg.num_layers,
        )

    def iter_executor_named_modules(self) -> Iterator[tuple[str, ToyModuleConfig]]:
        cfg = self.config
        yield "embedding", ToyModuleConfig(kind="embedding", shape=(cfg.vocab_size, cfg.head_dim))
        for layer in range(cfg.num_layers):
            yield f"layers.{layer}.attention", ToyModuleConfig(kind="paged_sum", shape=())
        yield "lm_head", ToyModuleConfig(kind="matmul", shape=(cfg.head_dim, cfg.vocab_size))

    @property
    def kv_bound(self) -> bool:
        return self._kv is not None

    def set_kv_cache(self, cache: KVCacheView | None) -> None:
        """Validate every layer's K/V (ttnn device tensor on this mesh, shape, float dtype)
        before binding any; ``None`` unbinds. A rejected cache leaves the binding unchanged."""
        if cache is None:
            self._kv = None
            return
        tt = self._tt
        meta = self.attention_metadata()
        block_size = cache.block_size
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError("kv_cache.block_size", block_size, "must be a positive integer")
        keys, values = tuple(cache.keys), tuple(cache.values)
        for field, tensors in (("kv_cache.keys", keys), ("kv_cache.values", values)):
            if len(tensors) != meta.num_layers:
                raise ConfigError(
                    field, len(tensors), f"needs one tensor per layer ({meta.num_layers})"
                )
        floats = (tt.float32, tt.bfloat16, tt.bfloat8_b)
        expected: tuple[int, ...] | None = None
        for layer in range(meta.num_layers):
            for field, tensor in (
                (f"kv_cache.keys[{layer}]", keys[layer]),
                (f"kv_cache.values[{layer}]", values[layer]),
            ):
                if not isinstance(tensor, tt.Tensor):
                    raise ConfigError(field, type(tensor).__name__, "must be a ttnn.Tensor")
                mesh = tensor.device()
                if (
                    tensor.storage_type() != tt.StorageType.DEVICE
                    or mesh is None
                    or mesh.id() != self.borrowed_mesh.id()
                ):
                    raise ConfigError(
                        field, repr(tensor), f"must be on mesh {self.borrowed_mesh.id()}"
                    )
                shape = tuple(int(d) for d in tensor.shape)
                if expected is None:
                    if len(shape) != 4 or shape[0] <= 0:
                        raise ConfigError(field, shape, "must be 4-d with >= 1 block")
                    expected = meta.kv_shape(shape[0], block_size)
                if shape != expected:
                    raise ConfigError(field, shape, f"expected shape {expected}")
                if tensor.dtype not in floats:
                    raise ConfigError(field, tensor.dtype, f"expected one of {floats}")
        self._kv = _BoundKV(keys=keys, values=values, block_size=block_size)

    def _bound(self) -> _BoundKV:
        if self._kv is None:
            raise ConfigError("kv_cache", None, "no KV cache is bound (set_kv_cache)")
        return self._kv

    def prefill_forward(
        self,
        *,
        tokens: Any,
        start_pos: Any,
        seq_lens: Any,
        page_table: Any,
        last_token_index: Any,
    ) -> Any:
        """Write the chunk's K/V, return logits ``[B, vocab]`` of each row's last token."""
        tt, kv = self._tt, self._bound()
        hidden = tt.embedding(tokens, self._weights["embedding"])
        self._write(hidden, page_table=page_table, start_pos=start_pos, seq_lens=seq_lens)
        lengths = tt.add(tt.add(start_pos, last_token_index), 1)
        return self._logits(page_table=page_table, lengths=lengths, block_size=kv.block_size)

    def decode_forward(self, *, tokens: Any, positions: Any, page_table: Any) -> Any:
        """Write each row's K/V at ``positions``, return logits ``[B, vocab]``."""
        tt, kv = self._tt, self._bound()
        hidden = tt.embedding(tokens, self._weights["embedding"])
        self._write(hidden, page_table=page_table, start_pos=positions, seq_lens=None)
        lengths = tt.add(positions, 1)
        return self._logits(page_table=page_table, lengths=lengths, block_size=kv.block_size)

    def _write(self, hidden: Any, *, page_table: Any, start_pos: Any, seq_lens: Any) -> None:
        tt, kv = self._tt, self._bound()
        for key, value, scale in zip(kv.keys, kv.values, self.layer_scales, strict=True):
            for cache, update in ((key, hidden), (value, tt.multiply(hidden, scale))):
                tt.toy_paged_write(
                    cache, update, page_table, start_pos, seq_lens, block_size=kv.block_size
                )

    def _logits(self, *, page_table: Any, lengths: Any, block_size: int) -> Any:
        tt, kv = self._tt, self._bound()
        total = None
        for cache in (*kv.keys, *kv.values):
            part = tt.toy_paged_sum(cache, page_table, lengths, block_size=block_size)
            total = part if total is None else tt.add(total, part)
        return tt.matmul(total, self._weights["lm_head"])

    # -- host reference and lifetime -----------------------------------------------------

    def reference_logits(self, history: Sequence[int]) -> torch.Tensor:
        """``[vocab]`` float32 logits of a row whose positions ``0..len-1`` hold ``history``."""
        ids = torch.tensor(list(history), dtype=torch.int64)
        factor = self.config.num_kv_heads * sum(1.0 + s for s in self.layer_scales)
        return (self.embedding_host[ids].sum(dim=0) * factor) @ self.w_out_host

    def close(self) -> None:
        """Deallocate the model's device weights; idempotent."""
        while self._weights:
            name, tensor = next(iter(self._weights.items()))
            self._tt.deallocate(tensor)
            del self._weights[name]
