"""The torch forms of the parts that are plain functions, activations and norms, in one
registry an external package adds to (``register_activation``, ``register_norm``).

A registered form is a part like any built-in: ``MLPSpec.activation`` / ``NormSpec.kind``
accept its name, ``hfparts.activation`` maps its Hugging Face ``hidden_act`` names onto it,
and the decoder computes it with the given torch function. The fused CPU decode op knows
only its own kernels' forms: a model using another decodes through the torch ops, and
``fused_decode_status()`` names the part (``not fused: activation quick_gelu (layers.0)``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from llmrt.errors import FamilyError

ActivationForm = Callable[[torch.Tensor], torch.Tensor]
#: ``form(x, weight, bias, eps)`` over the last dim; ``weight``/``bias`` None when the norm
#: has none, else broadcastable over ``x`` (one row per head for per-head q/k norms).
NormForm = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None, float], torch.Tensor]


def _relu_squared(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


_ACTIVATIONS: dict[str, ActivationForm] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": _relu_squared,
}
#: Hugging Face ``hidden_act`` names -> the activation part that computes them.
HF_ACTIVATIONS: dict[str, str] = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "relu2": "relu2",
}
#: Norm kinds built into ``decoder_layers.Norm`` (the fused op runs all four).
BUILTIN_NORMS: tuple[str, ...] = ("rms", "rms_one_plus", "layer", "layer_one_plus")
_NORMS: dict[str, NormForm] = {}


def register_activation(name: str, form: ActivationForm, *, hf_names: Iterable[str] = ()) -> None:
    """Add activation ``name`` computed by ``form``; ``hf_names`` are the ``hidden_act``
    values that mean it. A name already taken is a ``FamilyError`` (never shadowed)."""
    if _ACTIVATIONS.get(name) is form:
        return
    if name in _ACTIVATIONS:
        raise FamilyError(f"activation {name!r} is already registered")
    taken = [n for n in hf_names if n in HF_ACTIVATIONS]
    if taken:
        raise FamilyError(f"hidden_act name(s) {taken} already map to an activation")
    _ACTIVATIONS[name] = form
    for hf_name in hf_names:
        HF_ACTIVATIONS[hf_name] = name


def register_norm(kind: str, form: NormForm) -> None:
    """Add norm kind ``kind`` computed by ``form(x, weight, bias, eps)`` (``FamilyError``
    when the kind is taken)."""
    if _NORMS.get(kind) is form:
        return
    if kind in BUILTIN_NORMS or kind in _NORMS:
        raise FamilyError(f"norm kind {kind!r} is already registered")
    _NORMS[kind] = form


def activation_names() -> tuple[str, ...]:
    """Every activation part, built in or registered."""
    return tuple(_ACTIVATIONS)


def norm_kinds() -> tuple[str, ...]:
    """Every norm kind, built in or registered."""
    return (*BUILTIN_NORMS, *_NORMS)


def activation_form(name: str) -> ActivationForm:
    """The torch function of activation ``name``."""
    return _ACTIVATIONS[name]


def norm_form(kind: str) -> NormForm | None:
    """The torch function of a registered norm kind (None for a built-in one)."""
    return _NORMS.get(kind)
