"""The decoder families on a ttnn mesh: ``TtnnDecoder`` behind the runtime's model protocol.

Why: a recipe pairing a decoder family (Llama with any fixed-table RoPE scaling, Mistral
with its sliding window, Qwen2 with or without windowed layers, Qwen3 with its q/k norms,
Granite with its multipliers, Helium with GPT-J RoPE pairs, SmolLM2, ...) with
``device.backend: ttnn`` builds this model on the lane's mesh, so prefill, paged KV fill and
update, paged decode attention, sampling and traces run through the same runtime as on the
CPU. ``ttnn_parts_refusal`` names the first part of a
``DecoderSpec`` the ttnn path does not compute (experts, learned positions, partial rotary,
q/k norms over the whole projection, LayerNorm, ...); ``build_ttnn_model`` refuses it
before any weight moves.

Prefill follows tt_transformers' generator: one user at a time, the chunk's start position
a host integer (``chunk_start_idx``), not a device tensor. The model declares
``prefill_from_host = True`` and the runtime passes ``chunk_start`` (the start every row of
the step shares; ttnn's wave rules keep cached rows out of waves) and ``active_rows``
(padding rows after them are not computed; their logits repeat row 0's). The last token
of each row is picked on the device (``ttnn.embedding`` over the row's hidden states with
``last_token_index``), so only those rows pass through the LM head.

Weights are converted once, at build: projections and the LM head to ``weight_dtype``
(``bfloat8_b``, tt_transformers' choice for its decoders' matmul weights, or ``bfloat16``),
norms to bfloat16, the embedding to bfloat16 row-major; with a ``cache_dir`` the converted
matmul weights are kept there by ``ttnn.as_tensor`` and loaded by later builds.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import attrs
import torch

from llmrt.errors import ConfigError, UnsupportedError
from llmrt.families.base import AttentionMetadata, KVCacheView
from llmrt.families.decoder import TensorNames
from llmrt.families.parts import DecoderSpec, MLPSpec
from llmrt.families.ttnn_decoder import MLP_ACTIVATIONS, TILE, TtnnDecoder, TtnnDecoderConfig
from llmrt.families.ttnn_kv import checked_kv_cache

WEIGHT_DTYPES = ("bfloat8_b", "bfloat16")
KV_DTYPE = torch.bfloat16
"""What the model asks of its KV cache (the recipe's ``kv_cache.dtype`` decides the stored one)."""


def ttnn_parts_refusal(spec: DecoderSpec, names: TensorNames) -> tuple[str, object, str] | None:
    """``(part, value, why)`` for the first part the ttnn decoder lacks (None: it runs)."""
    a = spec.attention
    checks: list[tuple[bool, str, object, str]] = [
        (spec.positions == "rope", "positions", spec.positions, "RoPE only"),
        (len(spec.ropes) == 1, "ropes", len(spec.ropes), "one RoPE variant for every layer"),
        (all(layer.rope in (0, None) for layer in spec.layers), "layers.rope", "...",
         "one RoPE variant (or none: NoPE layers)"),
        (spec.moe is None and not any(layer.moe for layer in spec.layers), "moe", "experts",
         "dense MLPs only"),
        (isinstance(spec.mlp, MLPSpec), "mlp", type(spec.mlp).__name__, "the catalogue's MLP"),
        (a.qk_norm in (None, "head"), "attention.qk_norm", a.qk_norm,
         "q/k norms per head only (not over the whole projection)"),
        (not a.qk_norm_per_head_weights, "attention.qk_norm_per_head_weights", True,
         "one q and one k norm weight shared by the heads"),
        (a.qk_norm is None or (a.qk_norm_spec.kind == "rms" and a.qk_norm_spec.weight),
         "attention.qk_norm_spec.kind", a.qk_norm_spec.kind, "q/k RMSNorm with a weight"),
        (a.softcap is None, "attention.softcap", a.softcap, "no score softcap"),
        (a.clip_qkv is None, "attention.clip_qkv", a.clip_qkv, "no q/k/v clamp"),
        (not a.o_bias, "attention.o_bias", a.o_bias, "no output-projection bias"),
        (a.head_dim % TILE == 0, "attention.head_dim", a.head_dim, f"a multiple of {TILE}"),
        (spec.norm.kind in ("rms", "rms_one_plus") and spec.norm.weight, "norm.kind",
         spec.norm.kind, "RMSNorm with a weight (w or 1 + w)"),
        (spec.residual == "sequential", "residual", spec.residual, "sequential residuals"),
        (spec.attn_norm and spec.mlp_norm, "attn_norm/mlp_norm", False, "pre-norm layers"),
        (not (spec.post_attn_norm or spec.post_mlp_norm), "post_attn_norm/post_mlp_norm", True,
         "no post-norms"),
        (spec.final_norm, "final_norm", False, "a final norm"),
        (spec.final_softcap is None, "final_softcap", spec.final_softcap, "no logit softcap"),
        (not spec.lm_head_bias, "lm_head_bias", True, "no LM-head bias"),
        (not names.qkv_interleaved and not names.transposed, "tensor names",
         "per-head fused q/k/v or transposed",
         "[out, in] weights (q/k/v fused as [q; k; v] rows, or separate)"),
    ]  # fmt: skip
    if isinstance(spec.mlp, MLPSpec):
        mlp = spec.mlp
        checks += [
            (mlp.kind == "gated" and mlp.activation in MLP_ACTIVATIONS, "mlp.activation",
             f"{mlp.kind} {mlp.activation}", f"a gated MLP with one of {MLP_ACTIVATIONS}"),
            (not mlp.bias, "mlp.bias", True, "no MLP biases"),
        ]  # fmt: skip
    if spec.ropes:
        rope = spec.ropes[0]
        checks += [
            (rope.head_dim == a.head_dim, "ropes.head_dim", rope.head_dim,
             f"full rotary width {a.head_dim}"),
        ]  # fmt: skip
        # Every rope kind is a table of angles per position up to max_position_embeddings
        # (yarn's attention factor folded in, longrope's two ranges, dynamic NTK's default
        # angles: it rescales only past the positions the runtime serves), as on the CPU.
    for ok, part, value, why in checks:
        if not ok:
            return part, value, why
    return None


def check_ttnn_parts(spec: DecoderSpec, names: TensorNames, *, family: str) -> None:
    """``UnsupportedError`` naming the first part of ``family``'s model the ttnn decoder lacks."""
    refusal = ttnn_parts_refusal(spec, names)
    if refusal is not None:
        part, value, why = refusal
        raise UnsupportedError(
            f"device.backend=ttnn: family {family}'s model has part {part}={value!r}; the "
            f"ttnn decoder computes {why} (run it with device.backend=torch)"
        )


def decoder_config(spec: DecoderSpec) -> TtnnDecoderConfig:
    """The ``TtnnDecoderConfig`` of a family's parts (``ttnn_parts_refusal`` passed)."""
    a, m = spec.attention, spec.model
    mlp = cast(MLPSpec, spec.mlp)  # ttnn_parts_refusal checked it
    return TtnnDecoderConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads,
        head_dim=a.head_dim,
        intermediate_size=mlp.intermediate_size,
        rms_norm_eps=spec.norm.eps,
        rope=spec.ropes[0],
        max_positions=m.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        attention_scale=a.scale,
        qk_norm_eps=None if a.qk_norm is None else a.qk_norm_spec.eps,
        windows=tuple(layer.window for layer in spec.layers),
        rope_layers=tuple(layer.rope is not None for layer in spec.layers),
        rope_interleaved=a.rope_style == "interleaved",
        embedding_scale=spec.embedding_scale,
        residual_multiplier=spec.residual_multiplier,
        logit_scale=spec.logit_scale,
        mlp_activation=mlp.activation,
        norm_unit_offset=spec.norm.kind == "rms_one_plus",
    )


