"""The GPT-2 family on paged KV: learned positions, LayerNorm, MHA, GELU MLP, biases.

HF GPT-2 stores its projections as ``Conv1D`` weights ``[in, out]``; they are
transposed to ``[out, in]`` once at load so every matmul is a plain linear.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
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
from llmrt.families.layers import (
    FrozenLinear,
    frozen_embedding,
    frozen_layer_norm,
    frozen_linear,
)
from llmrt.families.paged_attention import DecodePlan, PrefillPlan, attend

MODEL_TYPES: tuple[str, ...] = ("gpt2",)
IGNORED_SUFFIXES: tuple[str, ...] = (".attn.bias", ".attn.masked_bias")
GELU_APPROXIMATIONS: dict[str, str] = {
    "gelu_new": "tanh",
    "gelu_pytorch_tanh": "tanh",
    "gelu": "none",
}


@attrs.frozen(kw_only=True)
class GPT2Spec:
    """Architecture of a GPT-2 checkpoint, read and validated from its HF config."""

    model: ModelConfig
    inner_size: int
    layer_norm_eps: float
    gelu_approximate: str
    attn_scale: float
    tie_word_embeddings: bool


def read_spec(hf_config: Mapping[str, Any], *, dtype: torch.dtype) -> GPT2Spec:
    """Validate ``hf_config``; a bad or unsupported field raises ``CheckpointError`` naming it."""
    cfg = HFConfig(raw=hf_config)
    cfg.check_model_type(MODEL_TYPES)
    hidden = cfg.positive_int("n_embd")
    heads = cfg.positive_int("n_head")
    if hidden % heads:
        raise CheckpointError("config.n_head", f"must divide n_embd={hidden}, got {heads}")
    activation = cfg.text("activation_function", "gelu_new")
    cfg.reject_if(
        "activation_function",
        present=activation not in GELU_APPROXIMATIONS,
        reason=f"unsupported activation (supported: {', '.join(GELU_APPROXIMATIONS)})",
    )
    cfg.reject_if(
        "scale_attn_by_inverse_layer_idx",
        present=cfg.flag("scale_attn_by_inverse_layer_idx", False),
        reason="per-layer attention scaling is unsupported",
    )
    cfg.reject_if(
        "add_cross_attention",
        present=cfg.flag("add_cross_attention", False),
        reason="cross-attention is unsupported",
    )
    cfg.reject_if(
        "quantization_config",
        present=cfg.has("quantization_config"),
        reason="quantized checkpoints are unsupported",
    )
    head_dim = hidden // heads
    model = ModelConfig(
        family="gpt2",
        vocab_size=cfg.positive_int("vocab_size"),
        hidden_size=hidden,
        num_layers=cfg.positive_int("n_layer"),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=cfg.positive_int("n_positions"),
        dtype=dtype,
        bos_token_id=cfg.token_id("bos_token_id"),
        eos_token_ids=cfg.token_ids("eos_token_id"),
    )
    return GPT2Spec(
        model=model,
        inner_size=cfg.positive_int("n_inner", 4 * hidden),
        layer_norm_eps=cfg.positive_float("layer_norm_epsilon", 1e-5),
        gelu_approximate=GELU_APPROXIMATIONS[activation],
        attn_scale=head_dim**-0.5 if cfg.flag("scale_attn_weights", True) else 1.0,
        tie_word_embeddings=cfg.flag("tie_word_embeddings", True),
    )


def expected_tensors(spec: GPT2Spec) -> dict[str, tuple[int, ...]]:
    """HF tensor names -> shapes (``Conv1D`` weights are ``[in, out]``)."""
    m = spec.model
    hidden, inner = m.hidden_size, spec.inner_size
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (m.vocab_size, hidden),
        "transformer.wpe.weight": (m.max_position_embeddings, hidden),
    }
    for i in range(m.num_layers):
        p = f"transformer.h.{i}."
        shapes.update(
            {
                p + "ln_1.weight": (hidden,),
                p + "ln_1.bias": (hidden,),
                p + "attn.c_attn.weight": (hidden, 3 * hidden),
                p + "attn.c_attn.bias": (3 * hidden,),
                p + "attn.c_proj.weight": (hidden, hidden),
                p + "attn.c_proj.bias": (hidden,),
                p + "ln_2.weight": (hidden,),
                p + "ln_2.bias": (hidden,),
                p + "mlp.c_fc.weight": (hidden, inner),
                p + "mlp.c_fc.bias": (inner,),
                p + "mlp.c_proj.weight": (inner, hidden),
                p + "mlp.c_proj.bias": (hidden,),
            }
        )
    shapes["transformer.ln_f.weight"] = (hidden,)
    shapes["transformer.ln_f.bias"] = (hidden,)
    shapes["lm_head.weight"] = (m.vocab_size, hidden)
    return shapes


def optional_tensors(spec: GPT2Spec) -> frozenset[str]:
    """Names in ``expected_tensors`` a checkpoint may omit (the tied ``lm_head.weight``)."""
    return frozenset({"lm_head.weight"}) if spec.tie_word_embeddings else frozenset()


def canonical_names(
    tensors: Mapping[str, torch.Tensor], *, expected: Collection[str]
) -> dict[str, torch.Tensor]:
    """Map bare ``GPT2Model`` names (``h.0.attn...``, as in the original hub files) to the
    ``transformer.``-prefixed ones in ``expected``; every other name passes through."""
    renamed: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        prefixed = f"transformer.{name}"
        key = prefixed if name not in expected and prefixed in expected else name
        if key in renamed:
            raise CheckpointError(name, f"duplicates {key} (both prefixed and bare names given)")
        renamed[key] = tensor
    return renamed


class GPT2Block(nn.Module):
    """One GPT-2 layer: pre-LN multi-head attention over paged KV, then pre-LN GELU MLP."""

    def __init__(
        self,
        *,
        ln_1: nn.LayerNorm,
        c_attn: FrozenLinear,
        attn_proj: FrozenLinear,
        ln_2: nn.LayerNorm,
        c_fc: FrozenLinear,
        mlp_proj: FrozenLinear,
        num_heads: int,
        head_dim: int,
        attn_scale: float,
        gelu_approximate: str,
    ) -> None:
        super().__init__()
        self.ln_1 = ln_1
        self.c_attn = c_attn
        self.attn_proj = attn_proj
        self.ln_2 = ln_2
        self.c_fc = c_fc
        self.mlp_proj = mlp_proj
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.attn_scale = attn_scale
        self.gelu_approximate = gelu_approximate

    def forward(
        self,
        x: torch.Tensor,
        *,
        plan: PrefillPlan | DecodePlan,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """``x`` ``[B, S, hidden]`` -> ``[B, S, hidden]``; writes this step's K/V into the pages."""
        heads = (self.num_heads, self.head_dim)
        q, k, v = (t.unflatten(-1, heads) for t in self.c_attn(self.ln_1(x)).chunk(3, dim=-1))
        attn = attend(
            q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, plan=plan, scale=self.attn_scale
        )
        x = x + self.attn_proj(attn)
        inner = F.gelu(self.c_fc(self.ln_2(x)), approximate=self.gelu_approximate)
        return x + self.mlp_proj(inner)


