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

Besides ttnn's own ``embedding`` (UINT32 ids), ``add``, ``multiply``, ``to_layout`` and
``matmul`` (tile inputs), it calls two ops only a ``FakeTtnn`` has, added with ``register_op``:
``toy_paged_write`` and ``toy_paged_sum``; on a real ttnn module ``install_toy_ops`` refuses.

``FAMILY`` registers it as the ``toy_ttnn`` model family (``backends = ("ttnn",)``): a recipe
with ``family: toy_ttnn``, a ``random`` checkpoint of ``model_type: toy_ttnn`` and
``device.backend: ttnn`` builds it through the containers on the lane's mesh, taking its
embedding and LM head from the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from llmrt.errors import ConfigError
from llmrt.families.base import AttentionMetadata, KVCacheView, ModelConfig
from llmrt.families.ttnn_kv import checked_kv_cache

TOY_OPS = ("toy_paged_write", "toy_paged_sum")
"""The ops ``install_toy_ops`` registers on a fake ttnn module."""

MODEL_OPS = ("embedding", "add", "multiply", "to_layout", "matmul", *TOY_OPS)
"""Every ttnn op the toy model's forwards call."""


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
    ``embedding`` ``[vocab, hidden]`` and ``lm_head`` ``[vocab, hidden]`` (Hugging Face
    layout) are the weights; without them, small seeded integers make logits exact.
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
        embedding: torch.Tensor | None = None,
        lm_head: torch.Tensor | None = None,
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
        shape = (vocab_size, hidden_size)
        for name, given in (("embedding", embedding), ("lm_head", lm_head)):
            if given is not None and tuple(given.shape) != shape:
                raise ConfigError(name, tuple(given.shape), f"expected shape {shape}")
        self.embedding_host = (
            torch.randint(-3, 4, shape, generator=generator).to(torch.float32)
            if embedding is None
            else embedding.detach().to(torch.float32)
        )
        head = (
            torch.randint(-3, 4, shape, generator=generator).to(torch.float32)
            if lm_head is None
            else lm_head.detach().to(torch.float32)
        )
        self.w_out_host = head.T.contiguous()
        tt = ttnn_module
        # ttnn.embedding reads row-major weights; matmul needs tile inputs.
        self._weights: dict[str, Any] = {
            "embedding": self._upload(self.embedding_host, tt.ROW_MAJOR_LAYOUT),
            "lm_head": self._upload(self.w_out_host, tt.TILE_LAYOUT),
        }
        self._kv: _BoundKV | None = None

    def _upload(self, host: torch.Tensor, layout: Any) -> Any:
        tt = self._tt
        return tt.from_torch(
            host,
            dtype=tt.float32,
            layout=layout,
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
        keys, values, block_size = checked_kv_cache(
            self._tt,
            cache,
            meta=self.attention_metadata(),
            mesh_id=self.borrowed_mesh.id(),
            tiles=False,
        )
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
        return tt.matmul(tt.to_layout(total, tt.TILE_LAYOUT), self._weights["lm_head"])

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


@attrs.frozen
class ToyTtnnFamily:
    """The ``toy_ttnn`` family: ``ToyTtnnModel`` on the lane's ttnn mesh, from a checkpoint.

    Config keys: ``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
    ``num_key_value_heads`` (default 1), ``max_position_embeddings``. Tensors:
    ``model.embed_tokens.weight`` and ``lm_head.weight``, both ``[vocab, hidden]``.
    """

    name: str = "toy_ttnn"
    model_types: tuple[str, ...] = ("toy_ttnn",)
    backends: tuple[str, ...] = ("ttnn",)

    def model_config(self, hf_config: Mapping[str, Any], *, dtype: torch.dtype) -> ModelConfig:
        kv_heads = _config_int(hf_config, "num_key_value_heads", default=1)
        return ModelConfig(
            family=self.name,
            vocab_size=_config_int(hf_config, "vocab_size"),
            hidden_size=_config_int(hf_config, "hidden_size"),
            num_layers=_config_int(hf_config, "num_hidden_layers"),
            num_heads=kv_heads,
            num_kv_heads=kv_heads,
            head_dim=_config_int(hf_config, "hidden_size"),
            max_position_embeddings=_config_int(hf_config, "max_position_embeddings"),
            dtype=torch.float32,
        )

    def expected_tensors(self, hf_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        shape = (_config_int(hf_config, "vocab_size"), _config_int(hf_config, "hidden_size"))
        return {"model.embed_tokens.weight": shape, "lm_head.weight": shape}

    def optional_tensors(self, hf_config: Mapping[str, Any]) -> frozenset[str]:
        return frozenset()

    def build(
        self,
        *,
        hf_config: Mapping[str, Any],
        tensors: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: Any,
    ) -> ToyTtnnModel:
        """The model on ``device``: the lane's port device, a ``TtnnDevice`` (its mesh)."""
        mesh = getattr(device, "mesh_device", None)
        tt = getattr(device, "ttnn_module", None)
        if mesh is None or tt is None:
            raise ConfigError(
                "device.backend", repr(device), "the toy_ttnn family runs on a ttnn lane device"
            )
        config = self.model_config(hf_config, dtype=dtype)
        return ToyTtnnModel(
            mesh_device=mesh,
            ttnn_module=tt,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            max_position_embeddings=config.max_position_embeddings,
            embedding=tensors["model.embed_tokens.weight"],
            lm_head=tensors["lm_head.weight"],
        )


def _config_int(hf_config: Mapping[str, Any], key: str, *, default: int | None = None) -> int:
    value = hf_config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"model.{key}", value, "must be a positive integer")
    return value


FAMILY = ToyTtnnFamily()
