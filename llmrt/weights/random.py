"""Seeded random checkpoints for tests and benchmarks (no files involved).

Tensors follow the usual initialisation: normal(0, 0.02) for matrices and embeddings, ones
(or zeros, for a ``(1 + w)`` norm) for norm weights, zeros for biases, all drawn from one
`torch.Generator` in sorted name order, so a (config, seed) pair always gives the same
weights. Which tensor is which comes from the model family (`Family.tensor_init`); a
family that does not say falls back to name suffixes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

from llmrt.errors import CheckpointError

INIT_STD = 0.02
NORM_SUFFIXES = ("norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight")


TensorInit = Literal["normal", "ones", "zeros"]


def _by_suffix(name: str) -> TensorInit:
    if name.endswith(NORM_SUFFIXES):
        return "ones"
    return "zeros" if name.endswith(".bias") else "normal"


def random_tensors(
    *,
    shapes: Mapping[str, tuple[int, ...]],
    seed: int,
    init: Mapping[str, TensorInit] | None = None,
) -> dict[str, torch.Tensor]:
    """One float32 CPU tensor per name in `shapes`, seeded by `seed`, filled per `init`."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    tensors = {}
    for name in sorted(shapes):
        shape = tuple(shapes[name])
        if any(not isinstance(d, int) or d < 0 for d in shape):
            raise CheckpointError(name, f"expected shape must be non-negative ints, got {shape}")
        how = init[name] if init is not None and name in init else _by_suffix(name)
        if how == "ones":
            tensors[name] = torch.ones(shape, dtype=torch.float32)
        elif how == "zeros":
            tensors[name] = torch.zeros(shape, dtype=torch.float32)
        else:
            tensors[name] = torch.empty(shape, dtype=torch.float32).normal_(
                0.0, INIT_STD, generator=generator
            )
    return tensors


def random_config(
    *, model: Mapping[str, Any], vocab_size: int, bos_token_id: int, eos_token_id: int
) -> dict[str, Any]:
    """`model` as a config.json-style dict, with tokenizer-derived defaults filled in."""
    config = dict(model)
    if not isinstance(config.get("model_type"), str):
        raise CheckpointError("model.model_type", "missing field (random checkpoints need it)")
    config.setdefault("vocab_size", vocab_size)
    config.setdefault("bos_token_id", bos_token_id)
    config.setdefault("eos_token_id", eos_token_id)
    given = config["vocab_size"]
    if not isinstance(given, int) or given < vocab_size:
        raise CheckpointError(
            "model.vocab_size",
            f"must be an int >= {vocab_size} (the byte tokenizer's size), got {given!r}",
        )
    return config
