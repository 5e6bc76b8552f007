"""The one decoder every family builds: parts from ``llmrt.families.parts``, weights by
``TensorNames``, attention over the paged KV cache (``paged_attention.attend``).

Every matmul goes through the linear factory (``layers.frozen_linear``), so whatever
weight format or kernel it serves applies to every part. q/k/v and gate/up are fused
into one matmul each at load.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import attrs
import torch
from torch import nn

from llmrt.errors import ConfigError
from llmrt.families.causal_lm import PagedCausalLM
from llmrt.families.decoder_layers import (
    MLP,
    Attention,
    DecoderLayer,
    MoE,
    Norm,
)
from llmrt.families.fused_decode import FusedDecode, NotFusable, fused_step_allowed
from llmrt.families.kvbinding import BoundKV
from llmrt.families.layers import (
    Embedding,
    Linear,
    Weight,
    bind_weight,
    frozen_embedding,
    frozen_linear,
)
from llmrt.families.paged_attention import DecodePlan, PrefillPlan
from llmrt.families.parts import (
    CustomPart,
    DecoderSpec,
    MLPSpec,
    MoESpec,
    NormSpec,
    TensorInit,
)
from llmrt.families.rope import inverse_frequencies, rope_lookup, rope_tables

#: RoPE cache rows before a KV cache is bound (binding resizes it to the cache's span).
ROPE_CACHE_START = 4096

__all__ = ["TensorInit"]


@attrs.frozen(kw_only=True)
class TensorNames:
    """Where a family's checkpoint keeps each part's weights (Hugging Face names).

    ``layer`` prefixes the per-layer names (``{i}``: layer index); norm and linear names
    are prefixes that take ``.weight``/``.bias``. ``qkv``/``gate_up`` name fused
    projections (None: separate ones); ``qkv_interleaved`` means the fused rows are
    ``[q, k, v]`` per head (GPT-NeoX); ``transposed`` means ``[in, out]`` (Conv1D)
    weights. ``q_norm``/``k_norm`` contain ``{h}`` when every head's norm weight is its own
    tensor (without ``{h}``, per-head weights are one ``[heads, head_dim]`` tensor, Cohere's).
    ``lm_head`` names the head's weight; its bias (``DecoderSpec.lm_head_bias``) is the same
    name ending in ``.bias``.
    """

    embed: str = "model.embed_tokens.weight"
    positions: str = "model.embed_positions.weight"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head.weight"
    layer: str = "model.layers.{i}."
    attn_norm: str = "input_layernorm"
    post_attn_norm: str = "post_attention_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    post_mlp_norm: str = "post_feedforward_layernorm"
    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    o: str = "self_attn.o_proj"
    qkv: str | None = None
    qkv_interleaved: bool = False
    q_norm: str = "self_attn.q_norm"
    k_norm: str = "self_attn.k_norm"
    gate: str = "mlp.gate_proj"
    up: str = "mlp.up_proj"
    down: str = "mlp.down_proj"
    gate_up: str | None = None
    transposed: bool = False
    router: str = "mlp.gate"
    experts_gate_up: str = "mlp.experts.gate_up_proj"
    experts_down: str = "mlp.experts.down_proj"
    shared_gate: str = "mlp.shared_expert.gate_proj"
    shared_up: str = "mlp.shared_expert.up_proj"
    shared_down: str = "mlp.shared_expert.down_proj"
    shared_expert_gate: str = "mlp.shared_expert_gate"


@attrs.frozen
class TensorPlan:
    """Every tensor a spec needs: shape and how a random checkpoint initialises it."""

    shapes: dict[str, tuple[int, ...]]
    init: dict[str, TensorInit]
    optional: frozenset[str]


def tensor_plan(spec: DecoderSpec, names: TensorNames) -> TensorPlan:
    """The checkpoint tensors ``spec`` reads under ``names``, with shapes and init."""
    m, a = spec.model, spec.attention
    hidden = m.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    init: dict[str, TensorInit] = {}

    def add(name: str, shape: tuple[int, ...], how: TensorInit = "normal") -> None:
        shapes[name] = shape
        init[name] = how

    def linear(prefix: str, out: int, inp: int, bias: bool) -> None:
        add(prefix + ".weight", (inp, out) if names.transposed else (out, inp))
        if bias:
            add(prefix + ".bias", (out,), "zeros")

    def norm(prefix: str, width: int, part: NormSpec, rows: int | None = None) -> None:
        shape = (width,) if rows is None else (rows, width)
        if part.weight:
            add(prefix + ".weight", shape, "zeros" if part.kind.endswith("one_plus") else "ones")
        if part.bias:
            add(prefix + ".bias", shape, "zeros")

    add(names.embed, (m.vocab_size, hidden))
    if spec.positions == "learned":
        add(names.positions, (m.max_position_embeddings, hidden))
    q_out, kv_out = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    for i, layer in enumerate(spec.layers):
        p = names.layer.format(i=i)
        for slot in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm"):
            if getattr(spec, slot):
                norm(p + getattr(names, slot), hidden, spec.norm)
        if spec.attention_part is not None:
            for name, (shape, how) in spec.attention_part.tensors(prefix=p, hidden=hidden).items():
                add(name, tuple(shape), how)
        elif names.qkv is not None:
            linear(p + names.qkv, q_out + 2 * kv_out, hidden, a.qkv_bias)
        else:
            linear(p + names.q, q_out, hidden, a.qkv_bias)
            linear(p + names.k, kv_out, hidden, a.qkv_bias)
            linear(p + names.v, kv_out, hidden, a.qkv_bias)
        if spec.attention_part is None:
            linear(p + names.o, hidden, q_out, a.o_bias)
        if a.qk_norm is not None:
            for template, heads in ((names.q_norm, a.num_heads), (names.k_norm, a.num_kv_heads)):
                if a.qk_norm == "proj":
                    norm(p + template, heads * a.head_dim, a.qk_norm_spec)
                elif a.qk_norm_per_head_weights and "{h}" not in template:
                    norm(p + template, a.head_dim, a.qk_norm_spec, rows=heads)
                elif a.qk_norm_per_head_weights:
                    for h in range(heads):
                        norm(p + template.format(h=h), a.head_dim, a.qk_norm_spec)
                else:
                    norm(p + template, a.head_dim, a.qk_norm_spec)
        if layer.moe:
            moe = spec.moe
            assert moe is not None
            e, inter = moe.num_experts, moe.intermediate_size
            add(p + names.router + ".weight", (e, hidden))
            add(p + names.experts_gate_up, (e, 2 * inter, hidden))
            add(p + names.experts_down, (e, hidden, inter))
            if moe.shared_intermediate_size is not None:
                shared = moe.shared_intermediate_size
                linear(p + names.shared_gate, shared, hidden, False)
                linear(p + names.shared_up, shared, hidden, False)
                linear(p + names.shared_down, hidden, shared, False)
                if moe.shared_gate:
                    add(p + names.shared_expert_gate + ".weight", (1, hidden))
        elif isinstance(spec.mlp, CustomPart):
            for name, (shape, how) in spec.mlp.tensors(prefix=p, hidden=hidden).items():
                add(name, tuple(shape), how)
        else:
            mlp = spec.mlp
            assert mlp is not None
            inter = mlp.intermediate_size
            if mlp.kind == "gated" and names.gate_up is not None:
                linear(p + names.gate_up, 2 * inter, hidden, mlp.bias)
            elif mlp.kind == "gated":
                linear(p + names.gate, inter, hidden, mlp.bias)
                linear(p + names.up, inter, hidden, mlp.bias)
            else:
                linear(p + names.up, inter, hidden, mlp.bias)
            linear(p + names.down, hidden, inter, mlp.bias)
    if spec.final_norm:
        norm(names.final_norm, hidden, spec.norm)
    add(names.lm_head, (m.vocab_size, hidden))
    if spec.lm_head_bias:
        add(lm_head_bias_name(names), (m.vocab_size,), "zeros")
    optional = frozenset({names.lm_head}) if spec.tie_word_embeddings else frozenset()
    return TensorPlan(shapes=shapes, init=init, optional=optional)


def lm_head_bias_name(names: TensorNames) -> str:
    """The LM head's bias: its weight's name ending in ``.bias``."""
    return names.lm_head.removesuffix(".weight") + ".bias"


def rope_pair_order(head_dim: int, rotary: int) -> torch.Tensor:
    """Channel order that turns GPT-J's interleaved RoPE pairs (2i, 2i + 1) of the first
    ``rotary`` channels into the ``neox`` pairs (i, i + rotary / 2); the rest stay put.

    q and k rows (and their biases and q/k norm weights) loaded in this order give the same
    attention scores under the ``neox`` rotation as the checkpoint under interleaved RoPE:
    a dot product does not change when both sides' channels are permuted alike.
    """
    pairs = torch.arange(rotary).view(rotary // 2, 2).t().reshape(-1)
    return torch.cat([pairs, torch.arange(rotary, head_dim)])


class DecoderBackbone(nn.Module):
    """Embeddings, decoder layers, final norm and LM head of any ``DecoderSpec``."""

    def __init__(
        self,
        *,
        spec: DecoderSpec,
        embed_tokens: Embedding,
        embed_positions: Embedding | None,
        layers: list[DecoderLayer],
        norm: Norm | None,
        lm_head: Linear,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = embed_tokens
        self.embed_positions = embed_positions
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.inv_freq: torch.Tensor
        if spec.ropes:
            inv_freq = inverse_frequencies(spec.ropes[0]).to(embed_tokens.weight.device)
            self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._rope_rows = 0
        self.reserve_positions(ROPE_CACHE_START)
        #: Whether CPU decode steps may run the fused layer op (``device.fused_decode``).
        self.fused_decode = True
        self._fused: FusedDecode | None = None
        self._not_fused: str | None = None
        #: The fused plan ``CausalLM.decode_forward`` may call straight (``step_bound``) while
        #: it holds the model's KV binding: set by a fused step whose logits need no scaling.
        self.decode_fast: FusedDecode | None = None

    def fused_decode_status(self) -> str | None:
        """None when CPU decode steps run fused (after the first), else why they do not."""
        if not self.fused_decode:
            return "disabled"
        self._fused_plan()
        return self._not_fused

    def forget_fused_decode(self) -> None:
        """Drop the fused op arguments (rebuilt on next use) after layers were replaced."""
        self.release_fused_cache()
        self._fused = None
        self._not_fused = None

    def release_fused_cache(self) -> None:
        """Make the fused op let go of the KV caches and RoPE tables it borrowed (the KV
        cache was unbound or replaced, the tables resized); the next fused step binds again."""
        self.decode_fast = None
        fused = getattr(self, "_fused", None)  # reserve_positions runs before __init__ sets it
        if fused is not None:
            fused.release()

    def _fused_plan(self) -> FusedDecode | None:
        """The fused op arguments, built on first use (after any weight-format change)."""
        if self._fused is None and self._not_fused is None:
            try:
                self._fused = FusedDecode.build(self)
            except NotFusable as exc:
                self._not_fused = str(exc)
        return self._fused

    def _rope_names(self, index: int) -> tuple[str, str]:
        return (
            ("rope_cos", "rope_sin") if index == 0 else (f"rope_cos_{index}", f"rope_sin_{index}")
        )

    def reserve_positions(self, count: int) -> None:
        """Size the RoPE caches for positions below ``count`` (at most the model's maximum).

        Sized from the bound KV cache, not ``max_position_embeddings`` alone: a long-context
        checkpoint would otherwise hold tables for positions no KV cache can reach.
        """
        rows = max(1, min(count, self.spec.model.max_position_embeddings))
        if rows == self._rope_rows:
            return
        weight = self.embed_tokens.weight
        for index, rope in enumerate(self.spec.ropes):
            cos, sin = rope_tables(
                rope, max_positions=rows, dtype=weight.dtype, device=weight.device
            )
            cos_name, sin_name = self._rope_names(index)
            self.register_buffer(cos_name, cos, persistent=False)
            self.register_buffer(sin_name, sin, persistent=False)
        self._rope_rows = rows
        self.release_fused_cache()

    def device(self) -> torch.device:
        """The device the weights live on."""
        return self.embed_tokens.weight.device

    def executor_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """Embeddings, each layer, final norm, LM head (execution order)."""
        yield "embed_tokens", self.embed_tokens
        if self.embed_positions is not None:
            yield "embed_positions", self.embed_positions
        for i, layer in enumerate(self.layers):
            yield f"layers.{i}", layer
        if self.norm is not None:
            yield "norm", self.norm
        yield "lm_head", self.lm_head

    def hidden_states(
        self,
        *,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        plan: PrefillPlan | DecodePlan,
        kv: BoundKV,
    ) -> torch.Tensor:
        """``[B, S]`` tokens at absolute ``positions`` -> ``[B, S, hidden]``.

        Positions past a learned table (padding only; the runtime rejects real ones) clamp.
        """
        hidden, ropes = self._embed(tokens=tokens, positions=positions)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, ropes=ropes, plan=plan, k_cache=kv.keys[i], v_cache=kv.values[i])
        return hidden

    def _embed(
        self, *, tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Token (and learned position) embeddings, and each RoPE variant's cos/sin rows."""
        m = self.spec.model
        device = self.device()
        hidden = self.embed_tokens(tokens.to(device).clamp(0, m.vocab_size - 1))
        if self.spec.embedding_scale != 1.0:
            hidden = hidden * torch.tensor(self.spec.embedding_scale, dtype=hidden.dtype)
        if self.embed_positions is not None:
            where = positions.to(device).clamp(0, m.max_position_embeddings - 1)
            hidden = hidden + self.embed_positions(where)
        ropes = [
            rope_lookup(cos_cache=cos, sin_cache=sin, positions=positions)
            for cos, sin in self._rope_caches()
        ]
        return hidden, ropes

    def _rope_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each RoPE variant's cos/sin caches ``[positions, rotary_dim / 2]``."""
        return [
            (getattr(self, cos_name), getattr(self, sin_name))
            for cos_name, sin_name in map(self._rope_names, range(len(self.spec.ropes)))
        ]

    def decode_fused(
        self,
        *,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        page_table: torch.Tensor,
        kv: BoundKV,
    ) -> torch.Tensor | None:
        """One decode step (one token per row) as one ``FusedDecode.step`` call: float32 logits
        ``[B, vocab]``, or None when this step cannot take it (the caller then plans it for
        the torch ops). It needs no write plan or mask: the op resolves both per row."""
        rows = int(tokens.shape[0])
        if not self.fused_decode or rows == 0:
            return None
        # Checked first: under torch.compile it returns before the plan (a script object a
        # precompiled step's guards could not serialize) is touched.
        if not fused_step_allowed(device=self.device(), dtype=self.spec.model.dtype, kv=kv):
            return None
        fused = self._fused_plan()
        if fused is None or rows >= fused.max_rows:
            return None
        logits = fused.step(
            tokens=tokens,
            positions=positions,
            page_table=page_table,
            ropes=self._rope_caches(),
            kv=kv,
        )
        if self.spec.logit_scale == 1.0 and self.spec.final_softcap is None:
            self.decode_fast = fused
        return self._scaled_logits(logits)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head (scaled, soft-capped), as float32."""
        if self.norm is not None:
            hidden = self.norm(hidden)
        return self._scaled_logits(self.lm_head(hidden))

    def _scaled_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's output times the logit scale, soft-capped (where the model has them)."""
        if self.spec.logit_scale != 1.0:
            logits = logits * self.spec.logit_scale
        if self.spec.final_softcap is not None:
            cap = self.spec.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


def build_decoder(
    *,
    spec: DecoderSpec,
    names: TensorNames,
    tensors: Mapping[str, Weight],
    device: torch.device,
) -> PagedCausalLM:
    """Assemble the model from validated checkpoint tensors named by ``names``.

    Linear and embedding weights kept in ggml blocks (``QuantizedWeight``) stay quantized
    where rows are used as stored; anything transposed or regrouped is dequantized first.
    """
    dtype = spec.model.dtype
    a = spec.attention

    def weight(*tensor_names: str) -> Weight:
        return bind_weight([tensors[n] for n in tensor_names], device=device, dtype=dtype)

    def take(*tensor_names: str, transpose: bool = False) -> torch.Tensor:
        bound = weight(*tensor_names)
        dense = bound if isinstance(bound, torch.Tensor) else bound.dequantize()
        if transpose:
            return torch.cat([dense_part.t() for dense_part in _rows(tensor_names, dense)], 0)
        return dense

    def _rows(tensor_names: tuple[str, ...], dense: torch.Tensor) -> list[torch.Tensor]:
        sizes = [int(tensors[n].shape[0]) for n in tensor_names]
        return list(dense.split(sizes, dim=0))

    def linear(*prefixes: str, bias: bool, dense: bool = False) -> Linear:
        names_w = tuple(p + ".weight" for p in prefixes)
        w = (
            take(*names_w, transpose=True)
            if names.transposed
            else (take(*names_w) if dense else weight(*names_w))
        )
        return frozen_linear(
            weight=w,
            bias=take(*(p + ".bias" for p in prefixes)) if bias else None,
        )

    def norm(prefix: str, part: NormSpec, order: torch.Tensor | None = None) -> Norm:
        def read(name: str) -> torch.Tensor:
            tensor = take(name)
            return tensor if order is None else tensor[..., order].contiguous()

        return Norm(
            spec=part,
            weight=read(prefix + ".weight") if part.weight else None,
            bias=read(prefix + ".bias") if part.bias else None,
        )

    #: Interleaved RoPE: q/k channels (rows, biases, norm weights) in the neox pair order.
    interleaved = a.rope_style == "interleaved" and spec.positions == "rope"
    channel_order = rope_pair_order(a.head_dim, spec.ropes[0].head_dim) if interleaved else None
    if interleaved and any(r.head_dim != spec.ropes[0].head_dim for r in spec.ropes):
        raise ConfigError("attention.rope_style", "interleaved", "needs one rotary width")

    def head_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
        """``t``'s leading dim (``heads * head_dim``) in ``channel_order`` per head."""
        assert channel_order is not None
        per_head = t.reshape(heads, a.head_dim, *t.shape[1:])
        return per_head[:, channel_order].reshape(t.shape).contiguous()

    def qk_norm(prefix: str, template: str, heads: int) -> Norm | None:
        if a.qk_norm is None:
            return None
        if a.qk_norm == "proj" and channel_order is not None:
            width = heads * a.head_dim
            order = (torch.arange(width).view(heads, a.head_dim)[:, channel_order]).reshape(-1)
            return norm(prefix + template, a.qk_norm_spec, order)
        if a.qk_norm_per_head_weights and "{h}" not in template:
            return norm(prefix + template, a.qk_norm_spec, channel_order)
        return _per_head_or_shared(prefix, template, heads)

    def _per_head_or_shared(prefix: str, template: str, heads: int) -> Norm:
        if a.qk_norm_per_head_weights:
            rows = [
                norm(prefix + template.format(h=h), a.qk_norm_spec, channel_order)
                for h in range(heads)
            ]
            return Norm(
                spec=a.qk_norm_spec,
                weight=torch.stack([r.weight.data for r in rows if r.weight is not None])
                if a.qk_norm_spec.weight
                else None,
                bias=torch.stack([r.bias.data for r in rows if r.bias is not None])
                if a.qk_norm_spec.bias
                else None,
            )
        return norm(prefix + template, a.qk_norm_spec, channel_order)

    def fused_qkv(prefix: str) -> Linear:
        if channel_order is not None:
            if names.qkv is not None or names.transposed:
                raise ConfigError(
                    "attention.rope_style", "interleaved", "needs separate [out, in] q/k/v tensors"
                )

            def rows(suffix: str) -> torch.Tensor:
                q, k, v = (take(prefix + n + suffix) for n in (names.q, names.k, names.v))
                return torch.cat([head_rows(q, a.num_heads), head_rows(k, a.num_kv_heads), v])

            bias = rows(".bias") if a.qkv_bias else None
            return frozen_linear(weight=rows(".weight"), bias=bias)
        if names.qkv is None:
            return linear(prefix + names.q, prefix + names.k, prefix + names.v, bias=a.qkv_bias)
        if not names.qkv_interleaved:
            return linear(prefix + names.qkv, bias=a.qkv_bias)
        fused = linear(prefix + names.qkv, bias=a.qkv_bias, dense=True)
        assert isinstance(fused.weight, torch.Tensor)

        def regroup(t: torch.Tensor) -> torch.Tensor:
            per_head = t.reshape(a.num_heads, 3, a.head_dim, *t.shape[1:])
            return per_head.transpose(0, 1).reshape(t.shape).contiguous()

        bias = None if fused.bias is None else regroup(fused.bias.data)
        return frozen_linear(weight=regroup(fused.weight.data), bias=bias)

    def dense(prefix: str, mlp: MLPSpec) -> MLP:
        if mlp.kind == "gated":
            if names.gate_up is not None:
                up = linear(prefix + names.gate_up, bias=mlp.bias)
            else:
                up = linear(prefix + names.gate, prefix + names.up, bias=mlp.bias)
        else:
            up = linear(prefix + names.up, bias=mlp.bias)
        down = linear(prefix + names.down, bias=mlp.bias)
        return MLP(activation=mlp.activation, gated=mlp.kind == "gated", up=up, down=down)

    def mixture(prefix: str, moe: MoESpec) -> MoE:
        gate_up = take(prefix + names.experts_gate_up)
        down = take(prefix + names.experts_down)
        experts = [
            MLP(
                activation=moe.activation,
                gated=True,
                up=frozen_linear(weight=gate_up[e].contiguous()),
                down=frozen_linear(weight=down[e].contiguous()),
            )
            for e in range(moe.num_experts)
        ]
        shared = shared_gate = None
        if moe.shared_intermediate_size is not None:
            shared = MLP(
                activation=moe.activation,
                gated=True,
                up=linear(prefix + names.shared_gate, prefix + names.shared_up, bias=False),
                down=linear(prefix + names.shared_down, bias=False),
            )
            if moe.shared_gate:
                shared_gate = linear(prefix + names.shared_expert_gate, bias=False)
        return MoE(
            spec=moe,
            router=linear(prefix + names.router, bias=False),
            experts=experts,
            shared=shared,
            shared_gate=shared_gate,
        )

    layers = []
    for i, layer in enumerate(spec.layers):
        p = names.layer.format(i=i)
        norms = {
            slot: norm(p + getattr(names, slot), spec.norm) if getattr(spec, slot) else None
            for slot in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")
        }
        attention: nn.Module
        if spec.attention_part is not None:
            attention = spec.attention_part.build(
                prefix=p,
                linear=lambda *prefixes, bias=False: linear(*prefixes, bias=bias),
                take=take,
                window=layer.window,
            )
        else:
            attention = Attention(
                spec=a,
                qkv=fused_qkv(p),
                o=linear(p + names.o, bias=a.o_bias),
                q_norm=qk_norm(p, names.q_norm, a.num_heads),
                k_norm=qk_norm(p, names.k_norm, a.num_kv_heads),
                window=layer.window,
            )
        if layer.moe:
            assert spec.moe is not None
            mlp: nn.Module = mixture(p, spec.moe)
        elif isinstance(spec.mlp, CustomPart):
            mlp = spec.mlp.build(
                prefix=p,
                linear=lambda *prefixes, bias=False: linear(*prefixes, bias=bias),
                take=take,
            )
        else:
            assert spec.mlp is not None
            mlp = dense(p, spec.mlp)
        layers.append(
            DecoderLayer(
                parallel=spec.residual == "parallel",
                attention=attention,
                mlp=mlp,
                norms=norms,
                rope=layer.rope if spec.positions == "rope" else None,
                residual_multiplier=spec.residual_multiplier,
            )
        )
    embed = frozen_embedding(weight=weight(names.embed))
    positions = None
    if spec.positions == "learned":
        positions = frozen_embedding(weight=take(names.positions).contiguous())
    lm_head = frozen_linear(
        weight=embed.weight if spec.tie_word_embeddings else weight(names.lm_head),
        bias=take(lm_head_bias_name(names)) if spec.lm_head_bias else None,
    )
    backbone = DecoderBackbone(
        spec=spec,
        embed_tokens=embed,
        embed_positions=positions,
        layers=layers,
        norm=norm(names.final_norm, spec.norm) if spec.final_norm else None,
        lm_head=lm_head,
    )
    return PagedCausalLM(config=spec.model, backbone=backbone)
