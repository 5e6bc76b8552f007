"""llama.cpp architectures whose GGUF files llmrt reads into Hugging Face form: one data table
keyed by ``general.architecture``, so a family module holds only its ``config.json`` mapping.

Each entry maps one architecture to a ``config.json`` (with the ``model_type`` a family
claims), Hugging Face tensor names and the conversions llama.cpp's converter applied
(Q/K rows interleaved for llama-derived files, Gemma's norms stored as ``1 + w``, GPT-2's
Conv1D weights as Linear). ``architecture_for`` looks a name up: a family's own declaration
first (``DecoderFamily.gguf``, how a package adds one), then this table; the family that
runs a file is then the one that claims its ``model_type`` (``family_for_model_type``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import gguf as gguf_py
import numpy as np

from llmrt.errors import CheckpointError
from llmrt.families import registry
from llmrt.families.gguf_architecture import (
    STACKED_EXPERTS,
    ConfigReader,
    GGUFArchitecture,
    Regrouper,
    join_stacked_experts,
    keep_groups,
    keep_layout,
    metadata_field,
    reject_rope_scaling,
    token_ids,
    unpermute_qk,
    vocab_size,
)
from llmrt.weights.gguf_file import GGUFFile

_GLOBAL = MappingProxyType(
    {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output_norm.bias": "model.norm.bias",
        "output.weight": "lm_head.weight",
    }
)
_ATTENTION = {
    "attn_q": "model.layers.{layer}.self_attn.q_proj",
    "attn_k": "model.layers.{layer}.self_attn.k_proj",
    "attn_v": "model.layers.{layer}.self_attn.v_proj",
    "attn_output": "model.layers.{layer}.self_attn.o_proj",
}
_GATED_MLP = {
    "ffn_gate": "model.layers.{layer}.mlp.gate_proj",
    "ffn_up": "model.layers.{layer}.mlp.up_proj",
    "ffn_down": "model.layers.{layer}.mlp.down_proj",
}
_PRE_NORMS = {
    "attn_norm": "model.layers.{layer}.input_layernorm",
    "ffn_norm": "model.layers.{layer}.post_attention_layernorm",
}
_QK_NORMS = {
    "attn_q_norm": "model.layers.{layer}.self_attn.q_norm",
    "attn_k_norm": "model.layers.{layer}.self_attn.k_norm",
}


#: ``extra(metadata, config)``: the keys an architecture adds to the common config.
_Extra = Callable[[Mapping[str, Any], dict[str, Any]], dict[str, Any]]


def _decoder_config(
    *,
    arch: str,
    model_type: str,
    architecture: str,
    hidden_act: str,
    eps_key: str | None,
    eps_name: str,
    partial_rotary: bool = False,
    rope_scalings: tuple[str, ...] = (),
) -> Callable[[Mapping[str, Any], Mapping[str, tuple[int, ...]], str], dict[str, Any]]:
    """The config reader shared by llama-like decoders: the metadata every converter writes
    (``rope_scalings``: scaling types the architecture's ``extra`` translates itself;
    ``eps_key`` None: the architecture's norms state no epsilon, OLMo's)."""

    def read(
        metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], item: str
    ) -> dict[str, Any]:
        key = lambda name: f"{arch}.{name}"  # noqa: E731
        hidden = int(metadata_field(metadata, key("embedding_length"), item))
        heads = int(metadata_field(metadata, key("attention.head_count"), item))
        head_dim = int(metadata.get(key("attention.key_length")) or hidden // heads)
        rope_dim = metadata.get(key("rope.dimension_count"))
        rotary: dict[str, Any] = {}
        if partial_rotary:
            rotary["partial_rotary_factor"] = int(rope_dim or head_dim) / head_dim
        elif rope_dim is not None and int(rope_dim) != head_dim:
            raise CheckpointError(
                f"{item}: {key('rope.dimension_count')}",
                f"partial rotary ({rope_dim} of head_dim {head_dim}) is not supported",
            )
        if metadata.get(key("rope.scaling.type")) not in rope_scalings:
            reject_rope_scaling(metadata, arch, item)
        config: dict[str, Any] = {
            "architectures": [architecture],
            "model_type": model_type,
            "vocab_size": vocab_size(metadata, shapes, arch),
            "hidden_size": hidden,
            "intermediate_size": int(metadata_field(metadata, key("feed_forward_length"), item)),
            "num_hidden_layers": int(metadata_field(metadata, key("block_count"), item)),
            "num_attention_heads": heads,
            "num_key_value_heads": int(metadata.get(key("attention.head_count_kv")) or heads),
            "head_dim": head_dim,
            "max_position_embeddings": int(metadata_field(metadata, key("context_length"), item)),
            "rope_theta": float(metadata.get(key("rope.freq_base")) or 10000.0),
            "hidden_act": hidden_act,
            "attention_bias": "blk.0.attn_q.bias" in shapes,
            "tie_word_embeddings": "output.weight" not in shapes,
            **rotary,
            **token_ids(metadata),
        }
        if eps_key is not None:
            config[eps_name] = float(metadata_field(metadata, key(eps_key), item))
        window = metadata.get(key("attention.sliding_window"))
        if window is not None:
            config["sliding_window"] = int(window)
        return config

    return read


def _with(
    read: Callable[[Mapping[str, Any], Mapping[str, tuple[int, ...]], str], dict[str, Any]],
    extra: Callable[[Mapping[str, Any], dict[str, Any]], dict[str, Any]],
) -> Callable[[Mapping[str, Any], Mapping[str, tuple[int, ...]], str], dict[str, Any]]:
    def combined(
        metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], item: str
    ) -> dict[str, Any]:
        config = read(metadata, shapes, item)
        return {**config, **extra(metadata, config)}

    return combined


#: Phi-3's LongRoPE factors: tensors in the file, ``rope_scaling`` lists in ``config.json``.
_PHI3_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _phi3_extra(metadata: Mapping[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp's Phi3MiniModel writes beyond the common keys: the original context
    (always), a sliding window (0: none, Phi-4) and, for the 128k models, LongRoPE's factor
    tensors and attention factor."""
    extra: dict[str, Any] = {}
    if not config.get("sliding_window"):
        extra["sliding_window"] = None
    original = metadata.get("phi3.rope.scaling.original_context_length")
    if original is not None:
        extra["original_max_position_embeddings"] = int(original)
    long, short = (metadata.get(name) for name in _PHI3_ROPE_FACTORS)
    if long is None and short is None:
        return extra
    if long is None or short is None or original is None:
        raise CheckpointError(
            "phi3 LongRoPE",
            "needs rope_factors_long, rope_factors_short and "
            "phi3.rope.scaling.original_context_length together",
        )
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": list(long),
        "short_factor": list(short),
        "original_max_position_embeddings": int(original),
    }
    attention = metadata.get("phi3.rope.scaling.attn_factor")
    if attention is not None:
        scaling["attention_factor"] = float(attention)
    return {**extra, "rope_scaling": scaling}


