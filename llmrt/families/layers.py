"""Small building blocks the families share (norms and linear layers built from weights)."""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from llmrt.errors import ConfigError
from llmrt.families.base import CausalLM

#: How a ``FrozenLinear`` multiplies: ``aten`` is ``F.linear``; ``onednn`` calls oneDNN's
#: matmul directly on the plain weight. On CPU, aten sends float32 to MKL's sgemm, which
#: runs well below the AVX-512 peak on AMD cores (about 220 against 480 GFLOPS on this
#: project's 2-core EPYC); oneDNN reaches the peak on every x86 vendor. bfloat16 already
#: goes through oneDNN in aten.
LinearKernel = Literal["aten", "onednn"]
LinearKernelChoice = Literal["auto", "aten", "onednn"]
LINEAR_KERNEL_CHOICES: tuple[str, ...] = get_args(LinearKernelChoice)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, as Hugging Face does."""

    def __init__(self, *, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = _parameter(weight)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def onednn_linear_available() -> bool:
    """Whether this torch build can run oneDNN matmuls on CPU tensors."""
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")


@torch.library.custom_op("llmrt::onednn_linear", mutates_args=())
def _onednn_linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """oneDNN linear as an opaque op, so ``torch.compile`` calls it instead of lowering it.

    Inductor's own lowering of the oneDNN linear needs weights frozen into constants.
    """
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out


@_onednn_linear_op.register_fake
def _onednn_linear_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class FrozenLinear(nn.Module):
    """``y = x W^T + b`` over frozen weights ``[out, in]``, with a selectable kernel."""

    def __init__(self, *, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = _parameter(weight)
        self.bias = None if bias is None else _parameter(bias)
        self.kernel: LinearKernel = "aten"

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "onednn":
            if torch.compiler.is_compiling():
                out: torch.Tensor = _onednn_linear_op(x, self.weight, self.bias)
                return out
            out = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
            return out
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, kernel={self.kernel}"
        )


def frozen_linear(*, weight: torch.Tensor, bias: torch.Tensor | None = None) -> FrozenLinear:
    """A ``FrozenLinear`` wrapping ``weight`` ``[out, in]`` (and ``bias``) without copying them."""
    return FrozenLinear(weight=weight, bias=bias)


def resolve_linear_kernel(
    choice: LinearKernelChoice, *, device: torch.device, dtype: torch.dtype
) -> LinearKernel:
    """The kernel ``choice`` means for weights of ``dtype`` on ``device``.

    ``auto`` picks oneDNN for float32 on CPU when this torch build has it, else aten.
    ``onednn`` anywhere but a CPU device (or without oneDNN) is a ``ConfigError``.
    """
    if choice not in LINEAR_KERNEL_CHOICES:
        raise ConfigError("device.linear", choice, f"must be one of {list(LINEAR_KERNEL_CHOICES)}")
    usable = device.type == "cpu" and onednn_linear_available()
    if choice == "onednn":
        if not usable:
            reason = (
                "needs a cpu device"
                if device.type != "cpu"
                else "this torch build has no oneDNN (torch.backends.mkldnn)"
            )
            raise ConfigError("device.linear", choice, reason)
        return "onednn"
    if choice == "auto" and usable and dtype == torch.float32:
        return "onednn"
    return "aten"


def select_linear_kernel(
    model: CausalLM, *, choice: LinearKernelChoice, device: torch.device, dtype: torch.dtype
) -> LinearKernel:
    """Resolve ``choice`` for the model's weights and point all its linear layers at it."""
    kernel = resolve_linear_kernel(choice, device=device, dtype=dtype)
    for _, module in model.iter_executor_named_modules():
        use_linear_kernel(module, kernel=kernel)
    return kernel


def use_linear_kernel(module: nn.Module, *, kernel: LinearKernel) -> int:
    """Point every ``FrozenLinear`` under ``module`` at ``kernel``; returns how many."""
    count = 0
    for sub in module.modules():
        if isinstance(sub, FrozenLinear):
            sub.kernel = kernel
            count += 1
    return count


def frozen_layer_norm(*, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> nn.LayerNorm:
    """An ``nn.LayerNorm`` wrapping ``weight``/``bias`` without copying them."""
    norm = nn.LayerNorm(weight.shape[0], eps=eps, device="meta")
    norm.weight = _parameter(weight)
    norm.bias = _parameter(bias)
    return norm


def frozen_embedding(*, weight: torch.Tensor) -> nn.Embedding:
    """An ``nn.Embedding`` wrapping ``weight`` ``[num, dim]`` without copying it."""
    # ``_weight`` skips the random init (on "meta" it imports torch._dynamo: seconds).
    embedding = nn.Embedding(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True)
    embedding.weight = _parameter(weight)
    return embedding


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    """``tensor`` as a frozen parameter; an existing parameter is reused so ties stay one object."""
    if isinstance(tensor, nn.Parameter):
        return tensor
    return nn.Parameter(tensor, requires_grad=False)
