"""Per-expert checkpoint weights stacked into the fused expert tensors the decoder reads.

Checkpoints keep a mixture-of-experts layer as one linear per expert (Mixtral's
``block_sparse_moe.experts.N.w1``, Qwen's ``mlp.experts.N.gate_proj``, and what
transformers' ``save_pretrained`` writes); the decoder reads ``[experts, 2 * inter, hidden]``
/ ``[experts, hidden, inter]`` stacks. ``DecoderFamily`` stacks them for every family before
its own ``rename``, so a family (or a recipe's ``model.parts``) with experts needs no code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from llmrt.kernels.formats import CheckpointTensor

#: Per-expert checkpoint names (as on the Hub and as transformers saves them) -> the fused
#: ``[experts, 2 * inter, hidden]`` / ``[experts, hidden, inter]`` stacks the decoder reads.
_EXPERT_LAYOUTS: tuple[tuple[str, str, str, str, str], ...] = (
    # (per-expert prefix, gate, up, down, router) relative to the layer prefix
    ("block_sparse_moe.experts.", "w1", "w3", "w2", "block_sparse_moe.gate"),
    ("mlp.experts.", "gate_proj", "up_proj", "down_proj", "mlp.gate"),
)


def fuse_experts(
    tensors: Mapping[str, CheckpointTensor],
    *,
    expected: Mapping[str, tuple[int, ...]],
    config: Mapping[str, Any] | None = None,
) -> dict[str, CheckpointTensor]:
    """Stack per-expert weights into the fused expert tensors ``expected`` names.

    A layer's experts are fused only when every expert's gate, up and down weight is
    present; anything else passes through for ``check_tensors`` to name.
    """
    out = dict(tensors)
    for fused in [name for name in expected if name.endswith(".mlp.experts.gate_up_proj")]:
        layer = fused[: -len("mlp.experts.gate_up_proj")]
        if fused in out:
            continue
        experts = expected[fused][0]
        for prefix, gate, up, down, router in _EXPERT_LAYOUTS:
            names = [
                [f"{layer}{prefix}{e}.{w}.weight" for w in (gate, up, down)] for e in range(experts)
            ]
            if not all(n in out for row in names for n in row):
                continue
            out[fused] = torch.stack(
                [torch.cat([_dense(out[g]), _dense(out[u])]) for g, u, _ in names]
            )
            out[f"{layer}mlp.experts.down_proj"] = torch.stack(
                [_dense(out[d]) for _, _, d in names]
            )
            for row in names:
                for n in row:
                    del out[n]
            if f"{layer}{router}.weight" in out and router != "mlp.gate":
                out[f"{layer}mlp.gate.weight"] = out.pop(f"{layer}{router}.weight")
            break
    return out


def _dense(tensor: CheckpointTensor) -> torch.Tensor:
    """Expert weights are stacked in float (quantized blocks are dequantized first)."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor.dequantize()
