"""Parts added from outside llmrt: a registered activation and norm kind, and a
``CustomPart`` in the MLP slot, each computed by its own torch form inside the shared
decoder (no llmrt file edited, no ``build`` override, no module replaced after build)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import pytest
import torch
from torch import nn

from llmrt.errors import ConfigError, FamilyError
from llmrt.families import forms, hfparts, llama
from llmrt.families.declared import parse_parts
from llmrt.families.decoder import TensorNames
from llmrt.families.decoder_family import DecoderFamily
from llmrt.families.hfconfig import HFConfig
from llmrt.families.paged_attention import attend
from llmrt.families.parts import (
    CustomAttention,
    DecoderSpec,
    LayerSpec,
    MLPSpec,
    NormSpec,
    TensorInit,
)
from llmrt.families.rope import apply_rope
from llmrt.testing.parity import allocate_kv
from llmrt.weights.random import random_tensors

CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def _softsign(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + x.abs())


def _mean_abs_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    out = x / (x.abs().mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight


forms.register_activation("ext_softsign", _softsign, hf_names=("ext_softsign",))
forms.register_norm("ext_mean_abs", _mean_abs_norm)


class GatedTanhModule(nn.Module):
    def __init__(self, *, up: nn.Module, down: nn.Module, scale: torch.Tensor) -> None:
        super().__init__()
        self.up, self.down = up, down
        self.scale = nn.Parameter(scale, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x))) * self.scale


@attrs.frozen
class GatedTanh:
    """A package's MLP-slot part: ``down(tanh(w_in x)) * scale``, its own tensor names."""

    intermediate_size: int

    def tensors(
        self, *, prefix: str, hidden: int
    ) -> Mapping[str, tuple[tuple[int, ...], TensorInit]]:
        return {
            f"{prefix}mlp.w_in.weight": ((self.intermediate_size, hidden), "normal"),
            f"{prefix}mlp.w_out.weight": ((hidden, self.intermediate_size), "normal"),
            f"{prefix}mlp.scale": ((hidden,), "ones"),
        }

    def build(
        self,
        *,
        prefix: str,
        linear: Callable[..., nn.Module],
        take: Callable[[str], torch.Tensor],
    ) -> nn.Module:
        return GatedTanhModule(
            up=linear(f"{prefix}mlp.w_in"),
            down=linear(f"{prefix}mlp.w_out"),
            scale=take(f"{prefix}mlp.scale"),
        )


class HeadScaledAttentionModule(nn.Module):
    """Grouped-query attention whose heads' outputs are scaled by a learned factor each
    before the output projection, over llmrt's paged KV (``attend``)."""

    def __init__(
        self,
        *,
        qkv: nn.Module,
        o: nn.Module,
        head_scale: torch.Tensor,
        heads: tuple[int, int, int],
        window: int | None,
    ) -> None:
        super().__init__()
        self.qkv, self.o = qkv, o
        self.head_scale = nn.Parameter(head_scale, requires_grad=False)
        self.num_heads, self.num_kv_heads, self.head_dim = heads
        self.window = window

    def forward(
        self,
        x: torch.Tensor,
        *,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        plan: Any,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split((q_out, kv_out, kv_out), dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if rope is not None:
            q, k = (apply_rope(t, cos=rope[0], sin=rope[1]) for t in (q, k))
        out = attend(
            q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, plan=plan,
            scale=self.head_dim**-0.5, window=self.window,
        )  # fmt: skip
        out = out.unflatten(-1, (self.num_heads, self.head_dim)) * self.head_scale[:, None]
        return self.o(out.flatten(-2))


@attrs.frozen
class HeadScaledAttention:
    """A package's attention-slot part: one stacked ``attn.wqkv``, ``attn.wo`` and a
    per-head output scale, its own tensor names."""

    heads: tuple[int, int, int]  # query heads, KV heads, head_dim

    def tensors(
        self, *, prefix: str, hidden: int
    ) -> Mapping[str, tuple[tuple[int, ...], TensorInit]]:
        h, kv, d = self.heads
        return {
            f"{prefix}attn.wqkv.weight": (((h + 2 * kv) * d, hidden), "normal"),
            f"{prefix}attn.wo.weight": ((hidden, h * d), "normal"),
            f"{prefix}attn.head_scale": ((h,), "ones"),
        }

    def build(
        self,
        *,
        prefix: str,
        linear: Callable[..., nn.Module],
        take: Callable[[str], torch.Tensor],
        window: int | None,
    ) -> nn.Module:
        return HeadScaledAttentionModule(
            qkv=linear(f"{prefix}attn.wqkv"),
            o=linear(f"{prefix}attn.wo"),
            head_scale=take(f"{prefix}attn.head_scale"),
            heads=self.heads,
            window=window,
        )


def _read_with(**changes: Any) -> Callable[[HFConfig, torch.dtype], Any]:
    def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
        spec, names = llama.read(cfg, dtype)
        return attrs.evolve(spec, **changes), names

    return read


def _build(family: DecoderFamily, config: Mapping[str, Any]) -> Any:
    plan = family.tensor_plan(config)
    tensors = random_tensors(shapes=plan.shapes, seed=0, init=plan.init)
    for name in tensors:  # move norm weights and scales off ones, which hide mistakes
        if plan.init[name] == "ones":
            tensors[name] = tensors[name] + torch.linspace(-0.3, 0.3, tensors[name].numel())
    return family.build(hf_config=config, tensors=tensors, dtype=torch.float32, device="cpu"), (
        tensors
    )


def test_a_registered_activation_is_read_from_hidden_act_and_computed_by_its_form() -> None:
    config = {**CONFIG, "hidden_act": "ext_softsign"}
    model, tensors = _build(llama.FAMILY, config)
    mlp = model.backbone.layers[0].mlp
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    gate, up = (tensors[f"model.layers.0.mlp.{n}_proj.weight"] for n in ("gate", "up"))
    down = tensors["model.layers.0.mlp.down_proj.weight"]
    expected = (_softsign(x @ gate.T) * (x @ up.T)) @ down.T
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-6)
    assert model.backbone.fused_decode_status() == ("not fused: activation ext_softsign (layers.0)")
    assert parse_parts({"mlp": {"activation": "ext_softsign"}}).mlp["activation"] == "ext_softsign"


def test_a_registered_norm_kind_is_a_norm_part() -> None:
    family = attrs.evolve(
        llama.FAMILY, name="ext_norm", read=_read_with(norm=NormSpec(kind="ext_mean_abs", eps=1e-3))
    )
    model, tensors = _build(family, CONFIG)
    norm = model.backbone.layers[1].attn_norm
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(2))
    weight = tensors["model.layers.1.input_layernorm.weight"]
    torch.testing.assert_close(norm(x), _mean_abs_norm(x, weight, None, 1e-3))
    assert model.backbone.fused_decode_status() == (
        "not fused: norm kind ext_mean_abs (layers.0.attn_norm)"
    )


