"""Checkpoint renames a family declares (``DecoderFamily.rename``) for names that older or
differently saved checkpoints use: GPT-2's bare base-model names, GPT-NeoX's ``embed_out``.

Each is a ``Renamer`` object built from data, so a family module states *which* names
differ, not how to walk a tensor dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from llmrt.errors import CheckpointError
from llmrt.kernels.formats import CheckpointTensor


@attrs.frozen
class BaseModelPrefix:
    """Bare base-model names (``h.0.attn...``, as GPT-2's original hub files hold them) get
    ``prefix`` where only the prefixed name is expected, as transformers' ``base_model_prefix``
    loading does; every other name passes through."""

    prefix: str

    def __call__(
        self,
        tensors: Mapping[str, CheckpointTensor],
        *,
        expected: Mapping[str, tuple[int, ...]],
        config: Mapping[str, Any],
    ) -> dict[str, CheckpointTensor]:
        renamed: dict[str, CheckpointTensor] = {}
        for name, tensor in tensors.items():
            prefixed = self.prefix + name
            key = prefixed if name not in expected and prefixed in expected else name
            if key in renamed:
                raise CheckpointError(
                    name, f"duplicates {key} (both prefixed and bare names given)"
                )
            renamed[key] = tensor
        return renamed


@attrs.frozen
class LegacyNames:
    """Old tensor names mapped onto the current ones (``{"embed_out.weight":
    "lm_head.weight"}``); a checkpoint holding both names of one tensor is a
    ``CheckpointError``."""

    names: Mapping[str, str]

    def __call__(
        self,
        tensors: Mapping[str, CheckpointTensor],
        *,
        expected: Mapping[str, tuple[int, ...]],
        config: Mapping[str, Any],
    ) -> dict[str, CheckpointTensor]:
        renamed = dict(tensors)
        for old, new in self.names.items():
            if old not in renamed:
                continue
            if new in renamed:
                raise CheckpointError(old, f"duplicates {new}")
            renamed[new] = renamed.pop(old)
        return renamed