class GPT2Backbone(nn.Module):
    """Token and position embeddings, GPT-2 layers, final LayerNorm and (tied) LM head."""

    def __init__(
        self,
        *,
        spec: GPT2Spec,
        wte: nn.Embedding,
        wpe: nn.Embedding,
        h: list[GPT2Block],
        ln_f: nn.LayerNorm,
        lm_head: FrozenLinear,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.wte = wte
        self.wpe = wpe
        self.h = nn.ModuleList(h)
        self.ln_f = ln_f
        self.lm_head = lm_head

    def device(self) -> torch.device:
        """The device the weights live on."""
        return self.wte.weight.device

    def reserve_positions(self, count: int) -> None:
        """Nothing to size: positions are a learned embedding of fixed length."""

    def executor_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """Embeddings, each layer, final norm, LM head (execution order)."""
        yield "wte", self.wte
        yield "wpe", self.wpe
        for i, layer in enumerate(self.h):
            yield f"h.{i}", layer
        yield "ln_f", self.ln_f
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

        Positions past the table (padding only; the runtime rejects real ones) are clamped.
        """
        m = self.spec.model
        device = self.device()
        ids = tokens.to(device).clamp(0, m.vocab_size - 1)
        where = positions.to(device).clamp(0, m.max_position_embeddings - 1)
        hidden = self.wte(ids) + self.wpe(where)
        for i, layer in enumerate(self.h):
            hidden = layer(hidden, plan=plan, k_cache=kv.keys[i], v_cache=kv.values[i])
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final LayerNorm + LM head, as float32."""
        logits: torch.Tensor = self.lm_head(self.ln_f(hidden))
        return logits.float()


def build_model(
    *, spec: GPT2Spec, tensors: Mapping[str, torch.Tensor], device: torch.device
) -> PagedCausalLM:
    """Assemble the model from validated HF tensors, transposing ``Conv1D`` weights."""
    dtype = spec.model.dtype

    def take(name: str) -> torch.Tensor:
        return tensors[name].to(device=device, dtype=dtype).contiguous()

    def conv1d(prefix: str) -> FrozenLinear:
        weight = tensors[prefix + ".weight"].to(device=device, dtype=dtype).t().contiguous()
        return frozen_linear(weight=weight, bias=take(prefix + ".bias"))

    def layer_norm(prefix: str) -> nn.LayerNorm:
        return frozen_layer_norm(
            weight=take(prefix + ".weight"), bias=take(prefix + ".bias"), eps=spec.layer_norm_eps
        )

    m = spec.model
    blocks = [
        GPT2Block(
            ln_1=layer_norm(f"transformer.h.{i}.ln_1"),
            c_attn=conv1d(f"transformer.h.{i}.attn.c_attn"),
            attn_proj=conv1d(f"transformer.h.{i}.attn.c_proj"),
            ln_2=layer_norm(f"transformer.h.{i}.ln_2"),
            c_fc=conv1d(f"transformer.h.{i}.mlp.c_fc"),
            mlp_proj=conv1d(f"transformer.h.{i}.mlp.c_proj"),
            num_heads=m.num_heads,
            head_dim=m.head_dim,
            attn_scale=spec.attn_scale,
            gelu_approximate=spec.gelu_approximate,
        )
        for i in range(m.num_layers)
    ]
    wte = frozen_embedding(weight=take("transformer.wte.weight"))
    lm_head = frozen_linear(
        weight=wte.weight if spec.tie_word_embeddings else take("lm_head.weight")
    )
    backbone = GPT2Backbone(
        spec=spec,
        wte=wte,
        wpe=frozen_embedding(weight=take("transformer.wpe.weight")),
        h=blocks,
        ln_f=layer_norm("transformer.ln_f"),
        lm_head=lm_head,
    )
    return PagedCausalLM(config=m, backbone=backbone)


#: The family the registry serves under ``gpt2``.
FAMILY = HFFamily(
    name="gpt2",
    model_types=MODEL_TYPES,
    read_spec=read_spec,
    spec_tensors=expected_tensors,
    spec_optional_tensors=optional_tensors,
    build_model=build_model,
    ignored_suffixes=IGNORED_SUFFIXES,
    rename=canonical_names,
)