def test_a_custom_part_names_its_tensors_and_builds_its_module() -> None:
    family = attrs.evolve(llama.FAMILY, name="ext_mlp", read=_read_with(mlp=GatedTanh(48)))
    plan = family.tensor_plan(CONFIG)
    assert plan.shapes["model.layers.1.mlp.w_in.weight"] == (48, 32)
    assert plan.init["model.layers.1.mlp.scale"] == "ones"
    assert "model.layers.1.mlp.gate_proj.weight" not in plan.shapes
    model, tensors = _build(family, CONFIG)
    mlp = model.backbone.layers[1].mlp
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
    w_in, w_out = (
        tensors["model.layers.1.mlp.w_in.weight"],
        tensors["model.layers.1.mlp.w_out.weight"],
    )
    expected = (torch.tanh(x @ w_in.T) @ w_out.T) * tensors["model.layers.1.mlp.scale"]
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-6)
    assert model.backbone.fused_decode_status() == (
        "not fused: mlp part GatedTanhModule (layers.0)"
    )


def test_names_are_never_shadowed_and_unknown_ones_are_named() -> None:
    with pytest.raises(FamilyError, match="activation 'silu' is already registered"):
        forms.register_activation("silu", _softsign)
    with pytest.raises(FamilyError, match="norm kind 'rms' is already registered"):
        forms.register_norm("rms", _mean_abs_norm)
    with pytest.raises(ConfigError, match=r"^mlp.activation: must be one of \[.*'relu2'"):
        MLPSpec(activation="nope", intermediate_size=4)
    with pytest.raises(ConfigError, match="an rms norm has no bias"):
        NormSpec(kind="rms", bias=True)


def test_interleaved_rope_loads_as_the_neox_order() -> None:
    """GPT-J pairs (2i, 2i+1) of the rotated channels become (i, i + rotary/2); the rest
    stay put, so q.k products (and the scores) are unchanged."""
    from llmrt.families.decoder import rope_pair_order

    assert rope_pair_order(8, 4).tolist() == [0, 2, 1, 3, 4, 5, 6, 7]
    assert rope_pair_order(4, 4).tolist() == [0, 2, 1, 3]
    # A weightless LayerNorm (OLMo) reads no tensor at all.
    spec = DecoderSpec(
        model=llama.read(HFConfig(raw=CONFIG), torch.float32)[0].model,
        attention=hfparts.attention(
            llama.read(HFConfig(raw=CONFIG), torch.float32)[0].model, rope_style="interleaved"
        ),
        mlp=MLPSpec(intermediate_size=48),
        norm=NormSpec(kind="layer", weight=False),
        layers=(LayerSpec(), LayerSpec()),
        ropes=llama.read(HFConfig(raw=CONFIG), torch.float32)[0].ropes,
    )
    from llmrt.families.decoder import tensor_plan

    assert not [n for n in tensor_plan(spec, TensorNames()).shapes if "layernorm" in n]