def _gemma_norms(name: str, values: np.ndarray, hf_config: Mapping[str, Any]) -> np.ndarray:
    """llama.cpp stores Gemma's RMSNorm weights as ``1 + w``; Hugging Face keeps ``w``."""
    if name.endswith("norm.weight") and values.dtype.kind == "f":
        return values - np.float32(1.0)
    return values


def _gemma2_extra(metadata: Mapping[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    extra: dict[str, Any] = {"query_pre_attn_scalar": config["head_dim"]}
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = metadata.get(f"gemma2.{name}")
        extra[name] = None if value is None else float(value)
    return extra


def _stablelm_extra(metadata: Mapping[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    return {
        "use_qkv_bias": config["attention_bias"],
        "use_parallel_residual": bool(metadata.get("stablelm.use_parallel_residual", False)),
    }


def _flag_tensor(key: str, tensor: str) -> Callable[[ConfigReader], ConfigReader]:
    """A guard setting ``config[key]`` to whether the file holds ``tensor`` (an optional part
    the header states only by its tensors, like StableLM's and Command-R's q/k norms)."""

    def guard(read: ConfigReader) -> ConfigReader:
        def flagged(
            metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], item: str
        ) -> dict[str, Any]:
            return {**read(metadata, shapes, item), key: tensor in shapes}

        return flagged

    return guard


def _split_head_norms(tensors: dict[str, Any], hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """StableLM's per-head q/k LayerNorms: llama.cpp stacks them (``[heads, head_dim]``);
    Hugging Face keeps one ``norms.{h}`` module per head."""
    out = {}
    for name, tensor in tensors.items():
        prefix, _, kind = name.rpartition(".")
        if not prefix.endswith((".q_layernorm", ".k_layernorm")):
            out[name] = tensor
            continue
        for head, row in enumerate(tensor):
            out[f"{prefix}.norms.{head}.{kind}"] = row.clone()
    return out


def _gptneox_extra(metadata: Mapping[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    return {
        "rotary_pct": config["partial_rotary_factor"],
        "use_parallel_residual": bool(metadata.get("gptneox.use_parallel_residual", True)),
    }


def _gptneox_qkv(name: str, values: np.ndarray, hf_config: Mapping[str, Any]) -> np.ndarray:
    """llama.cpp stores GPT-NeoX's fused QKV rows as all q, all k, all v; Hugging Face
    interleaves them per head (q, k, v of head 0, then of head 1, ...)."""
    if ".attn_qkv." not in name:
        return values
    heads = int(hf_config["num_attention_heads"])
    head_dim = values.shape[0] // 3 // heads
    split = values.reshape(3, heads, head_dim, *values.shape[1:])
    return split.swapaxes(0, 1).reshape(values.shape)


def _gemma3_extra(metadata: Mapping[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp's ``gemma3`` (text) fixes in code rather than in the header: a full
    attention layer every sixth, local layers' RoPE base 10000, and the query scale of the
    1B-12B models (``head_dim``)."""
    return {
        "query_pre_attn_scalar": config["head_dim"],
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
        "final_logit_softcapping": None,
    }


def _granite_extra(metadata: Mapping[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Granite's four scalars, under llama.cpp's names."""
    out = {}
    for gguf_key, hf_key in (
        ("embedding_scale", "embedding_multiplier"),
        ("residual_scale", "residual_multiplier"),
        ("attention.scale", "attention_multiplier"),
        ("logit_scale", "logits_scaling"),
    ):
        value = metadata.get(f"granite.{gguf_key}")
        if value is not None:
            out[hf_key] = float(value)
    return out


def _moe_extra(arch: str, *, weights_norm: bool) -> _Extra:
    """Qwen2-MoE / Qwen3-MoE expert counts under ``config.json``'s names. llama.cpp runs every
    layer sparse and fixes top-k renormalisation per architecture (off for qwen2moe, on for
    qwen3moe) rather than reading it from the header."""

    def extra(metadata: Mapping[str, Any], config: dict[str, Any]) -> dict[str, Any]:
        def field(name: str) -> int:
            return int(metadata_field(metadata, f"{arch}.{name}", "GGUF header"))

        # transformers 5 names Qwen3-MoE's count num_local_experts (num_experts: an alias)
        count_key = "num_local_experts" if arch == "qwen3moe" else "num_experts"
        out: dict[str, Any] = {
            count_key: field("expert_count"),
            "num_experts_per_tok": field("expert_used_count"),
            "moe_intermediate_size": field("expert_feed_forward_length"),
            "norm_topk_prob": weights_norm,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
        shared = metadata.get(f"{arch}.expert_shared_feed_forward_length")
        if shared is not None:
            out["shared_expert_intermediate_size"] = int(shared)
        if arch == "qwen2moe":
            out["qkv_bias"] = config["attention_bias"]
        return out

    return extra


def _qwen2moe_groups(tensors: dict[str, Any], hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """Stacked experts joined; the shared expert's gate as Hugging Face's ``[1, hidden]``
    (converters before llama.cpp stopped squeezing tensors wrote it 1-D)."""
    out = join_stacked_experts(tensors, hf_config)
    for name, tensor in out.items():
        if name.endswith(".mlp.shared_expert_gate.weight") and tensor.dim() == 1:
            out[name] = tensor.unsqueeze(0)
    return out


def _one_plus_norms(name: str, values: np.ndarray, hf_config: Mapping[str, Any]) -> np.ndarray:
    """llama.cpp's NemotronModel stores LayerNorm1P's weights as ``1 + w`` (biases as they are)."""
    if name.endswith("norm.weight") and values.dtype.kind == "f":
        return values - np.float32(1.0)
    return values


def _command_r_extra(metadata: Mapping[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Cohere's logit scale; llama.cpp always reads Command-R's LM head from the embedding."""
    return {
        "logit_scale": float(metadata.get("command-r.logit_scale") or 1.0),
        "tie_word_embeddings": True,
    }


def _mixtral_extra(metadata: Mapping[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp writes Mixtral as ``llama`` with stacked experts (``expert_count`` set)."""
    experts = metadata.get("llama.expert_count")
    if not experts:
        return {}
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": int(experts),
        "num_experts_per_tok": int(metadata_field(metadata, "llama.expert_used_count", "GGUF")),
        "sliding_window": None,
    }


def _olmo_extra(metadata: Mapping[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's OlmoModel: Llama's keys and tensors, no norm weights, ``clamp_kqv``."""
    clip = metadata.get("olmo.attention.clamp_kqv")
    return {"clip_qkv": None if clip is None else float(clip)}


def _gpt2_config(
    metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], item: str
) -> dict[str, Any]:
    """A llama.cpp ``gpt2`` GGUF's metadata as a GPT-2 ``config.json`` (GPT-2's own keys)."""

    def field(key: str) -> Any:
        return metadata_field(metadata, f"gpt2.{key}", item)

    hidden = int(field("embedding_length"))
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size(metadata, shapes, "gpt2"),
        "n_embd": hidden,
        "n_layer": int(field("block_count")),
        "n_head": int(field("attention.head_count")),
        "n_positions": int(field("context_length")),
        "n_inner": int(metadata.get("gpt2.feed_forward_length") or 4 * hidden),
        "layer_norm_epsilon": float(field("attention.layer_norm_epsilon")),
        "activation_function": "gelu_new",
        "tie_word_embeddings": "output.weight" not in shapes,
        **token_ids(metadata),
    }


_CONV1D = (".attn_qkv.weight", ".attn_output.weight", ".ffn_up.weight", ".ffn_down.weight")


def _gpt2_conv1d(name: str, values: np.ndarray, hf_config: Mapping[str, Any]) -> np.ndarray:
    """GPT-2's Hugging Face projections are Conv1D (``[in, out]``); GGUF stores them as Linear."""
    return values.T if name.endswith(_CONV1D) else values


#: llama.cpp's ``gpt2`` in Hugging Face form (its config keys are GPT-2's own).
_GPT2 = GGUFArchitecture(
    name="gpt2",
    hf_config=_gpt2_config,
    global_names=MappingProxyType(
        {
            "token_embd.weight": "transformer.wte.weight",
            "position_embd.weight": "transformer.wpe.weight",
            "output_norm.weight": "transformer.ln_f.weight",
            "output_norm.bias": "transformer.ln_f.bias",
            "output.weight": "lm_head.weight",
        }
    ),
    block_names=MappingProxyType(
        {
            "attn_norm": "transformer.h.{layer}.ln_1",
            "attn_qkv": "transformer.h.{layer}.attn.c_attn",
            "attn_output": "transformer.h.{layer}.attn.c_proj",
            "ffn_norm": "transformer.h.{layer}.ln_2",
            "ffn_up": "transformer.h.{layer}.mlp.c_fc",
            "ffn_down": "transformer.h.{layer}.mlp.c_proj",
        }
    ),
    convert=_gpt2_conv1d,
    model_types=("gpt2",),
)


_SHARED_EXPERT = {
    "ffn_gate_inp_shexp": "model.layers.{layer}.mlp.shared_expert_gate",
    "ffn_gate_shexp": "model.layers.{layer}.mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "model.layers.{layer}.mlp.shared_expert.up_proj",
    "ffn_down_shexp": "model.layers.{layer}.mlp.shared_expert.down_proj",
}


def _architecture(
    name: str,
    *,
    model_type: str,
    architecture: str,
    block_names: Mapping[str, str],
    hidden_act: str = "silu",
    eps_key: str | None = "attention.layer_norm_rms_epsilon",
    eps_name: str = "rms_norm_eps",
    model_types: tuple[str, ...] = (),
    extra: Callable[[Mapping[str, Any], dict[str, Any]], dict[str, Any]] | None = None,
    convert: Callable[[str, np.ndarray, Mapping[str, Any]], np.ndarray] | None = None,
    guard: Callable[[ConfigReader], ConfigReader] | None = None,
    partial_rotary: bool = False,
    global_names: Mapping[str, str] = _GLOBAL,
    regroup: Regrouper = keep_groups,
    config_tensors: tuple[str, ...] = (),
    rope_scalings: tuple[str, ...] = (),
) -> GGUFArchitecture:
    read = _decoder_config(
        arch=name,
        model_type=model_type,
        architecture=architecture,
        hidden_act=hidden_act,
        eps_key=eps_key,
        eps_name=eps_name,
        partial_rotary=partial_rotary,
        rope_scalings=rope_scalings,
    )
    if extra is not None:
        read = _with(read, extra)
    if guard is not None:
        read = guard(read)
    return GGUFArchitecture(
        name=name,
        hf_config=read,
        global_names=MappingProxyType(dict(global_names)),
        block_names=MappingProxyType(dict(block_names)),
        convert=keep_layout if convert is None else convert,
        regroup=regroup,
        config_tensors=config_tensors,
        model_types=model_types or (model_type,),
    )


#: llama.cpp's architectures llmrt reads, by ``general.architecture`` (a family's own ``gguf``
#: declaration, from a package, adds one or wins over an entry here).
LLAMA_CPP_ARCHITECTURES: Mapping[str, GGUFArchitecture] = MappingProxyType(
    {
        arch.name: arch
        for arch in (
            _GPT2,
            _architecture(
                "llama",  # Llama 1-3, SmolLM2, Mistral; Mixtral with expert_count
                model_type="llama",
                model_types=("llama", "mixtral"),
                architecture="LlamaForCausalLM",
                convert=unpermute_qk,
                extra=_mixtral_extra,
                guard=_flag_tensor("mlp_bias", "blk.0.ffn_up.bias"),
                regroup=join_stacked_experts,
                block_names={**_ATTENTION, **_GATED_MLP, **_PRE_NORMS, **STACKED_EXPERTS},
            ),
            _architecture(
                "olmo",
                model_type="olmo",
                architecture="OlmoForCausalLM",
                eps_key=None,  # OLMo's LayerNorm has a fixed eps and no weights
                convert=unpermute_qk,
                extra=_olmo_extra,
                global_names={
                    "token_embd.weight": "model.embed_tokens.weight",
                    "output.weight": "lm_head.weight",
                },
                block_names={**_ATTENTION, **_GATED_MLP},
            ),
            _architecture(
                "phi2",  # separate q/k/v tensors, NeoX RoPE (no q/k permutation)
                model_type="phi",
                architecture="PhiForCausalLM",
                hidden_act="gelu_new",
                eps_key="attention.layer_norm_epsilon",
                eps_name="layer_norm_eps",
                partial_rotary=True,
                extra=lambda metadata, config: {"tie_word_embeddings": False},
                global_names={
                    "token_embd.weight": "model.embed_tokens.weight",
                    "output_norm.weight": "model.final_layernorm.weight",
                    "output_norm.bias": "model.final_layernorm.bias",
                    "output.weight": "lm_head.weight",
                    "output.bias": "lm_head.bias",
                },
                block_names={
                    **_ATTENTION,
                    "attn_norm": "model.layers.{layer}.input_layernorm",
                    "attn_output": "model.layers.{layer}.self_attn.dense",
                    "ffn_up": "model.layers.{layer}.mlp.fc1",
                    "ffn_down": "model.layers.{layer}.mlp.fc2",
                },
            ),
            _architecture(
                "qwen2",
                model_type="qwen2",
                architecture="Qwen2ForCausalLM",
                block_names={**_ATTENTION, **_GATED_MLP, **_PRE_NORMS},
            ),
            _architecture(
                "qwen3",
                model_type="qwen3",
                architecture="Qwen3ForCausalLM",
                block_names={**_ATTENTION, **_GATED_MLP, **_PRE_NORMS, **_QK_NORMS},
            ),
            _architecture(
                "starcoder2",
                model_type="starcoder2",
                architecture="Starcoder2ForCausalLM",
                hidden_act="gelu_pytorch_tanh",
                eps_key="attention.layer_norm_epsilon",
                eps_name="norm_epsilon",
                extra=lambda metadata, config: {"use_bias": config["attention_bias"]},
                block_names={
                    **_ATTENTION,
                    **_PRE_NORMS,
                    "ffn_up": "model.layers.{layer}.mlp.c_fc",
                    "ffn_down": "model.layers.{layer}.mlp.c_proj",
                },
            ),
            _architecture(
                "phi3",
                model_type="phi3",
                architecture="Phi3ForCausalLM",
                extra=_phi3_extra,
                config_tensors=_PHI3_ROPE_FACTORS,
                rope_scalings=("longrope",),
                block_names={
                    "attn_qkv": "model.layers.{layer}.self_attn.qkv_proj",
                    "attn_output": "model.layers.{layer}.self_attn.o_proj",
                    "ffn_up": "model.layers.{layer}.mlp.gate_up_proj",
                    "ffn_down": "model.layers.{layer}.mlp.down_proj",
                    **_PRE_NORMS,
                },
            ),
            _architecture(
                "olmo2",
                model_type="olmo2",
                architecture="Olmo2ForCausalLM",
                block_names={
                    **_ATTENTION,
                    **_GATED_MLP,
                    **_QK_NORMS,
                    "post_attention_norm": "model.layers.{layer}.post_attention_layernorm",
                    "post_ffw_norm": "model.layers.{layer}.post_feedforward_layernorm",
                },
            ),
            _architecture(
                "stablelm",
                model_type="stablelm",
                architecture="StableLmForCausalLM",
                eps_key="attention.layer_norm_epsilon",
                eps_name="layer_norm_eps",
                partial_rotary=True,
                extra=_stablelm_extra,
                guard=_flag_tensor("qk_layernorm", "blk.0.attn_q_norm.weight"),
                regroup=_split_head_norms,
                block_names={
                    **_ATTENTION,
                    **_GATED_MLP,
                    **_PRE_NORMS,
                    "attn_q_norm": "model.layers.{layer}.self_attn.q_layernorm",
                    "attn_k_norm": "model.layers.{layer}.self_attn.k_layernorm",
                },
            ),
            _architecture(
                "gemma3",
                model_type="gemma3_text",
                architecture="Gemma3ForCausalLM",
                hidden_act="gelu_pytorch_tanh",
                convert=_gemma_norms,
                extra=_gemma3_extra,
                block_names={
                    **_ATTENTION,
                    **_GATED_MLP,
                    **_QK_NORMS,
                    "attn_norm": "model.layers.{layer}.input_layernorm",
                    "post_attention_norm": "model.layers.{layer}.post_attention_layernorm",
                    "ffn_norm": "model.layers.{layer}.pre_feedforward_layernorm",
                    "post_ffw_norm": "model.layers.{layer}.post_feedforward_layernorm",
                },
            ),
            _architecture(
                "granite",
                model_type="granite",
                architecture="GraniteForCausalLM",
                convert=unpermute_qk,
                extra=_granite_extra,
                block_names={**_ATTENTION, **_GATED_MLP, **_PRE_NORMS},
            ),
            _architecture(
                "gptneox",
                model_type="gpt_neox",
                architecture="GPTNeoXForCausalLM",
                hidden_act="gelu",
                eps_key="attention.layer_norm_epsilon",
                eps_name="layer_norm_eps",
                partial_rotary=True,
                extra=_gptneox_extra,
                convert=_gptneox_qkv,
                global_names={
                    "token_embd.weight": "gpt_neox.embed_in.weight",
                    "output_norm.weight": "gpt_neox.final_layer_norm.weight",
                    "output_norm.bias": "gpt_neox.final_layer_norm.bias",
                    "output.weight": "embed_out.weight",
                },
                block_names={
                    "attn_norm": "gpt_neox.layers.{layer}.input_layernorm",
                    "ffn_norm": "gpt_neox.layers.{layer}.post_attention_layernorm",
                    "attn_qkv": "gpt_neox.layers.{layer}.attention.query_key_value",
                    "attn_output": "gpt_neox.layers.{layer}.attention.dense",
                    "ffn_up": "gpt_neox.layers.{layer}.mlp.dense_h_to_4h",
                    "ffn_down": "gpt_neox.layers.{layer}.mlp.dense_4h_to_h",
                },
            ),
            _architecture(
                "qwen2moe",
                model_type="qwen2_moe",
                architecture="Qwen2MoeForCausalLM",
                extra=_moe_extra("qwen2moe", weights_norm=False),
                regroup=_qwen2moe_groups,
                block_names={**_ATTENTION, **_PRE_NORMS, **STACKED_EXPERTS, **_SHARED_EXPERT},
            ),
            _architecture(
                "qwen3moe",
                model_type="qwen3_moe",
                architecture="Qwen3MoeForCausalLM",
                extra=_moe_extra("qwen3moe", weights_norm=True),
                regroup=join_stacked_experts,
                block_names={**_ATTENTION, **_PRE_NORMS, **_QK_NORMS, **STACKED_EXPERTS},
            ),
            _architecture(
                "command-r",
                model_type="cohere",
                architecture="CohereForCausalLM",
                eps_key="attention.layer_norm_epsilon",
                eps_name="layer_norm_eps",
                extra=_command_r_extra,
                guard=_flag_tensor("use_qk_norm", "blk.0.attn_q_norm.weight"),
                block_names={
                    **_ATTENTION,
                    **_GATED_MLP,
                    **_QK_NORMS,
                    "attn_norm": "model.layers.{layer}.input_layernorm",
                },
            ),
            _architecture(
                "nemotron",
                model_type="nemotron",
                architecture="NemotronForCausalLM",
                hidden_act="relu2",
                eps_key="attention.layer_norm_epsilon",
                eps_name="norm_eps",
                partial_rotary=True,
                convert=_one_plus_norms,
                guard=_flag_tensor("mlp_bias", "blk.0.ffn_up.bias"),
                block_names={
                    **_ATTENTION,
                    **_PRE_NORMS,
                    "ffn_up": "model.layers.{layer}.mlp.up_proj",
                    "ffn_down": "model.layers.{layer}.mlp.down_proj",
                },
            ),
            _architecture(
                "smollm3",
                model_type="smollm3",
                architecture="SmolLM3ForCausalLM",
                convert=unpermute_qk,  # llama.cpp's SmolLM3Model is a LlamaModel
                # llama.cpp fixes the no-RoPE step at 4 and runs no sliding window.
                extra=lambda metadata, config: {
                    "no_rope_layer_interval": 4,
                    "use_sliding_window": False,
                },
                block_names={**_ATTENTION, **_GATED_MLP, **_PRE_NORMS},
            ),
            _architecture(
                "gemma",
                model_type="gemma",
                architecture="GemmaForCausalLM",
                hidden_act="gelu_pytorch_tanh",
                convert=_gemma_norms,
                block_names={**_ATTENTION, **_GATED_MLP, **_PRE_NORMS},
            ),
            _architecture(
                "gemma2",
                model_type="gemma2",
                architecture="Gemma2ForCausalLM",
                hidden_act="gelu_pytorch_tanh",
                convert=_gemma_norms,
                extra=_gemma2_extra,
                block_names={
                    **_ATTENTION,
                    **_GATED_MLP,
                    "attn_norm": "model.layers.{layer}.input_layernorm",
                    "post_attention_norm": "model.layers.{layer}.post_attention_layernorm",
                    "ffn_norm": "model.layers.{layer}.pre_feedforward_layernorm",
                    "post_ffw_norm": "model.layers.{layer}.post_feedforward_layernorm",
                },
            ),
        )
    }
)


def header_config(header: GGUFFile, *, item: str) -> tuple[GGUFArchitecture, dict[str, Any]]:
    """The architecture reading ``header`` (a parsed GGUF, ``item`` naming it) and the
    Hugging Face config it states: the metadata, the tensor shapes and the values of the
    few tensors that are configuration (``GGUFArchitecture.config_tensors``), no weights."""
    architecture = architecture_for(str(header.metadata.get("general.architecture")), item=item)
    shapes = {tensor.name: tensor.shape for tensor in header.tensors}
    metadata = dict(header.metadata)
    for tensor in header.tensors:
        if tensor.name in architecture.config_tensors:
            values = gguf_py.quants.dequantize(tensor.data, tensor.tensor_type)
            metadata[tensor.name] = [float(v) for v in np.asarray(values).reshape(-1)]
    return architecture, architecture.hf_config(metadata, shapes, item)


def family_table() -> str:
    """README's table of the served families, with the GGUF architectures each one runs (an
    entry here runs under the family claiming one of its ``model_types``)."""
    runs: dict[str, list[str]] = {}
    for family in registry.user_families():
        for name, architecture in LLAMA_CPP_ARCHITECTURES.items():
            if set(architecture.model_types) & set(family.model_types):
                runs.setdefault(family.name, []).append(name)
    return registry.family_table(runs)


def supported_architectures() -> tuple[str, ...]:
    """Every ``general.architecture`` llmrt reads, sorted."""
    return tuple(sorted({*registry.gguf_architectures(), *LLAMA_CPP_ARCHITECTURES}))


def architecture_for(name: str, *, item: str) -> GGUFArchitecture:
    """How to read GGUF files of architecture ``name`` (``item`` names the file): a family's
    own declaration, else llama.cpp's mapping here; else a ``CheckpointError`` listing the
    supported architectures."""
    declared = registry.gguf_architectures()
    if name in declared:
        architecture: GGUFArchitecture = declared[name]
        return architecture
    if name in LLAMA_CPP_ARCHITECTURES:
        return LLAMA_CPP_ARCHITECTURES[name]
    raise CheckpointError(
        f"{item}: general.architecture",
        f"no llmrt family reads GGUF architecture {name!r}; supported: "
        f"{', '.join(supported_architectures())} (a family reads GGUF files by declaring "
        f"`gguf`; see {registry.WRITING_A_FAMILY})",
    )
