"""Small building blocks the families share (norms and linear layers built from weights)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, as Hugging Face does."""

    def __init__(self, *, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = _parameter(weight)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def frozen_linear(*, weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """An ``nn.Linear`` wrapping ``weight`` ``[out, in]`` (and ``bias``) without copying them."""
    out_features, in_features = weight.shape
    layer = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    layer.weight = _parameter(weight)
    if bias is not None:
        layer.bias = _parameter(bias)
    return layer


def frozen_layer_norm(*, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> nn.LayerNorm:
    """An ``nn.LayerNorm`` wrapping ``weight``/``bias`` without copying them."""
    norm = nn.LayerNorm(weight.shape[0], eps=eps, device="meta")
    norm.weight = _parameter(weight)
    norm.bias = _parameter(bias)
    return norm


def frozen_embedding(*, weight: torch.Tensor) -> nn.Embedding:
    """An ``nn.Embedding`` wrapping ``weight`` ``[num, dim]`` without copying it."""
    embedding = nn.Embedding(weight.shape[0], weight.shape[1], device="meta")
    embedding.weight = _parameter(weight)
    return embedding


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    """``tensor`` as a frozen parameter; an existing parameter is reused so ties stay one object."""
    if isinstance(tensor, nn.Parameter):
        return tensor
    return nn.Parameter(tensor, requires_grad=False)