def _greedy_logits(model: Any, prompt: list[int], *, steps: int) -> torch.Tensor:
    """Prefill ``prompt``, then ``steps`` greedy decode steps; every step's logits."""
    model.set_kv_cache(allocate_kv(model, num_blocks=8, block_size=4))
    table = torch.arange(8, dtype=torch.int32)[None]
    n = len(prompt)
    logits = [
        model.prefill_forward(
            tokens=torch.tensor([prompt]),
            start_pos=torch.tensor([0], dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32),
            page_table=table,
            last_token_index=torch.tensor([n - 1]),
        ).reshape(1, -1)
    ]
    for pos in range(n, n + steps):
        logits.append(
            model.decode_forward(
                tokens=logits[-1].argmax(-1),
                positions=torch.tensor([pos], dtype=torch.int32),
                page_table=table,
            ).reshape(1, -1)
        )
    return torch.cat(logits)


def test_a_custom_attention_part_runs_in_the_attention_slot_over_the_paged_kv() -> None:
    """A package's attention module, its own tensor names, prefilled and decoded over the
    paged KV, equals the built-in attention on the same weights (the head scales folded
    into the output projection's columns, which is the same product); the fused decode op
    names the part it cannot run, and the model decodes through the torch ops."""
    heads = (4, 2, 8)
    family = attrs.evolve(
        llama.FAMILY, name="ext_attn", read=_read_with(attention_part=HeadScaledAttention(heads))
    )
    plan = family.tensor_plan(CONFIG)
    assert plan.shapes["model.layers.1.attn.wqkv.weight"] == (64, 32)
    assert plan.init["model.layers.1.attn.head_scale"] == "ones"
    assert "model.layers.1.self_attn.q_proj.weight" not in plan.shapes
    model, tensors = _build(family, CONFIG)
    assert isinstance(model.backbone.layers[0].attention, HeadScaledAttentionModule)
    assert model.backbone.fused_decode_status() == (
        "not fused: attention part HeadScaledAttentionModule (layers.0)"
    )

    reference = {k: v for k, v in tensors.items() if ".attn." not in k}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        q, k, v = tensors[p + "attn.wqkv.weight"].split((32, 16, 16))
        for name, rows in (("q", q), ("k", k), ("v", v)):
            reference[f"{p}self_attn.{name}_proj.weight"] = rows
        scale = tensors[p + "attn.head_scale"].repeat_interleave(heads[2])
        reference[p + "self_attn.o_proj.weight"] = tensors[p + "attn.wo.weight"] * scale
    builtin = llama.FAMILY.build(
        hf_config=CONFIG, tensors=reference, dtype=torch.float32, device="cpu"
    )
    prompt = [3, 17, 5, 40, 22, 9, 31]
    got = _greedy_logits(model, prompt, steps=6)
    want = _greedy_logits(builtin, prompt, steps=6)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert isinstance(HeadScaledAttention(heads), CustomAttention)


def test_a_custom_attention_part_refuses_the_options_it_would_ignore() -> None:
    spec = llama.read(HFConfig(raw=CONFIG), torch.float32)[0]
    part = HeadScaledAttention((4, 2, 8))
    biased = attrs.evolve(spec.attention, qkv_bias=True)
    with pytest.raises(ConfigError, match=r"^attention\.qkv_bias: is computed by the built-in"):
        attrs.evolve(spec, attention=biased, attention_part=part)
    with pytest.raises(ConfigError, match=r"^attention_part: must have tensors"):
        attrs.evolve(spec, attention_part=MLPSpec(intermediate_size=8))


def test_q_k_norms_over_the_whole_projection_are_named_by_the_fused_op() -> None:
    """OLMo-2's q/k norms span every head of the projection: the op normalises per head, so
    it names the part and the model decodes through the torch ops."""

    def read(cfg: HFConfig, dtype: torch.dtype) -> tuple[DecoderSpec, TensorNames]:
        spec, names = llama.read(cfg, dtype)
        return attrs.evolve(spec, attention=attrs.evolve(spec.attention, qk_norm="proj")), names

    model, _ = _build(attrs.evolve(llama.FAMILY, name="ext_proj_norm", read=read), CONFIG)
    assert model.backbone.fused_decode_status() == (
        "not fused: q/k norms over the whole projection (layers.0)"
    )
