"""``llmrt check RECIPE|DIR``: prove an llmrt family against transformers.

Builds the recipe's architecture at a small random size (or loads the given Hugging Face
directory) in transformers and in llmrt on the same weights, then runs the same prompts
through both over the runtime's paths: a batched ragged prefill with a padding row,
chunked prefill, prefix-cached continuations next to fresh rows, and greedy decode
steps. Prints the largest logit difference per phase and whether greedy tokens agree;
exit status 0 only when every phase is within tolerance.

transformers is the reference, so this command needs it installed (it is not a runtime
dependency of llmrt).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from llmrt.errors import ConfigError
from llmrt.families.base import Family
from llmrt.families.layers import select_linear_kernel
from llmrt.families.registry import family_for_model_type
from llmrt.kernels.formats import dequantized
from llmrt.recipe.schema import BYTE_TOKENIZER_VOCAB_SIZE
from llmrt.weights.checkpoint import load_checkpoint

DEFAULT_TOLERANCE = 1e-4

#: Geometry a recipe's architecture is shrunk to (keys present in its model section only).
SMALL: dict[str, int] = {
    "hidden_size": 64,
    "n_embd": 64,
    "intermediate_size": 96,
    "n_inner": 96,
    "moe_intermediate_size": 48,
    "shared_expert_intermediate_size": 48,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts": 4,
}


#: The vocabulary a larger one is shrunk to (only the embedding and LM head depend on it).
SMALL_VOCAB = 512
#: Config keys holding token ids, kept inside a shrunk vocabulary.
TOKEN_ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id")


@attrs.frozen
class Phase:
    """One row of the report."""

    name: str
    prefill: float
    decode: float
    tokens_equal: bool


@attrs.frozen
class Report:
    """Per-phase differences against transformers and the verdict."""

    source: str
    family: str
    phases: tuple[Phase, ...]
    tolerance: float

    @property
    def ok(self) -> bool:
        return all(
            p.tokens_equal and p.prefill <= self.tolerance and p.decode <= self.tolerance
            for p in self.phases
        )

    def table(self) -> str:
        lines = [
            f"llmrt check: {self.source} (family {self.family}) vs transformers, "
            f"tolerance {self.tolerance:g}",
            f"{'phase':34s} {'prefill max|dlogit|':>20s} {'decode max|dlogit|':>20s}  tokens",
        ]
        for p in self.phases:
            lines.append(
                f"{p.name:34s} {p.prefill:20.3g} {p.decode:20.3g}  "
                f"{'equal' if p.tokens_equal else 'DIFFER'}"
            )
        lines.append("ok" if self.ok else "FAILED")
        return "\n".join(lines)


def small_config(model: Mapping[str, Any]) -> dict[str, Any]:
    """``model`` with its geometry shrunk to ``SMALL`` and its vocabulary to at most
    ``SMALL_VOCAB`` (token ids wrapped into it), keeping its options."""
    config = dict(model)
    for key, value in SMALL.items():
        if key in config:
            config[key] = value
    heads = config.get("num_attention_heads")
    kv = config.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int):
        config["num_key_value_heads"] = 1 if kv == 1 else (heads if kv >= heads else 2)
    if isinstance(config.get("num_experts_per_tok"), int):
        config["num_experts_per_tok"] = min(config["num_experts_per_tok"], 2)
    if isinstance(config.get("sliding_window"), int):
        config["sliding_window"] = min(config["sliding_window"], 8)
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][: config.get("num_hidden_layers", 2)]
    if isinstance(config.get("mlp_only_layers"), list):
        config["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < 2]
    vocab = config.get("vocab_size", BYTE_TOKENIZER_VOCAB_SIZE)
    if isinstance(vocab, int) and not isinstance(vocab, bool):
        config["vocab_size"] = vocab = min(vocab, SMALL_VOCAB)
        for key in TOKEN_ID_KEYS:
            if key in config:
                config[key] = _wrap_ids(config[key], vocab)
    return config


def _wrap_ids(value: Any, vocab: int) -> Any:
    """Token id(s) past a shrunk vocabulary wrapped into it (transformers rejects a padding
    id outside the embedding; the ids only label tokens in a random model)."""
    if isinstance(value, list):
        return [_wrap_ids(item, vocab) for item in value]
    if isinstance(value, int) and not isinstance(value, bool) and value >= vocab:
        return value % vocab
    return value


def reference_model(
    *, config: Mapping[str, Any] | None = None, directory: Path | None = None, seed: int = 0
) -> Any:
    """The transformers model: random from the raw ``config`` (norms and biases perturbed;
    ``llmrt.testing.parity.reference_model``) or loaded from ``directory``; float32, eager
    attention."""
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - transformers is a dev dependency
        raise ConfigError(
            "check", "transformers", "llmrt check needs transformers installed"
        ) from exc
    from llmrt.testing import parity

    if directory is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, attn_implementation="eager"
        )
        return model.eval()
    assert config is not None
    return parity.reference_model(config, seed=seed)


def run_check(
    *,
    family: Family,
    hf_model: Any,
    hf_config: Mapping[str, Any] | None = None,
    source: str,
    steps: int = 32,
    tolerance: float = DEFAULT_TOLERANCE,
    seed: int = 0,
    directory: Path | None = None,
) -> Report:
    """Build ``family``'s model from ``hf_model``'s weights and compare phase by phase.

    llmrt reads the raw ``hf_config`` (the mapping ``hf_model`` was made from), never
    transformers' filled-in ``config.to_dict()``: the runtime reads the raw one, so a family
    that reads a default differently from transformers must fail here. With ``directory``
    (the checkpoint ``hf_model`` was loaded from) llmrt reads the directory's files and
    ``config.json`` as the runtime does, names and all.
    """
    from llmrt.testing.parity import Harness

    if directory is None:
        if hf_config is None:
            raise ConfigError("hf_config", None, "is required (the raw config of hf_model)")
        tensors = hf_model.state_dict()
    else:
        checkpoint = load_checkpoint(format="safetensors", path=directory)
        hf_config, tensors = checkpoint.hf_config, dequantized(checkpoint.tensors)
    model = family.build(hf_config=hf_config, tensors=tensors, dtype=torch.float32, device="cpu")
    select_linear_kernel(model, choice="auto", device=torch.device("cpu"), dtype=torch.float32)
    harness = Harness(hf_model=hf_model, model=model, vocab_size=model.config.vocab_size, seed=seed)
    phases = []
    schedules: Sequence[tuple[str, list[int], dict[str, Any]]] = (
        ("batched ragged prefill + pad row", [5, 17, 1, 11], {"pad_row": True}),
        ("chunked prefill", [19, 10], {"cuts": [[5, 10, 15], [3, 6, 9]]}),
        (
            "prefix-cached next to fresh rows",
            [14, 9, 12],
            {"cuts": [[8], [], [6]], "align": "end"},
        ),
    )
    for name, lengths, options in schedules:
        prompts = [harness.prompt(n, seed=40 + n) for n in lengths]
        runs = harness.greedy(prompts, steps=steps, **options)
        prefill = decode = 0.0
        equal = True
        for prompt, run in zip(prompts, runs, strict=True):
            ref = harness.reference(prompt, steps=steps)
            diff = (run.logits - ref.logits).abs().amax(dim=-1)
            prefill = max(prefill, float(diff[0]))
            if len(diff) > 1:
                decode = max(decode, float(diff[1:].max()))
            equal = equal and run.tokens == ref.tokens
        phases.append(Phase(name=name, prefill=prefill, decode=decode, tokens_equal=equal))
    return Report(source=source, family=family.name, phases=tuple(phases), tolerance=tolerance)


def check_target(
    target: str,
    *,
    overrides: Sequence[str] = (),
    steps: int = 32,
    tolerance: float = DEFAULT_TOLERANCE,
    full_size: bool = False,
) -> Report:
    """``llmrt check`` on a recipe (name or path) or a Hugging Face checkpoint directory."""
    path = Path(target).expanduser()
    if path.is_dir():
        raw = json.loads((path / "config.json").read_text())
        family = family_for_model_type(str(raw.get("model_type")))
        return run_check(
            family=family,
            hf_model=reference_model(directory=path),
            source=str(path),
            directory=path,
            steps=steps,
            tolerance=tolerance,
        )
    from llmrt.recipe.loader import load_recipe

    recipe = load_recipe(target, overrides=list(overrides))
    spec = recipe.checkpoint
    if spec.format == "safetensors" and spec.path:
        directory = Path(spec.path).expanduser()
        raw = json.loads((directory / "config.json").read_text())
        return run_check(
            family=recipe.family_for(str(raw.get("model_type"))),
            hf_model=reference_model(directory=directory),
            source=f"recipe {recipe.name} ({directory})",
            directory=directory,
            steps=steps,
            tolerance=tolerance,
        )
    if spec.format != "random":
        raise ConfigError(
            "checkpoint.format",
            spec.format,
            "llmrt check compares random recipes or Hugging Face directories "
            "(a GGUF file has no transformers reference here)",
        )
    model = {key: value for key, value in recipe.model.items() if key != "parts"}
    config = model if full_size else small_config(model)
    parts = recipe.declared_parts
    layers = config.get("num_hidden_layers")
    if parts is not None and isinstance(layers, int):
        # Keep every layer the parts name by index (a shrunk model must still have them).
        config["num_hidden_layers"] = max(layers, parts.layers_named())
    model_type = str(config["model_type"])
    return run_check(
        family=recipe.family_for(model_type),
        hf_model=reference_model(config=config, seed=spec.seed),
        hf_config=config,
        source=f"recipe {recipe.name} ({model_type})",
        steps=steps,
        tolerance=tolerance,
        seed=spec.seed,
    )
