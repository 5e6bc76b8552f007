"""The parts decoder's layer modules: norms, the (gated) MLP, mixture-of-experts, attention
over paged KV, and one decoder layer in the spec's residual layout.

Kept apart from the backbone (``decoder``) so the fused decode step (``fused_decode``) reads
these modules without importing the backbone that builds it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from llmrt.families.forms import activation_form, norm_form
from llmrt.families.layers import (
    Linear,
    QuantizedLinear,
    native_mlp_activation,
    native_rms_norm,
    native_rms_norm_usable,
)
from llmrt.families.paged_attention import DecodePlan, PrefillPlan, attend, host_sync_allowed
from llmrt.families.parts import (
    Activation,
    AttentionSpec,
    MoESpec,
    NormSpec,
)
from llmrt.families.rope import apply_rope


class Norm(nn.Module):
    """RMSNorm / ``(1 + w)`` RMSNorm / LayerNorm (``w``, ``1 + w`` or no weight) or a
    registered kind (``forms.register_norm``) over the last dim, in float32 like HF.

    ``weight`` may carry leading dims (one weight row per head) that broadcast over ``x``.
    """

    def __init__(
        self, *, spec: NormSpec, weight: torch.Tensor | None, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.kind = spec.kind
        self.eps = spec.eps
        self.weight = None if weight is None else nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._form = norm_form(spec.kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = (x.shape[-1],)
        weight: torch.Tensor | None = self.weight
        if self._form is not None:
            return self._form(x, weight, self.bias, self.eps)
        if self.kind in ("layer", "layer_one_plus"):
            if weight is not None and self.kind == "layer_one_plus":
                weight = weight + 1.0
            if weight is None or weight.dim() == 1:
                return F.layer_norm(x, width, weight, self.bias, self.eps)
            out = F.layer_norm(x, width, None, None, self.eps) * weight
            return out if self.bias is None else out + self.bias
        assert weight is not None  # NormSpec: RMS kinds have a weight
        if (
            self.kind == "rms"
            and x.dtype == weight.dtype == torch.float32
            and weight.shape == width
        ):
            # One op instead of two passes: torch's kernel multiplies the normalised value by
            # the weight last, as below, so the result is bit-equal (checked by a test). On
            # the CPU the native op does the same in one pass per row, rows split across
            # threads (torch's took ~0.7 ms per 1000 SmolLM2 rows, on one thread).
            if native_rms_norm_usable(x, weight):
                return native_rms_norm(x, weight, self.eps)
            return F.rms_norm(x, width, weight=weight, eps=self.eps)
        normed = F.rms_norm(x.float(), width, eps=self.eps)
        if self.kind == "rms_one_plus":
            return (normed * (1.0 + weight.float())).to(x.dtype)
        return weight * normed.to(x.dtype)


def activate(x: torch.Tensor, kind: Activation) -> torch.Tensor:
    """The activation part ``kind`` (built in or registered) applied to ``x``."""
    return activation_form(kind)(x)


class MLP(nn.Module):
    """Gated (``gate_up`` fused) or plain MLP.

    A SiLU MLP over a block-quantized linear on the CPU (eager) takes its activation in one
    C++ pass (``native_mlp_activation``) from the up GEMM's output, in the dtype it was
    computed in, to the down GEMM's input dtype: with bfloat16 GEMMs torch took four passes
    (to float32, activation, product, to bfloat16) with the same two roundings. Only SiLU
    has the vector path (the others ran 7-9x slower than torch's), and the check is made per
    call because ``apply_weight_format`` swaps the linears in after the build.
    """

    def __init__(self, *, activation: Activation, gated: bool, up: Linear, down: Linear) -> None:
        super().__init__()
        self.activation = activation
        self.gated = gated
        self.up = up
        self.down = down
        #: False keeps the torch path (tests compare the two).
        self.allow_native = True

    def _native(self, x: torch.Tensor) -> bool:
        # The kernels are loaded when either linear is block-quantized (float-only models
        # must run where they cannot be built).
        return (
            self.allow_native
            and self.activation == "silu"
            and x.device.type == "cpu"
            and (isinstance(self.up, QuantizedLinear) or isinstance(self.down, QuantizedLinear))
            and not torch.compiler.is_compiling()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._native(x):
            rows = x.numel() // x.shape[-1]
            act = native_mlp_activation(
                self.up.forward_raw(x),
                activation=self.activation,
                gated=self.gated,
                dtype=self.down.gemm_input_dtype(rows),
            )
            out: torch.Tensor = self.down.forward_raw(act).to(x.dtype)
            return out
        if self.gated:
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.down(activate(gate, self.activation) * up)
        return self.down(activate(self.up(x), self.activation))


class MoE(nn.Module):
    """Top-k routed gated experts (+ optional shared expert), one linear pair per expert.

    Eagerly only the tokens routed to an expert run through it; where host reads are not
    allowed (compiled or captured steps) every expert runs on every token and unrouted
    tokens get weight zero, which keeps shapes static and the result the same.
    """

    def __init__(
        self,
        *,
        spec: MoESpec,
        router: Linear,
        experts: list[MLP],
        shared: MLP | None,
        shared_gate: Linear | None,
    ) -> None:
        super().__init__()
        self.top_k = spec.top_k
        self.normalize = spec.routing == "softmax_topk_normalized"
        self.router = router
        self.experts = nn.ModuleList(experts)
        self.shared = shared
        self.shared_gate = shared_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(flat).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(flat)
        sparse = host_sync_allowed(flat.device)
        for e, expert in enumerate(self.experts):
            hit = chosen == e
            if sparse:
                tokens, slot = torch.where(hit)
                if tokens.numel() == 0:
                    continue
                contribution = expert(flat.index_select(0, tokens)) * weights[tokens, slot, None]
                out.index_add_(0, tokens, contribution)
            else:
                weight = (weights * hit).sum(dim=-1, keepdim=True)
                out = out + expert(flat) * weight
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        return out.view_as(x)


class Attention(nn.Module):
    """Fused-qkv grouped-query attention with the ``AttentionSpec`` options."""

    def __init__(
        self,
        *,
        spec: AttentionSpec,
        qkv: Linear,
        o: Linear,
        q_norm: Norm | None,
        k_norm: Norm | None,
        window: int | None,
    ) -> None:
        super().__init__()
        self.qkv = qkv
        self.o = o
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.norm_over_proj = spec.qk_norm == "proj"
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.scale = spec.scale
        self.softcap = spec.softcap
        self.clip_qkv = spec.clip_qkv
        self.window = window
        kv = spec.num_kv_heads * spec.head_dim
        self.split_sizes = (spec.num_heads * spec.head_dim, kv, kv)
        #: Causal attention among a prefill's own tokens, and RoPE, by llmrt's C++ kernels
        #: (``device.attention_kernel``; ``select_attention_kernel`` sets it).
        self.native_causal = False

    def forward(
        self,
        x: torch.Tensor,
        *,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        plan: PrefillPlan | DecodePlan,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        qkv = self.qkv(x)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        if self.norm_over_proj and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if not self.norm_over_proj and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q = apply_rope(q, cos=rope[0], sin=rope[1], native=self.native_causal)
            k = apply_rope(k, cos=rope[0], sin=rope[1], native=self.native_causal)
        out = attend(
            q=q,
            k=k,
            v=v,
            k_cache=k_cache,
            v_cache=v_cache,
            plan=plan,
            scale=self.scale,
            window=self.window,
            softcap=self.softcap,
            native_causal=self.native_causal,
        )
        return self.o(out)


class DecoderLayer(nn.Module):
    """One layer: attention and MLP (or MoE) in the spec's residual layout."""

    def __init__(
        self,
        *,
        parallel: bool,
        attention: nn.Module,
        mlp: nn.Module,
        norms: Mapping[str, Norm | None],
        rope: int | None,
        residual_multiplier: float,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.attention = attention
        self.mlp = mlp
        self.attn_norm = norms.get("attn_norm")
        self.post_attn_norm = norms.get("post_attn_norm")
        self.mlp_norm = norms.get("mlp_norm")
        self.post_mlp_norm = norms.get("post_mlp_norm")
        self.rope = rope
        self.residual_multiplier = residual_multiplier

    def forward(
        self,
        x: torch.Tensor,
        *,
        ropes: list[tuple[torch.Tensor, torch.Tensor]],
        plan: PrefillPlan | DecodePlan,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """``x`` ``[B, S, hidden]`` -> ``[B, S, hidden]``; writes this step's K/V into the pages."""
        rope = None if self.rope is None else ropes[self.rope]
        normed = x if self.attn_norm is None else self.attn_norm(x)
        attn = self.attention(normed, rope=rope, plan=plan, k_cache=k_cache, v_cache=v_cache)
        if self.parallel:
            mlp_in = normed if self.mlp_norm is None else self.mlp_norm(x)
            return x + self._scaled(attn) + self._scaled(self.mlp(mlp_in))
        del normed  # the MLP's temporaries are the prefill's largest: hold less beside them
        if self.post_attn_norm is not None:
            attn = self.post_attn_norm(attn)
        x = x + self._scaled(attn)
        del attn
        out = self.mlp(x if self.mlp_norm is None else self.mlp_norm(x))
        if self.post_mlp_norm is not None:
            out = self.post_mlp_norm(out)
        return x + self._scaled(out)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier
