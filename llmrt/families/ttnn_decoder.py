"""A Llama-style decoder on ttnn ops, laid out the way tt-metal's ``tt_transformers`` does it.

Why: the runtime's traces, mesh lanes and device sampling exist for Tenstorrent chips; this
is the decoder (GQA; RoPE with ``rope_theta`` and any fixed-table scaling: linear, llama3,
yarn with its attention factor folded into cos/sin, longrope; optional q/k/v biases as Qwen2
has; Qwen3's per-head q/k RMSNorm before RoPE, as tt_transformers' ``q_norm``/``k_norm``;
per-layer sliding windows, passed to ttnn's SDPA ops as ``sliding_window_size``; Granite's
embedding, residual and logit multipliers; Gemma's ``1 + weight`` RMSNorms, scaled
embeddings and GELU (tanh) MLP; a tied or separate LM head) computed with ttnn ops
only, so it runs on a chip or on llmrt's ttnn
emulator unchanged. Weights are converted once from Hugging Face tensors: projections and
the LM head to ``weight_dtype`` (``bfloat8_b`` as tt_transformers' performance setting, or
``bfloat16``) in tile layout as ``[in, out]``, norms and biases to bfloat16, the embedding
to bfloat16 row-major. q/k projection rows are permuted per head from Hugging Face's
half-split rotary layout to interleaved pairs (tt_transformers' ``reverse_permute``; a
checkpoint whose rows already pair channels GPT-J style, as Helium's, is loaded as it is), so
``ttnn.experimental.rotary_embedding_llama`` rotates them with its pair-swapping
transformation matrix; attention scores are unchanged by that permutation, and q/k norm
weights (one ``head_dim`` vector each) are permuted the same way.

``prefill`` takes one row's chunk (from position 0, or after cached blocks; its start is a
host integer, as tt_transformers' ``chunk_start_idx``) and ``decode`` a batch of rows over
the paged KV cache (``[blocks, kv_heads, block_size, head_dim]``, ``-1`` page-table entries
skip a row). ``llmrt.families.ttnn_model`` puts it behind the runtime's model protocol for
the decoder families.

Tensor parallelism across the mesh's chips (a lane's submesh; every chip of it), as
tt_transformers lays out a 1xN mesh (N300, T3K, a Galaxy row): q/k/v, gate and up weights
are column-sharded (``ShardTensorToMesh`` on the output dimension: each chip computes
``num_heads / N`` query heads, ``num_kv_heads / N`` KV heads and ``intermediate / N`` MLP
columns), the output and down projections row-sharded (each chip's partial sum), combined
by ``reduce_scatter`` then ``all_gather`` (tt_transformers' all-reduce on such a mesh); the
LM head is column-sharded over the vocabulary (zero-padded, as tt_transformers' LM head
pads to its ``padded_vocab_size``, to whole tiles on every chip when the vocabulary does
not split so) and its logits all-gathered, then cut back to the vocabulary. Each chip's KV
cache holds its ``num_kv_heads / N`` heads, as the vLLM TT plugin allocates it. With fewer
KV heads than chips (N a multiple of them: 2 KV heads on a T3K's 8 chips) each chip holds
one KV head, the one its query heads read: every KV head's k/v projection rows (and bias)
are replicated on the ``N / num_kv_heads`` chips of its query group before the column
split, as tt-metal's models replicate KV heads when ``n_kv_heads < num_devices`` and as the
vLLM TT plugin sizes the cache (``num_kv_heads // min(N, num_kv_heads)`` = 1). Norms, the
embedding, RoPE tables and the residual stream are replicated. Heads, MLP width and hidden
size must divide by N, KV heads divide by N or divide N
(``tensor_parallel_refusal`` names the first that does not).

A lane of several mesh rows (a Galaxy's 4x8 as one lane, 2x4 on the emulator) is split the
same way over all N of its chips in device order (row-major, as ``ShardTensorToMesh``
places the shards); its collectives run per mesh axis, since ttnn's 1-D fabric needs a
``cluster_axis`` on a 2-D mesh: an all-reduce is a ``reduce_scatter`` along the rows, then
along the columns, and the ``all_gather``s back in reverse order, the logits' gather along
the rows, then the columns. (tt_transformers' Galaxy path instead splits each weight over
both axes with ``ShardTensor2dMesh`` and distributes its norms; that layout is not built.)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from llmrt.errors import ConfigError
from llmrt.families.hfconfig import HFConfig
from llmrt.families.rope import RopeSpec, read_rope
from llmrt.families.rope import rope_tables as spec_rope_tables

TILE = 32
MLP_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


@attrs.frozen(kw_only=True)
class TtnnDecoderConfig:
    """The geometry a Llama-style checkpoint declares (``config.json`` names)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeSpec
    max_positions: int
    tie_word_embeddings: bool
    attention_scale: float | None = None
    """Scores' scale (None: ``head_dim ** -0.5``)."""
    qk_norm_eps: float | None = None
    """Per-head RMSNorm of q and k before RoPE with this epsilon (Qwen3; None: no q/k norm)."""
    windows: tuple[int | None, ...] = ()
    """Each layer's sliding window (None: full attention; empty: no layer has one)."""
    rope_layers: tuple[bool, ...] = ()
    """Whether each layer rotates q and k (False: a NoPE layer, SmolLM3's every fourth;
    empty: every layer rotates)."""
    rope_interleaved: bool = False
    """The checkpoint's q/k rows pair channels ``(2i, 2i + 1)`` (GPT-J style) already."""
    embedding_scale: float = 1.0
    """Multiplies the embedded tokens (Granite's ``embedding_multiplier``)."""
    residual_multiplier: float = 1.0
    """Multiplies each attention and MLP output before the residual add (Granite)."""
    logit_scale: float = 1.0
    """Multiplies the logits (Granite: ``1 / logits_scaling``)."""
    mlp_activation: str = "silu"
    """The gated MLP's activation: ``silu``, ``gelu`` (erf) or ``gelu_tanh`` (Gemma)."""
    norm_unit_offset: bool = False
    """RMSNorms scale by ``1 + weight`` (Gemma's): the one is added to the weights at load,
    as tt_transformers' ``add_unit_offset``."""

    def __attrs_post_init__(self) -> None:
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ConfigError(
                "mlp_activation", self.mlp_activation, f"must be one of {MLP_ACTIVATIONS}"
            )

        for field in ("windows", "rope_layers"):
            per_layer = getattr(self, field)
            if per_layer and len(per_layer) != self.num_layers:
                raise ConfigError(
                    field, len(per_layer), f"needs one entry per layer ({self.num_layers})"
                )
        for window in self.windows:
            if window is not None and (isinstance(window, bool) or window <= 0):
                raise ConfigError("windows", window, "a sliding window must be a positive int")

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (None: it attends to every earlier position)."""
        return self.windows[layer] if self.windows else None

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> TtnnDecoderConfig:
        """A Llama-style ``config.json`` (its ``rope_scaling`` read as the families read it)."""
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = int(hf.get("head_dim") or hidden // heads)
        max_positions = int(hf.get("max_position_embeddings", 2048))
        rope = read_rope(HFConfig(raw=hf), head_dim=head_dim, max_positions=max_positions)
        if rope.head_dim != head_dim:
            raise ConfigError(
                "partial_rotary_factor", rope.head_dim / head_dim, "the ttnn decoder rotates all"
            )
        if head_dim % TILE:
            raise ConfigError("head_dim", head_dim, f"must be a multiple of the {TILE}-wide tile")
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(hf["intermediate_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_positions=max_positions,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )


def tensor_parallel_refusal(config: TtnnDecoderConfig, devices: int) -> tuple[str, int] | None:
    """``(field, value)`` of the first dimension that does not split over ``devices`` chips
    (KV heads fewer than the chips are replicated when they divide the chips)."""
    kv = config.num_kv_heads
    if (kv % devices) if kv >= devices else (devices % kv):
        return "num_key_value_heads", kv
    for field, value in (
        ("num_attention_heads", config.num_heads),
        ("intermediate_size", config.intermediate_size),
        ("hidden_size", config.hidden_size),
    ):
        if value % devices:
            return field, value
    return None


def check_tensor_parallel(config: TtnnDecoderConfig, devices: int) -> None:
    """``ConfigError`` naming the first dimension a ``devices``-chip lane cannot split."""
    refusal = tensor_parallel_refusal(config, devices)
    if refusal is not None:
        field, value = refusal
        raise ConfigError(
            field,
            value,
            f"tensor-parallel layers over the lane's {devices} chips need it divisible by "
            f"{devices} (each chip holds 1/{devices})"
            + (
                f", or for KV heads a divisor of {devices} (each replicated)"
                if field == "num_key_value_heads"
                else ""
            )
            + "; use a lane of fewer chips (more lanes or a smaller device.mesh_shape)",
        )


def padded_vocab_size(vocab: int, devices: int) -> int:
    """The LM head's columns over ``devices`` chips: the vocabulary rounded up to whole tiles
    on every chip (itself on one chip, where ttnn pads the last tile)."""
    if devices == 1:
        return vocab
    step = TILE * devices
    return -(-vocab // step) * step


def interleave_rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection (or bias) reordered per head from half-split to interleaved
    rotary pairs: row ``i`` of the first half and row ``i`` of the second become ``2i, 2i+1``."""
    dim = weight.shape[0] // heads
    per_head = weight.reshape(heads, 2, dim // 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape)


def replicate_kv_rows(weight: torch.Tensor, heads: int, copies: int) -> torch.Tensor:
    """Rows of a k/v projection (or bias) with each of its ``heads`` heads' rows repeated
    ``copies`` times in place: split into ``heads * copies`` equal column shards, chip ``d``
    holds head ``d // copies``, the KV head of the query heads chip ``d`` computes."""
    if copies == 1:
        return weight
    per_head = weight.reshape(heads, 1, weight.shape[0] // heads, *weight.shape[1:])
    return per_head.expand(heads, copies, *per_head.shape[2:]).reshape(-1, *weight.shape[1:])


def rotation_matrix() -> torch.Tensor:
    """tt_transformers' transformation matrix: ``x @ m`` turns pairs ``(a, b)`` into ``(-b, a)``."""
    m = torch.zeros(1, 1, TILE, TILE)
    m[..., torch.arange(0, TILE, 2), torch.arange(1, TILE, 2)] = 1.0
    m[..., torch.arange(1, TILE, 2), torch.arange(0, TILE, 2)] = -1.0
    return m


def rope_tables(config: TtnnDecoderConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``[max_positions, head_dim]`` cos and sin (any ``rope_type`` llmrt's RoPE computes,
    as transformers computes the angles), each angle repeated for its interleaved pair."""
    cos, sin = spec_rope_tables(
        config.rope,
        max_positions=config.max_positions,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)


class TtnnDecoder:
    """The decoder's weights on a mesh and its prefill/decode forwards (owns the weights)."""

    def __init__(
        self,
        *,
        tt: Any,
        mesh: Any,
        config: TtnnDecoderConfig,
        weights: Mapping[str, torch.Tensor],
        weight_dtype: str = "bfloat8_b",
        cache_dir: Path | None = None,
    ) -> None:
        """``cache_dir``: where ``ttnn.as_tensor`` keeps the converted matmul weights (one
        file per weight, in conversion order), so a later build loads them instead of
        converting again, as tt_transformers caches its weights; None converts every time."""
        if weight_dtype not in ("bfloat8_b", "bfloat16"):
            raise ConfigError("weight_dtype", weight_dtype, "must be bfloat8_b or bfloat16")
        self._tt, self._mesh, self.config = tt, mesh, config
        self.devices = int(mesh.get_num_devices())
        dims = [int(d) for d in mesh.shape]
        self._grid = (1, self.devices) if len(dims) != 2 else (dims[0], dims[1])
        check_tensor_parallel(config, self.devices)
        self.heads = config.num_heads // self.devices
        self.kv_heads = max(1, config.num_kv_heads // self.devices)
        # Chips holding each KV head: 1 splits them as every other dimension.
        kv_copies = max(1, self.devices // config.num_kv_heads)
        self._dtype = getattr(tt, weight_dtype)
        self._cache_dir = cache_dir
        self._linears = 0
        self._owned: list[Any] = []
        c = config
        self.embedding = self._put(weights["model.embed_tokens.weight"], layout=tt.ROW_MAJOR_LAYOUT)
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            layer = {
                "attn_norm": self._layer_norm(weights[p + "input_layernorm.weight"]),
                "mlp_norm": self._layer_norm(weights[p + "post_attention_layernorm.weight"]),
                "wo": self._linear(weights[p + "self_attn.o_proj.weight"], shard=-2),
                "w1": self._linear(weights[p + "mlp.gate_proj.weight"], shard=-1),
                "w2": self._linear(weights[p + "mlp.down_proj.weight"], shard=-2),
                "w3": self._linear(weights[p + "mlp.up_proj.weight"], shard=-1),
            }
            for name, heads in (("q", c.num_heads), ("k", c.num_kv_heads), ("v", c.num_kv_heads)):
                w = weights[f"{p}self_attn.{name}_proj.weight"]
                b = weights.get(f"{p}self_attn.{name}_proj.bias")
                if name != "v" and not c.rope_interleaved:
                    w = interleave_rotary_rows(w, heads)
                    b = None if b is None else interleave_rotary_rows(b, heads)
                if name != "q":
                    w = replicate_kv_rows(w, heads, kv_copies)
                    b = None if b is None else replicate_kv_rows(b, heads, kv_copies)
                layer[f"w{name}"] = self._linear(w, shard=-1)
                layer[f"b{name}"] = None if b is None else self._norm(b, shard=-1)
            for name in ("q", "k"):  # one head_dim weight, on every chip
                norm = weights[f"{p}self_attn.{name}_norm.weight"] if c.qk_norm_eps else None
                if norm is not None and not c.rope_interleaved:
                    norm = interleave_rotary_rows(norm, 1)
                layer[f"{name}_norm"] = None if norm is None else self._norm(norm)
            self.layers.append(layer)
        self.final_norm = self._layer_norm(weights["model.norm.weight"])
        head = weights.get("lm_head.weight")
        if head is None or c.tie_word_embeddings:
            head = weights["model.embed_tokens.weight"]
        self.padded_vocab = padded_vocab_size(c.vocab_size, self.devices)
        if self.padded_vocab != c.vocab_size:
            head = torch.nn.functional.pad(head, (0, 0, 0, self.padded_vocab - c.vocab_size))
        self.lm_head = self._linear(head, shard=-1)
        cos, sin = rope_tables(c)
        self.cos = self._put(cos, layout=tt.ROW_MAJOR_LAYOUT)
        self.sin = self._put(sin, layout=tt.ROW_MAJOR_LAYOUT)
        self.trans_mat = self._put(rotation_matrix(), layout=tt.TILE_LAYOUT)
        self.scale = c.head_dim**-0.5 if c.attention_scale is None else c.attention_scale

    # -- weights --------------------------------------------------------------------------

    def _mapper(self, shard: int | None) -> Any:
        """Replicated on every chip (None, or one chip), else split along ``shard``."""
        if shard is None or self.devices == 1:
            return None
        return self._tt.ShardTensorToMesh(self._mesh, dim=shard)

    def _put(
        self, host: torch.Tensor, *, layout: Any, dtype: Any = None, shard: int | None = None
    ) -> Any:
        tt = self._tt
        tensor = tt.from_torch(
            host,
            dtype=dtype or tt.bfloat16,
            layout=layout,
            device=self._mesh,
            mesh_mapper=self._mapper(shard),
        )
        self._owned.append(tensor)
        return tensor

    def _linear(self, weight: torch.Tensor, *, shard: int) -> Any:
        """A Hugging Face ``[out, in]`` weight as ttnn's ``[in, out]`` tile tensor, split
        over the chips along ``shard`` (-1: columns, -2: rows)."""
        if self._cache_dir is None:
            return self._put(
                weight.T.contiguous(), layout=self._tt.TILE_LAYOUT, dtype=self._dtype, shard=shard
            )
        tt, self._linears = self._tt, self._linears + 1
        split = "" if self.devices == 1 else f"_tp{self.devices}_dim{shard}"
        tensor = tt.as_tensor(
            weight.T.contiguous(),
            dtype=self._dtype,
            layout=tt.TILE_LAYOUT,
            device=self._mesh,
            mesh_mapper=self._mapper(shard),
            cache_file_name=str(self._cache_dir / f"linear{self._linears:04d}{split}"),
        )
        self._owned.append(tensor)
        return tensor

    def _norm(self, vector: torch.Tensor, *, shard: int | None = None) -> Any:
        return self._put(vector.reshape(1, -1), layout=self._tt.TILE_LAYOUT, shard=shard)

    def _axes(self) -> list[tuple[int | None, Any]]:
        """``(cluster_axis, topology)`` of each mesh axis a collective runs along: the row
        (no axis) on a 1xN lane; on a lane of several rows (a Galaxy's 4x8 as one lane) the
        rows (axis 1), then the columns (axis 0), as ttnn's 1-D fabric needs a
        ``cluster_axis`` on a 2-D mesh. A two-chip axis is a line, a longer one a ring."""
        tt = self._tt
        rows, cols = self._grid

        def topology(size: int) -> Any:
            return tt.Topology.Linear if size == 2 else tt.Topology.Ring

        if rows == 1:
            return [(None, topology(cols))]
        return [(1, topology(cols)), (0, topology(rows))]

    def _all_gather(self, value: Any) -> Any:
        """Every chip's ``value`` joined along the last dimension in device order (row-major
        over a 2-D lane: each row's chips, then the rows), on every chip."""
        tt = self._tt
        for axis, topology in self._axes():
            value = tt.all_gather(
                value, -1, cluster_axis=axis, num_links=1, topology=topology
            )
        return value

    def _layer_norm(self, weight: torch.Tensor) -> Any:
        """A decoder RMSNorm's weight (``1 + weight`` in float32 first for Gemma's norms)."""
        if self.config.norm_unit_offset:
            weight = weight.float() + 1.0
        return self._norm(weight)

    def _all_reduce(self, partial: Any) -> Any:
        """The chips' partial sums added, on every chip: ``reduce_scatter`` then
        ``all_gather`` along the hidden dimension, as tt_transformers composes it on a 1xN
        mesh; on a 2-D lane reduce-scattered along its rows, then its columns, and gathered
        back in the reverse order (one chip: the value itself)."""
        if self.devices == 1:
            return partial
        tt = self._tt
        axes = self._axes()
        for axis, topology in axes:
            partial = tt.reduce_scatter(
                partial, -1, cluster_axis=axis, num_links=1, topology=topology
            )
        for axis, topology in reversed(axes):
            partial = tt.all_gather(
                partial, -1, cluster_axis=axis, num_links=1, topology=topology
            )
        return partial

    def close(self) -> None:
        """Deallocate the device weights; idempotent."""
        while self._owned:
            self._tt.deallocate(self._owned.pop())

    # -- forwards -------------------------------------------------------------------------

    def _embed(self, tokens: Any) -> Any:
        tt = self._tt
        x = tt.to_layout(tt.embedding(tokens, self.embedding), tt.TILE_LAYOUT)
        scale = self.config.embedding_scale
        return x if scale == 1.0 else tt.multiply(x, scale)

    def _residual(self, x: Any, out: Any) -> Any:
        """``x + out`` (``out`` times the residual multiplier first when it is not 1)."""
        tt, multiplier = self._tt, self.config.residual_multiplier
        return tt.add(x, out if multiplier == 1.0 else tt.multiply(out, multiplier))

    def _rope(self, rope_positions: Any) -> tuple[Any, Any]:
        """cos and sin rows of ``rope_positions`` (uint32: ``ttnn.embedding`` ids)."""
        tt = self._tt
        cos = tt.to_layout(tt.embedding(rope_positions, self.cos), tt.TILE_LAYOUT)
        sin = tt.to_layout(tt.embedding(rope_positions, self.sin), tt.TILE_LAYOUT)
        return cos, sin

    def _head_norm(self, heads: Any, layer: Mapping[str, Any], name: str) -> Any:
        """q or k heads (``head_dim`` last) RMS-normalized per head when the model has q/k
        norms (Qwen3), as tt_transformers' ``q_norm``/``k_norm`` before RoPE; else as they are."""
        weight = layer[f"{name}_norm"]
        if weight is None:
            return heads
        return self._tt.rms_norm(heads, epsilon=self.config.qk_norm_eps, weight=weight)

    def _rotate(self, index: int, heads: Any, cos: Any, sin: Any, *, decode: bool) -> Any:
        """q or k heads of layer ``index`` rotated by RoPE (a NoPE layer's as they are)."""
        if self.config.rope_layers and not self.config.rope_layers[index]:
            return heads
        kwargs = {"is_decode_mode": True} if decode else {}
        return self._tt.experimental.rotary_embedding_llama(
            heads, cos, sin, self.trans_mat, **kwargs
        )

    def _window(self, layer: int) -> dict[str, int]:
        """``sliding_window_size`` for the SDPA ops of a windowed layer (none: no keyword)."""
        window = self.config.window(layer)
        return {} if window is None else {"sliding_window_size": window}

    def _project(self, h: Any, layer: Mapping[str, Any], name: str) -> Any:
        bias = layer[f"b{name}"]
        kwargs = {} if bias is None else {"bias": bias}
        return self._tt.linear(h, layer[f"w{name}"], dtype=self._tt.bfloat16, **kwargs)

    def _mlp(self, x: Any, layer: Mapping[str, Any]) -> Any:
        tt = self._tt
        h = tt.rms_norm(x, epsilon=self.config.rms_norm_eps, weight=layer["mlp_norm"])
        activation = self.config.mlp_activation
        if activation == "silu":
            gate = tt.linear(h, layer["w1"], activation="silu", dtype=tt.bfloat16)
        else:  # ttnn.gelu names the GELU; the fused linear's does not
            tanh = activation == "gelu_tanh"
            variant = tt.GeluVariant.Tanh if tanh else tt.GeluVariant.Accurate
            gate = tt.gelu(tt.linear(h, layer["w1"], dtype=tt.bfloat16), variant=variant)
        up = tt.linear(h, layer["w3"], dtype=tt.bfloat16)
        down = tt.linear(tt.multiply(gate, up), layer["w2"], dtype=tt.bfloat16)
        return self._residual(x, self._all_reduce(down))

    def head(self, x: Any) -> Any:
        """float32 logits of hidden rows ``x`` ``[N, hidden]`` (tile): final norm, LM head."""
        return self._logits(x)

    def _logits(self, x: Any) -> Any:
        tt = self._tt
        h = tt.rms_norm(x, epsilon=self.config.rms_norm_eps, weight=self.final_norm)
        logits = tt.linear(h, self.lm_head, dtype=tt.float32)
        if self.config.logit_scale != 1.0:
            logits = tt.multiply(logits, self.config.logit_scale)
        if self.devices == 1:
            return logits
        logits = self._all_gather(logits)
        if self.padded_vocab == self.config.vocab_size:
            return logits
        return logits[:, : self.config.vocab_size]

    def decode(
        self,
        *,
        tokens: Any,
        positions: Any,
        rope_positions: Any,
        page_table: Any,
        kv: list[tuple[Any, Any]],
    ) -> Any:
        """Logits ``[B, vocab]`` of one step: ``tokens`` ``[B]`` (uint32), ``positions``
        ``[B]`` and ``page_table`` ``[B, W]`` (int32; the same positions as uint32 in
        ``rope_positions``, as tt_transformers keeps its rotary indices), ``kv`` each layer's
        (K, V) cache."""
        tt, c = self._tt, self.config
        batch = int(tokens.shape[0])
        x = self._embed(tokens)
        cos, sin = self._rope(rope_positions)
        cos, sin = (tt.reshape(t, (1, batch, 1, c.head_dim)) for t in (cos, sin))
        for index, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv, strict=True)):
            h = tt.rms_norm(x, epsilon=c.rms_norm_eps, weight=layer["attn_norm"])
            q = tt.reshape(self._project(h, layer, "q"), (1, batch, self.heads, c.head_dim))
            k = tt.reshape(self._project(h, layer, "k"), (1, batch, self.kv_heads, c.head_dim))
            v = tt.reshape(self._project(h, layer, "v"), (1, batch, self.kv_heads, c.head_dim))
            q, k = self._head_norm(q, layer, "q"), self._head_norm(k, layer, "k")
            q = self._rotate(index, q, cos, sin, decode=True)
            k = self._rotate(index, k, cos, sin, decode=True)
            for cache, new in ((k_cache, k), (v_cache, v)):
                tt.experimental.paged_update_cache(
                    cache, new, update_idxs_tensor=positions, page_table=page_table
                )
            attn = tt.transformer.paged_scaled_dot_product_attention_decode(
                q,
                k_cache,
                v_cache,
                cur_pos_tensor=positions,
                page_table_tensor=page_table,
                scale=self.scale,
                **self._window(index),
            )
            attn = tt.reshape(attn, (batch, self.heads * c.head_dim))
            x = self._residual(x, self._all_reduce(tt.linear(attn, layer["wo"], dtype=tt.bfloat16)))
            x = self._mlp(x, layer)
        return self._logits(x)

    def prefill(
        self,
        *,
        tokens: Any,
        rope_positions: Any,
        page_table: Any,
        kv: list[tuple[Any, Any]],
        chunk_start: int = 0,
        chunk_page_table: Any = None,
    ) -> Any:
        """Logits ``[S, vocab]`` of one row's chunk (``prefill_hidden``, then ``head``)."""
        return self._logits(
            self.prefill_hidden(
                tokens=tokens,
                rope_positions=rope_positions,
                page_table=page_table,
                kv=kv,
                chunk_start=chunk_start,
                chunk_page_table=chunk_page_table,
            )
        )

    def prefill_hidden(
        self,
        *,
        tokens: Any,
        rope_positions: Any,
        page_table: Any,
        kv: list[tuple[Any, Any]],
        chunk_start: int = 0,
        chunk_page_table: Any = None,
    ) -> Any:
        """Hidden rows ``[S, hidden]`` of one row's chunk at positions ``chunk_start..+S-1``:
        ``tokens`` ``[S]``, ``rope_positions`` those positions (uint32), ``page_table``
        ``[1, W]`` the row's blocks (int32); writes the chunk's K/V.

        A chunk after the first (``chunk_start`` > 0, a multiple of the block size: a cached
        prefix or the next piece of a long prompt) is written through ``chunk_page_table``
        (its own blocks, as tt_transformers passes them to ``paged_fill_cache``) and attends
        to the row's cached positions with ``chunked_scaled_dot_product_attention``."""
        tt, c = self._tt, self.config
        if chunk_start:
            block_size = int(kv[0][0].shape[2])
            if chunk_start % block_size or chunk_page_table is None:
                raise ConfigError(
                    "chunk_start",
                    chunk_start,
                    f"must be a multiple of the block size {block_size}, with chunk_page_table",
                )
        seq = int(tokens.shape[0])
        x = self._embed(tokens)
        cos, sin = self._rope(rope_positions)
        cos, sin = (tt.reshape(t, (1, 1, seq, c.head_dim)) for t in (cos, sin))

        def heads(t: Any, n: int) -> Any:
            return tt.permute(tt.reshape(t, (1, seq, n, c.head_dim)), (0, 2, 1, 3))

        for index, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv, strict=True)):
            h = tt.rms_norm(x, epsilon=c.rms_norm_eps, weight=layer["attn_norm"])
            q = heads(self._project(h, layer, "q"), self.heads)
            k = heads(self._project(h, layer, "k"), self.kv_heads)
            v = heads(self._project(h, layer, "v"), self.kv_heads)
            q, k = self._head_norm(q, layer, "q"), self._head_norm(k, layer, "k")
            q = self._rotate(index, q, cos, sin, decode=False)
            k = self._rotate(index, k, cos, sin, decode=False)
            fill_table = page_table if chunk_page_table is None else chunk_page_table
            tt.experimental.paged_fill_cache(k_cache, k, fill_table, batch_idx=0)
            tt.experimental.paged_fill_cache(v_cache, v, fill_table, batch_idx=0)
            if chunk_start:
                attn = tt.transformer.chunked_scaled_dot_product_attention(
                    q,
                    k_cache,
                    v_cache,
                    page_table,
                    chunk_start,
                    scale=self.scale,
                    **self._window(index),
                )
            else:
                attn = tt.transformer.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.scale, **self._window(index)
                )
            attn = tt.reshape(tt.permute(attn, (0, 2, 1, 3)), (seq, self.heads * c.head_dim))
            x = self._residual(x, self._all_reduce(tt.linear(attn, layer["wo"], dtype=tt.bfloat16)))
            x = self._mlp(x, layer)
        return x
