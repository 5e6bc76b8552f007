"""``DecoderFamily``: a family as a config mapping onto the parts catalogue.

A family module supplies one function, ``read(cfg, dtype) -> (DecoderSpec, TensorNames)``,
that maps a Hugging Face ``config.json`` onto parts and checkpoint names (rejecting, by
field, every option it does not implement), plus what the registry records about it:
model types, the config keys a random checkpoint needs, the backends it runs on and, from a
package, any GGUF architecture it adds. Shapes, random initialisation, validation and the
model itself all follow from the spec.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs
import torch

from llmrt.errors import CheckpointError
from llmrt.families import registry
from llmrt.families.base import ModelConfig
from llmrt.families.causal_lm import PagedCausalLM
from llmrt.families.decoder import TensorInit, TensorNames, TensorPlan, build_decoder, tensor_plan
from llmrt.families.experts import fuse_experts
from llmrt.families.gguf_architecture import GGUFArchitecture
from llmrt.families.hfconfig import HFConfig
from llmrt.families.parts import DecoderSpec
from llmrt.families.tensors import check_tensors
from llmrt.families.ttnn_model import TtnnCausalLM, check_ttnn_parts
from llmrt.kernels.formats import CheckpointTensor, QuantizedWeight

Tensors = Mapping[str, CheckpointTensor]
SpecReader = Callable[[HFConfig, torch.dtype], tuple[DecoderSpec, TensorNames]]


class Renamer(Protocol):
    """A family's checkpoint names -> the ones its ``TensorNames`` give: ``expected`` is
    the plan (name -> shape) the tensors are checked against, ``config`` the checkpoint's
    raw ``config.json`` (what a layout change may depend on: head counts, a flag)."""

    def __call__(
        self,
        tensors: Tensors,
        *,
        expected: Mapping[str, tuple[int, ...]],
        config: Mapping[str, Any],
    ) -> Mapping[str, CheckpointTensor]: ...


@attrs.frozen(kw_only=True)
class DecoderFamily:
    """A ``Family`` whose models are the shared decoder built from ``read``'s parts.

    ``required_keys`` are the ``config.json`` keys a random checkpoint of each model type
    must give (``recipes validate`` checks them before anything loads);
    ``gguf`` says how it reads GGUF files of an architecture llama.cpp's table in the
    weights layer lacks (its ``general.architecture``, config, tensor names and layouts; a
    package's family; None: only the table's files whose ``model_type`` it claims);
    ``rename`` maps a checkpoint's own tensor names onto ``read``'s (after the per-expert
    weights are stacked for every family; see ``rename_tensors``);
    ``architectures`` the Hugging Face class names (``config.json`` ``architectures``)
    of its checkpoints, which vLLM's plugin registers; ``backends`` the device backends
    that can run it (on ttnn, ``build_ttnn`` refuses at build, naming it, any part the ttnn
    decoder lacks).
    """

    name: str
    model_types: tuple[str, ...]
    read: SpecReader
    required_keys: tuple[str, ...]
    ignored_suffixes: tuple[str, ...] = ()
    rename: Renamer | None = None
    gguf: GGUFArchitecture | None = None
    architectures: tuple[str, ...] = ()
    backends: tuple[str, ...] = ("torch", "ttnn")

    @property
    def gguf_architecture(self) -> str | None:
        """The GGUF ``general.architecture`` this family reads (None: none)."""
        return None if self.gguf is None else self.gguf.name

    def spec(self, hf_config: Mapping[str, Any], *, dtype: torch.dtype) -> DecoderSpec:
        """The parts ``hf_config`` maps onto (``CheckpointError`` naming a bad field)."""
        return self._read(hf_config, dtype)[0]

    def model_config(self, hf_config: Mapping[str, Any], *, dtype: torch.dtype) -> ModelConfig:
        """The runtime-facing config of the model ``build`` would return."""
        return self.spec(hf_config, dtype=dtype).model

    def tensor_plan(self, hf_config: Mapping[str, Any]) -> TensorPlan:
        """Names, shapes and random initialisation of every tensor the config needs."""
        spec, names = self._read(hf_config, torch.float32)
        return tensor_plan(spec, names)

    def expected_tensors(self, hf_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        """HF tensor names -> shapes this config needs (some may be ``optional_tensors``)."""
        return self.tensor_plan(hf_config).shapes

    def optional_tensors(self, hf_config: Mapping[str, Any]) -> frozenset[str]:
        """Names in ``expected_tensors`` that may be absent (a tied LM head)."""
        return self.tensor_plan(hf_config).optional

    def tensor_init(self, hf_config: Mapping[str, Any]) -> dict[str, TensorInit]:
        """How a random checkpoint fills each tensor (norm weights ones or zeros, biases zeros)."""
        return self.tensor_plan(hf_config).init

    def build(
        self,
        *,
        hf_config: Mapping[str, Any],
        tensors: Tensors,
        dtype: torch.dtype,
        device: Any,
    ) -> PagedCausalLM | TtnnCausalLM:
        """Validate config and every tensor, then build; raises ``CheckpointError`` first.
        ``device`` is a torch device, or a ttnn lane's port device (``build_ttnn``)."""
        if hasattr(device, "mesh_device"):  # a ttnn lane's port device
            return self.build_ttnn(hf_config=hf_config, tensors=tensors, device=device)
        spec, names = self._read(hf_config, dtype)
        plan = tensor_plan(spec, names)
        used = check_tensors(
            tensors=self.rename_tensors(tensors, expected=plan.shapes, config=hf_config),
            expected=plan.shapes,
            optional=plan.optional,
            ignored_suffixes=self.ignored_suffixes,
        )
        return build_decoder(spec=spec, names=names, tensors=used, device=torch.device(device))

    def build_ttnn(
        self,
        *,
        hf_config: Mapping[str, Any],
        tensors: Tensors,
        device: Any,
        weight_dtype: str = "bfloat8_b",
        cache_dir: Path | None = None,
    ) -> TtnnCausalLM:
        """The model on a ttnn lane (``device``: its ``TtnnDevice``, with ``mesh_device`` and
        ``ttnn_module``), weights converted once to ``weight_dtype`` (kept in ``cache_dir``
        for later builds when given); ``UnsupportedError``
        naming the first part the ttnn decoder lacks, before any weight moves."""
        spec, names = self._read(hf_config, torch.float32)
        plan = tensor_plan(spec, names)
        check_ttnn_parts(spec, names, family=self.name)
        used = check_tensors(
            tensors=self.rename_tensors(tensors, expected=plan.shapes, config=hf_config),
            expected=plan.shapes,
            optional=plan.optional,
            ignored_suffixes=self.ignored_suffixes,
        )
        dense = {
            name: t.dequantize() if isinstance(t, QuantizedWeight) else t
            for name, t in used.items()
        }
        return TtnnCausalLM(
            spec=spec,
            names=names,
            tensors=dense,
            mesh_device=device.mesh_device,
            ttnn_module=device.ttnn_module,
            weight_dtype=weight_dtype,
            cache_dir=cache_dir,
        )

    def rename_tensors(
        self,
        tensors: Tensors,
        *,
        expected: Mapping[str, tuple[int, ...]],
        config: Mapping[str, Any],
    ) -> dict[str, CheckpointTensor]:
        """Checkpoint names -> the plan's: per-expert weights stacked (``fuse_experts``, for
        every family), then the family's own ``rename``. The loader calls this too."""
        out = fuse_experts(tensors, expected=expected)
        if self.rename is None:
            return out
        return dict(self.rename(out, expected=expected, config=config))

    def _read(
        self, hf_config: Mapping[str, Any], dtype: torch.dtype
    ) -> tuple[DecoderSpec, TensorNames]:
        model_type = hf_config.get("model_type")
        if model_type is not None and model_type not in self.model_types:
            raise CheckpointError(
                "config.model_type",
                f"{model_type!r} is not handled by family {self.name!r} (accepts "
                f"{', '.join(self.model_types)}){registry.claimed_by(str(model_type))}",
            )
        return self.read(HFConfig(raw=hf_config), dtype)