def canonical_weights(
    spec: DecoderSpec, names: TensorNames, tensors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The family's tensors under the Llama names ``TtnnDecoder`` reads; fused projections
    (Phi-3's ``[q; k; v]`` and ``[gate; up]`` rows) split into their parts on the host."""
    out = {"model.embed_tokens.weight": tensors[names.embed]}
    out["model.norm.weight"] = tensors[names.final_norm + ".weight"]
    if names.lm_head in tensors and not spec.tie_word_embeddings:
        out["lm_head.weight"] = tensors[names.lm_head]
    qk_norms = {"self_attn.q_norm": names.q_norm, "self_attn.k_norm": names.k_norm}
    pairs = {
        **(qk_norms if spec.attention.qk_norm is not None else {}),
        "input_layernorm": names.attn_norm,
        "post_attention_layernorm": names.mlp_norm,
        "self_attn.q_proj": names.q,
        "self_attn.k_proj": names.k,
        "self_attn.v_proj": names.v,
        "self_attn.o_proj": names.o,
        "mlp.gate_proj": names.gate,
        "mlp.up_proj": names.up,
        "mlp.down_proj": names.down,
    }
    a = spec.attention
    fused = {
        names.qkv: (("self_attn.q_proj", a.num_heads), ("self_attn.k_proj", a.num_kv_heads),
                    ("self_attn.v_proj", a.num_kv_heads)),
        names.gate_up: (("mlp.gate_proj", 1), ("mlp.up_proj", 1)),
    }  # fmt: skip
    for i in range(spec.model.num_layers):
        src, dst = names.layer.format(i=i), f"model.layers.{i}."
        for ours, theirs in pairs.items():
            for suffix in (".weight", ".bias"):
                if src + theirs + suffix in tensors:
                    out[dst + ours + suffix] = tensors[src + theirs + suffix]
        for name, parts in fused.items():  # rows split in proportion to the parts' heads
            for suffix in (".weight", ".bias"):
                whole = None if name is None else tensors.get(src + name + suffix)
                if whole is None:
                    continue
                shares = [count for _, count in parts]
                sizes = [len(whole) * share // sum(shares) for share in shares]
                for (ours, _), piece in zip(parts, whole.split(sizes), strict=True):
                    out[dst + ours + suffix] = piece
    return out


@attrs.frozen(kw_only=True, eq=False)
class _BoundKV:
    pairs: tuple[tuple[Any, Any], ...]
    block_size: int


class TtnnCausalLM:
    """A decoder family's model on a borrowed ttnn mesh; owns its device weights (``close``)."""

    prefill_from_host = True
    """The runtime passes ``chunk_start`` and ``active_rows`` to ``prefill_forward``."""

    def __init__(
        self,
        *,
        spec: DecoderSpec,
        names: TensorNames,
        tensors: Mapping[str, torch.Tensor],
        mesh_device: Any,
        ttnn_module: Any,
        weight_dtype: str = "bfloat8_b",
        cache_dir: Path | None = None,
    ) -> None:
        check_ttnn_parts(spec, names, family=spec.model.family)
        if weight_dtype not in WEIGHT_DTYPES:
            raise ConfigError("weight_dtype", weight_dtype, f"must be one of {WEIGHT_DTYPES}")
        m = spec.model
        self.config = attrs.evolve(m, dtype=torch.bfloat16)
        self.decoder_config = decoder_config(spec)
        self._tt = ttnn_module
        self.borrowed_mesh = mesh_device
        self.weight_dtype = weight_dtype
        self._decoder: TtnnDecoder | None = TtnnDecoder(
            tt=ttnn_module,
            mesh=mesh_device,
            config=self.decoder_config,
            weights=canonical_weights(spec, names, tensors),
            weight_dtype=weight_dtype,
            cache_dir=cache_dir,
        )
        tt = ttnn_module
        # Every position as a uint32 id (tt_transformers' rotary indices), sliced per chunk.
        self._positions = tt.from_torch(
            torch.arange(m.max_position_embeddings, dtype=torch.int32),
            dtype=tt.uint32,
            layout=tt.ROW_MAJOR_LAYOUT,
            device=mesh_device,
        )
        self._kv: _BoundKV | None = None

    # -- the model protocol --------------------------------------------------------------

    @property
    def supports_batched_prefill_outputs(self) -> bool:
        return True

    def attention_metadata(self) -> AttentionMetadata:
        c = self.decoder_config
        return AttentionMetadata(
            num_layers=c.num_layers,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            kv_dtypes=(KV_DTYPE,) * c.num_layers,
            tensor_parallel=int(self.borrowed_mesh.get_num_devices()),
        )

    def iter_executor_named_modules(self) -> Iterator[tuple[str, Any]]:
        return iter(())

    @property
    def kv_bound(self) -> bool:
        return self._kv is not None

    def set_kv_cache(self, cache: KVCacheView | None) -> None:
        """Validate every layer's K/V (a tile float ttnn tensor on this mesh, the expected
        shape) before binding any; ``None`` unbinds; a rejected cache changes nothing."""
        if cache is None:
            self._kv = None
            return
        keys, values, block_size = checked_kv_cache(
            self._tt,
            cache,
            meta=self.attention_metadata(),
            mesh_id=self.borrowed_mesh.id(),
            tiles=True,
        )
        self._kv = _BoundKV(pairs=tuple(zip(keys, values, strict=True)), block_size=block_size)

    def _bound(self) -> tuple[TtnnDecoder, _BoundKV]:
        if self._decoder is None:
            raise ConfigError("model", "closed", "the ttnn model's weights were deallocated")
        if self._kv is None:
            raise ConfigError("kv_cache", None, "no KV cache is bound (set_kv_cache)")
        return self._decoder, self._kv

    def prefill_forward(
        self,
        *,
        tokens: Any,
        start_pos: Any,
        seq_lens: Any,
        page_table: Any,
        last_token_index: Any,
        chunk_start: int | None = None,
        active_rows: int | None = None,
    ) -> Any:
        """float32 logits ``[B, vocab]`` of each row's last token; writes the rows' K/V.

        ``start_pos``/``seq_lens`` (device) are not read: ``chunk_start`` (host) is every
        row's start, and tokens past a row's length only write K/V slots the row's later
        tokens overwrite before any query reads them (or ``-1`` pages, skipped)."""
        decoder, kv = self._bound()
        if chunk_start is None or active_rows is None:
            raise ConfigError(
                "prefill_forward",
                "chunk_start/active_rows missing",
                "the ttnn decoder's prefill takes the chunk's start and active rows from the "
                "host (prefill_from_host), as tt_transformers' chunk_start_idx",
            )
        tt = self._tt
        batch, seq = (int(d) for d in tokens.shape)
        if not 0 < active_rows <= batch:
            raise ConfigError("active_rows", active_rows, f"must be in [1, {batch}]")
        end = chunk_start + seq
        if chunk_start < 0 or end > self.decoder_config.max_positions:
            raise ConfigError(
                "chunk_start",
                chunk_start,
                f"positions {chunk_start}..{end - 1} must lie within max_position_embeddings="
                f"{self.decoder_config.max_positions}",
            )
        width = int(page_table.shape[1])
        rope = self._positions[chunk_start:end]
        picked = []
        for row in range(active_rows):
            table = page_table[row : row + 1, :]
            chunk_table = None
            if chunk_start:
                chunk_table = page_table[row : row + 1, chunk_start // kv.block_size : width]
            hidden = decoder.prefill_hidden(
                tokens=tt.reshape(tokens[row : row + 1, :], (seq,)),
                rope_positions=rope,
                page_table=table,
                kv=list(kv.pairs),
                chunk_start=chunk_start,
                chunk_page_table=chunk_table,
            )
            rows = tt.to_layout(hidden, tt.ROW_MAJOR_LAYOUT)
            picked.append(tt.embedding(last_token_index[row : row + 1], rows))
        picked += [picked[0]] * (batch - active_rows)
        last = picked[0] if batch == 1 else tt.concat(picked, 0)
        return decoder.head(tt.to_layout(last, tt.TILE_LAYOUT))

    def decode_forward(self, *, tokens: Any, positions: Any, page_table: Any) -> Any:
        """float32 logits ``[B, vocab]``; writes each row's K/V at ``positions``."""
        decoder, kv = self._bound()
        tt = self._tt
        return decoder.decode(
            tokens=tokens,
            positions=positions,
            rope_positions=tt.typecast(positions, tt.uint32),
            page_table=page_table,
            kv=list(kv.pairs),
        )

    def close(self) -> None:
        """Deallocate the device weights; idempotent."""
        if self._decoder is not None:
            self._decoder.close()
            self._decoder = None
        if self._positions is not None:
            self._tt.deallocate(self._positions)
            self._positions = None
