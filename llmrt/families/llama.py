"""The Llama family: Llama 1-3, SmolLM2, Mistral (full attention) and Qwen2 on paged KV.

RMSNorm, RoPE (default / linear / Llama-3 scaling), grouped-query attention, SwiGLU,
tied or untied embeddings and optional q/k/v (and o/MLP) biases. q/k/v and
gate/up are fused into one matmul each at load.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from llmrt.errors import CheckpointError
from llmrt.families.base import ModelConfig
from llmrt.families.causal_lm import PagedCausalLM
from llmrt.families.hf_family import HFFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.kvbinding import BoundKV
from llmrt.families.layers import FrozenLinear, RMSNorm, frozen_embedding, frozen_linear
from llmrt.families.paged_attention import DecodePlan, PrefillPlan, attend
from llmrt.families.rope import (
    RopeSpec,
    apply_rope,
    inverse_frequencies,
    read_rope,
    rope_cache,
    rope_lookup,
)

MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2")
IGNORED_SUFFIXES: tuple[str, ...] = (".rotary_emb.inv_freq",)
#: RoPE cache rows before a KV cache is bound (binding resizes it to the cache's span).
ROPE_CACHE_START = 4096


@attrs.frozen(kw_only=True)
class LlamaSpec:
    """Architecture of a Llama-style checkpoint, read and validated from its HF config."""

    model: ModelConfig
    model_type: str
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeSpec
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool


def read_spec(hf_config: Mapping[str, Any], *, dtype: torch.dtype) -> LlamaSpec:
    """Validate ``hf_config``; a bad or unsupported field raises ``CheckpointError`` naming it."""
    cfg = HFConfig(raw=hf_config)
    model_type = cfg.check_model_type(MODEL_TYPES) or "llama"
    hidden = cfg.positive_int("hidden_size")
    heads = cfg.positive_int("num_attention_heads")
    kv_heads = cfg.positive_int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise CheckpointError(
            "config.num_key_value_heads",
            f"must divide num_attention_heads={heads}, got {kv_heads}",
        )
    if cfg.has("head_dim"):
        head_dim = cfg.positive_int("head_dim")
    elif hidden % heads:
        raise CheckpointError(
            "config.num_attention_heads",
            f"must divide hidden_size={hidden} when head_dim is absent, got {heads}",
        )
    else:
        head_dim = hidden // heads
    if head_dim % 2:
        raise CheckpointError("config.head_dim", f"must be even for RoPE, got {head_dim}")
    num_layers = cfg.positive_int("num_hidden_layers")
    max_positions = cfg.positive_int("max_position_embeddings")
    _reject_unsupported(
        cfg, model_type=model_type, num_layers=num_layers, max_positions=max_positions
    )
    attention_bias = cfg.flag("attention_bias", False)
    model = ModelConfig(
        family="llama",
        vocab_size=cfg.positive_int("vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        dtype=dtype,
        bos_token_id=cfg.token_id("bos_token_id"),
        eos_token_ids=cfg.token_ids("eos_token_id"),
    )
    return LlamaSpec(
        model=model,
        model_type=model_type,
        intermediate_size=cfg.positive_int("intermediate_size"),
        rms_norm_eps=cfg.positive_float("rms_norm_eps", 1e-6),
        rope=read_rope(cfg, head_dim=head_dim),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=model_type != "qwen2" and attention_bias,
        mlp_bias=cfg.flag("mlp_bias", False),
    )


def _reject_unsupported(
    cfg: HFConfig, *, model_type: str, num_layers: int, max_positions: int
) -> None:
    act = cfg.text("hidden_act", "silu")
    cfg.reject_if(
        "hidden_act",
        present=act not in ("silu", "swish"),
        reason="only silu/swish (SwiGLU) is supported",
    )
    cfg.reject_if(
        "quantization_config",
        present=cfg.has("quantization_config"),
        reason="quantized checkpoints are unsupported",
    )
    layer_types = cfg.raw.get("layer_types")
    cfg.reject_if(
        "layer_types",
        present=layer_types is not None and any(kind != "full_attention" for kind in layer_types),
        reason="only full_attention layers are supported (sliding window is unsupported)",
    )
    window = cfg.raw.get("sliding_window")
    windowed = window is not None and (not isinstance(window, int) or window < max_positions)
    if model_type == "mistral":
        cfg.reject_if(
            "sliding_window",
            present=windowed,
            reason=f"sliding-window attention is unsupported (only null or >= "
            f"max_position_embeddings={max_positions} is accepted)",
        )
    if model_type == "qwen2" and cfg.flag("use_sliding_window", False):
        first_windowed = cfg.raw.get("max_window_layers", 0)
        cfg.reject_if(
            "use_sliding_window",
            present=windowed and isinstance(first_windowed, int) and first_windowed < num_layers,
            reason="sliding-window attention is unsupported",
        )


def expected_tensors(spec: LlamaSpec) -> dict[str, tuple[int, ...]]:
    """HF tensor names -> shapes for ``spec`` (optional ones: ``optional_tensors``)."""
    m = spec.model
    hidden, inter, q_out, kv_out = (
        m.hidden_size,
        spec.intermediate_size,
        m.num_heads * m.head_dim,
        m.num_kv_heads * m.head_dim,
    )
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (m.vocab_size, hidden)}
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        for proj, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            shapes[f"{p}self_attn.{proj}.weight"] = (out, hidden)
            if spec.qkv_bias:
                shapes[f"{p}self_attn.{proj}.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_out)
        if spec.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        for proj, shape in (
            ("gate_proj", (inter, hidden)),
            ("up_proj", (inter, hidden)),
            ("down_proj", (hidden, inter)),
        ):
            shapes[f"{p}mlp.{proj}.weight"] = shape
            if spec.mlp_bias:
                shapes[f"{p}mlp.{proj}.bias"] = (shape[0],)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (m.vocab_size, hidden)
    return shapes


def optional_tensors(spec: LlamaSpec) -> frozenset[str]:
    """Names in ``expected_tensors`` a checkpoint may omit (the tied ``lm_head.weight``)."""
    return frozenset({"lm_head.weight"}) if spec.tie_word_embeddings else frozenset()


class LlamaBlock(nn.Module):
    """One decoder layer: pre-norm GQA attention over paged KV, then pre-norm SwiGLU MLP."""

    def __init__(
        self,
        *,
        input_layernorm: RMSNorm,
        qkv_proj: FrozenLinear,
        o_proj: FrozenLinear,
        post_attention_layernorm: RMSNorm,
        gate_up_proj: FrozenLinear,
        down_proj: FrozenLinear,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        super().__init__()
        self.input_layernorm = input_layernorm
        self.qkv_proj = qkv_proj
        self.o_proj = o_proj
        self.post_attention_layernorm = post_attention_layernorm
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.split_sizes = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)

    def forward(
        self,
        x: torch.Tensor,
        *,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: PrefillPlan | DecodePlan,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """``x`` ``[B, S, hidden]`` -> ``[B, S, hidden]``; writes this step's K/V into the pages."""
        q, k, v = self.qkv_proj(self.input_layernorm(x)).split(self.split_sizes, dim=-1)
        q = apply_rope(q.unflatten(-1, (self.num_heads, self.head_dim)), cos=cos, sin=sin)
        k = apply_rope(k.unflatten(-1, (self.num_kv_heads, self.head_dim)), cos=cos, sin=sin)
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        attn = attend(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, plan=plan, scale=self.scale)
        x = x + self.o_proj(attn)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class LlamaBackbone(nn.Module):
    """Token embedding, decoder layers, final RMSNorm and LM head of a Llama-family model."""

    def __init__(
        self,
        *,
        spec: LlamaSpec,
        embed_tokens: nn.Embedding,
        layers: list[LlamaBlock],
        norm: RMSNorm,
        lm_head: FrozenLinear,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.inv_freq: torch.Tensor
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        inv_freq = inverse_frequencies(spec.rope).to(embed_tokens.weight.device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.reserve_positions(ROPE_CACHE_START)

    def reserve_positions(self, count: int) -> None:
        """Size the RoPE cache for positions below ``count`` (at most the model's maximum).

        Sized from the bound KV cache, not ``max_position_embeddings`` alone: a long-context
        checkpoint would otherwise hold tables for positions no KV cache can reach.
        """
        rows = max(1, min(count, self.spec.model.max_position_embeddings))
        if hasattr(self, "rope_cos") and self.rope_cos.shape[0] == rows:
            return
        cos, sin = rope_cache(
            inv_freq=self.inv_freq, max_positions=rows, dtype=self.embed_tokens.weight.dtype
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def device(self) -> torch.device:
        """The device the weights live on."""
        return self.embed_tokens.weight.device

    def executor_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """Embedding, each layer, final norm, LM head (execution order)."""
        yield "embed_tokens", self.embed_tokens
        for i, layer in enumerate(self.layers):
            yield f"layers.{i}", layer
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
        """``[B, S]`` tokens at absolute ``positions`` -> ``[B, S, hidden]``."""
        ids = tokens.to(self.device()).clamp(0, self.spec.model.vocab_size - 1)
        hidden = self.embed_tokens(ids)
        cos, sin = rope_lookup(
            cos_cache=self.rope_cos, sin_cache=self.rope_sin, positions=positions
        )
        for i, layer in enumerate(self.layers):
            hidden = layer(
                hidden, cos=cos, sin=sin, plan=plan, k_cache=kv.keys[i], v_cache=kv.values[i]
            )
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head, as float32."""
        logits: torch.Tensor = self.lm_head(self.norm(hidden))
        return logits.float()


def build_model(
    *, spec: LlamaSpec, tensors: Mapping[str, torch.Tensor], device: torch.device
) -> PagedCausalLM:
    """Assemble the model from validated HF tensors, fusing q/k/v and gate/up."""
    dtype = spec.model.dtype

    def take(*names: str) -> torch.Tensor:
        parts = [tensors[name].to(device=device, dtype=dtype) for name in names]
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=0)

    def maybe(flag: bool, *names: str) -> torch.Tensor | None:
        return take(*names) if flag else None

    m = spec.model
    eps = spec.rms_norm_eps
    layers = []
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        qkv = [f"{p}self_attn.{x}_proj" for x in ("q", "k", "v")]
        gate_up = [f"{p}mlp.gate_proj", f"{p}mlp.up_proj"]
        layers.append(
            LlamaBlock(
                input_layernorm=RMSNorm(weight=take(p + "input_layernorm.weight"), eps=eps),
                qkv_proj=frozen_linear(
                    weight=take(*(n + ".weight" for n in qkv)),
                    bias=maybe(spec.qkv_bias, *(n + ".bias" for n in qkv)),
                ),
                o_proj=frozen_linear(
                    weight=take(p + "self_attn.o_proj.weight"),
                    bias=maybe(spec.o_bias, p + "self_attn.o_proj.bias"),
                ),
                post_attention_layernorm=RMSNorm(
                    weight=take(p + "post_attention_layernorm.weight"), eps=eps
                ),
                gate_up_proj=frozen_linear(
                    weight=take(*(n + ".weight" for n in gate_up)),
                    bias=maybe(spec.mlp_bias, *(n + ".bias" for n in gate_up)),
                ),
                down_proj=frozen_linear(
                    weight=take(p + "mlp.down_proj.weight"),
                    bias=maybe(spec.mlp_bias, p + "mlp.down_proj.bias"),
                ),
                num_heads=m.num_heads,
                num_kv_heads=m.num_kv_heads,
                head_dim=m.head_dim,
            )
        )
    embed = frozen_embedding(weight=take("model.embed_tokens.weight"))
    lm_head = frozen_linear(
        weight=embed.weight if spec.tie_word_embeddings else take("lm_head.weight")
    )
    backbone = LlamaBackbone(
        spec=spec,
        embed_tokens=embed,
        layers=layers,
        norm=RMSNorm(weight=take("model.norm.weight"), eps=eps),
        lm_head=lm_head,
    )
    return PagedCausalLM(config=spec.model, backbone=backbone)


#: The family the registry serves under ``llama``.
FAMILY = HFFamily(
    name="llama",
    model_types=MODEL_TYPES,
    read_spec=read_spec,
    spec_tensors=expected_tensors,
    spec_optional_tensors=optional_tensors,
    build_model=build_model,
    ignored_suffixes=IGNORED_SUFFIXES,
)
