"""The Hugging Face transformers baseline, built from the same checkpoint llmrt serves.

The model comes from ``AutoConfig.for_model(**checkpoint.hf_config)`` with the
checkpoint's own tensors loaded (float32, eval mode, tied embeddings re-tied), so any
difference from llmrt is the runtime, never the weights. A tensor the HF model would
leave at its random initialisation is an error, not a silent mismatch.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import attrs
import torch

from llmrt.benchmarks.timing import Timed, progress
from llmrt.errors import CheckpointError, UnsupportedError
from llmrt.kernels.formats import dequantized
from llmrt.weights.checkpoint import Checkpoint


def require_transformers() -> ModuleType:
    try:
        import transformers
    except ImportError:
        raise UnsupportedError(
            "the Hugging Face baseline needs transformers: pip install transformers"
        ) from None
    return transformers


def build_hf_model(checkpoint: Checkpoint, *, device: torch.device) -> Any:
    """An HF causal LM (float32, eval) holding exactly ``checkpoint``'s tensors (dequantized)."""
    tf = require_transformers()
    model_type = checkpoint.hf_config.get("model_type")
    try:
        config = tf.AutoConfig.for_model(**checkpoint.hf_config)
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (ValueError, KeyError) as exc:  # transformers' "Unrecognized model identifier"
        reason = str(exc).split(". ")[0][:120]  # not its list of every model type
        raise UnsupportedError(
            f"the Hugging Face baseline has no causal LM for model_type {model_type!r} in "
            f"transformers {tf.__version__} ({reason})"
        ) from None
    missing, unexpected = model.load_state_dict(dequantized(checkpoint.tensors), strict=False)
    model.tie_weights()
    if unexpected:
        raise CheckpointError(
            unexpected[0], f"has no place in {type(model).__name__} (HF baseline)"
        )
    tied = _tied_names(model)
    untouched = [name for name in missing if name not in tied]
    if untouched:
        raise CheckpointError(untouched[0], f"missing for the HF baseline {type(model).__name__}")
    return model.to(device=device, dtype=torch.float32).eval()


def _tied_names(model: Any) -> set[str]:
    """Parameter names that share storage with another parameter (tied embeddings)."""
    seen: dict[int, str] = {}
    tied: set[str] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.update({name, seen[id(param)]})
        else:
            seen[id(param)] = name
    return tied


def cache_argument(model: Any) -> str:
    """The forward argument for the KV cache (``cache`` in transformers 5)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@attrs.frozen(kw_only=True)
class HFRun:
    """Greedy generation results in prompt order; times are ``perf_counter`` values."""

    token_ids: tuple[tuple[int, ...], ...]
    token_times: tuple[tuple[float, ...], ...]
    start: float
    wall_s: float


def _step_clock(tf: ModuleType) -> Any:
    """A stopping criterion that never stops and records when each token was produced."""

    class StepClock(tf.StoppingCriteria):  # type: ignore[name-defined]
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StepClock()


def hf_generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    batch_size: int,
    pad_token_id: int,
) -> HFRun:
    """Greedy ``model.generate`` in batches of ``batch_size``: left padding + attention mask.

    EOS is disabled (``eos_token_id=None``) so every row generates exactly
    ``max_new_tokens``, like llmrt with ``ignore_eos``: an EOS argmax is kept and generation
    goes on (``min_new_tokens`` alone would ban EOS and pick another token).
    """
    tf = require_transformers()
    device = next(model.parameters()).device
    # generate() fills unset fields from the model's own generation config: clear EOS there.
    model.generation_config.eos_token_id = None
    config = tf.GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=pad_token_id,
    )
    tokens: list[tuple[int, ...]] = []
    times: list[tuple[float, ...]] = []
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    start = time.perf_counter()
    for batch in progress(batches, desc="hf generate"):
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        clock = _step_clock(tf)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                generation_config=config,
                stopping_criteria=tf.StoppingCriteriaList([clock]),
            )
        new = out[:, width:].tolist()
        for row, generated in enumerate(new):
            if len(generated) != max_new_tokens or len(clock.times) != max_new_tokens:
                raise RuntimeError(
                    f"HF baseline produced {len(generated)} tokens for prompt "
                    f"{len(tokens) + row}, expected {max_new_tokens}"
                )
        tokens.extend(tuple(g) for g in new)
        times.extend(tuple(clock.times) for _ in batch)
    return HFRun(
        token_ids=tuple(tokens),
        token_times=tuple(times),
        start=start,
        wall_s=time.perf_counter() - start,
    )


def hf_decode_call(model: Any, *, context: torch.Tensor) -> Timed:
    """One bare decode step over a prefilled ``DynamicCache``, cropped back after each step.

    ``context`` is ``[B, n]`` token ids; every step feeds ``[B, 1]`` at position ``n``.
    """
    field = cache_argument(model)
    length = context.shape[1]
    with torch.no_grad():
        cache = model(input_ids=context, use_cache=True, logits_to_keep=1)[field]
    step = context[:, -1:].clone()

    def run() -> None:
        with torch.no_grad():
            model(input_ids=step, use_cache=True, **{field: cache})

    def after() -> None:
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)  # a negative count removes tokens (transformers 4 and 5)

    return Timed(run=run, after=after)


def hf_prefill_call(model: Any, *, tokens: torch.Tensor) -> Timed:
    """One prompt forward (fresh cache, last-token logits, as ``generate`` runs it)."""

    def run() -> None:
        with torch.no_grad():
            model(input_ids=tokens, use_cache=True, logits_to_keep=1)

    return Timed(run=run)
