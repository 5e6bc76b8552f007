"""Token sampling shared by prefill and decode, host path and device path alike.

One batch step is::

    tensors = SamplingTensors.from_params(params, batch_size=B, vocab_size=V, device=dev)
    logits = apply_penalties(logits, tensors=tensors, prompt_counts=..., output_counts=...)
    result = sample(logits, tensors, step_offsets=steps, generator=gen)

``sample`` scales by temperature, then filters top-k, top-p and min-p (Hugging Face's
order; vLLM v1 applies min-p before top-k/top-p), then draws with the Gumbel-max trick
(equivalently the exponential race ``argmax(p / E)``): ``argmax(logits / T + G)``. Greedy
rows (temperature 0, or no params) take ``argmax(logits)``, ties to the lowest id.

Seeded rows draw their noise from a CPU ``torch.Generator`` seeded by a fixed mix of
``(seed, step)``, so a seeded row gets the same token at the same step whatever batch it
is in, whichever row it occupies, and on whichever device the logits live. Unseeded rows
share the caller's ``generator`` (one batched draw, no per-row work), which must live on the
logits' device (``device_generator``): torch rejects a CPU generator for a CUDA tensor.

Traced programs keep persistent ``SamplingTensors`` (``to_device`` once; built with
``all_features=True`` or with the features in the program's identity, ``features()``)
and ``persistent.refresh_from(fresh, device.refresh)`` before each replay. Seeded rows
read their seeds and step offsets on the host (a device sync), so a program captured as
a device graph with seeded rows takes ``noise=`` (from ``gumbel_noise``, drawn before
the replay) instead of drawing inside the graph.

Log-probabilities are ``log_softmax`` of the logits given to ``sample`` (after penalties
when the caller applied them, before temperature and filters): vLLM's ``raw_logprobs``
for requests without penalties, and before a structured-output mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import torch
from torch import Tensor

from llmrt.errors import DeviceError, RequestError
from llmrt.sampling.params import GREEDY_TEMPERATURE, MAX_LOGPROBS, SamplingParams
from llmrt.sampling.structured import bitmask_to_allowed

__all__ = [
    "GREEDY_TEMPERATURE",
    "MAX_LOGPROBS",
    "SampleResult",
    "SamplingParams",
    "SamplingTensors",
    "apply_penalties",
    "gumbel_noise",
    "mix_seed",
    "sample",
    "token_counts",
]

_MASK64 = (1 << 64) - 1
_TINY = torch.finfo(torch.float32).tiny


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(*, seed: int, step: int) -> int:
    """The 64-bit generator seed of a seeded row at output index ``step`` (SplitMix64)."""
    return _splitmix64((_splitmix64(seed & _MASK64) + step) & _MASK64)


_TENSOR_FIELDS = (
    "temperature",
    "greedy",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seeds",
    "seeded",
)


def _as_int64(seed: int) -> int:
    """``seed`` modulo 2**64 as a signed int64 (``mix_seed`` reads it back modulo 2**64)."""
    return ((seed & _MASK64) ^ (1 << 63)) - (1 << 63)


@attrs.frozen(kw_only=True, eq=False)
class SamplingTensors:
    """Per-row sampling parameters of one physical batch as tensors (owns them).

    Rows past ``len(params)`` and rows whose params are None are greedy with neutral
    filters and penalties. Every per-row value lives in a tensor, so ``refresh_from``
    makes a persistent object fully current. The ``any_*`` / ``all_greedy`` flags and
    ``num_top_logprobs`` (the column count of ``SampleResult.top_logprobs``) are fixed:
    they say which work ``sample`` does, and are part of a program's identity
    (``features()``).
    """

    batch_size: int
    vocab_size: int
    device: torch.device
    temperature: Tensor  # float32 [B]; 1.0 on greedy rows
    greedy: Tensor  # bool [B]
    top_k: Tensor  # int64 [B] in [1, V]; V where disabled
    top_p: Tensor  # float32 [B]
    min_p: Tensor  # float32 [B]
    repetition_penalty: Tensor  # float32 [B]
    presence_penalty: Tensor  # float32 [B]
    frequency_penalty: Tensor  # float32 [B]
    seeds: Tensor  # int64 [B]: the seed modulo 2**64 (two's complement); 0 where unseeded
    seeded: Tensor  # bool [B]: False on unseeded and greedy rows
    allowed: Tensor | None  # bool [B, V]: the tokens structured rows may take; None: all
    want_logprobs: bool
    num_top_logprobs: int
    all_greedy: bool
    any_seeded: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalties: bool

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams | None],
        *,
        batch_size: int,
        vocab_size: int,
        device: torch.device | str,
        all_features: bool = False,
    ) -> SamplingTensors:
        """Build the batch's tensors (three host-to-device copies), padded to ``batch_size``.

        ``all_features=True`` sets every flag, for persistent buffers that any later
        batch of the same shape can be refreshed into.
        """
        if not isinstance(batch_size, int) or batch_size < 1:
            raise RequestError("batch_size", "must be a positive integer", value=batch_size)
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise RequestError("vocab_size", "must be a positive integer", value=vocab_size)
        if len(params) > batch_size:
            raise RequestError(
                "sampling_params",
                f"{len(params)} rows do not fit the physical batch of {batch_size}",
                value=len(params),
            )
        rows: list[SamplingParams | None] = [*params, *([None] * (batch_size - len(params)))]
        floats: list[list[float]] = [[] for _ in range(6)]
        flags: list[list[bool]] = [[], []]  # greedy, seeded
        ints: list[list[int]] = [[], []]  # top_k, seeds
        logprob_counts: list[int] = []
        for i, p in enumerate(rows):
            if p is not None and not isinstance(p, SamplingParams):
                raise RequestError(
                    "sampling_params", "must be SamplingParams or None", row=i, value=type(p)
                )
            if p is not None and p.logprobs is not None:
                logprob_counts.append(min(int(p.logprobs), vocab_size))
            if p is None or p.greedy:
                shaping = (1.0, 1.0, 0.0)
                row_flags, row_ints = (True, False), (vocab_size, 0)
            else:
                shaping = (float(p.temperature), float(p.top_p), float(p.min_p))
                top_k = min(int(p.top_k), vocab_size) if p.top_k_enabled else vocab_size
                seed = None if p.seed is None else _as_int64(int(p.seed))
                row_flags = (False, seed is not None)
                row_ints = (top_k, 0 if seed is None else seed)
            penalties = (
                (1.0, 0.0, 0.0)
                if p is None
                else (
                    float(p.repetition_penalty),
                    float(p.presence_penalty),
                    float(p.frequency_penalty),
                )
            )
            for column, value in zip(floats, (*shaping, *penalties), strict=True):
                column.append(value)
            for flag_column, flag in zip(flags, row_flags, strict=True):
                flag_column.append(flag)
            for int_column, number in zip(ints, row_ints, strict=True):
                int_column.append(number)
        allowed = _allowed_tokens(rows, vocab_size=vocab_size)
        f = torch.tensor(floats, dtype=torch.float32).to(device)
        dev = f.device
        temperature, top_p, min_p, repetition, presence, frequency = f.unbind(0)
        greedy, seeded = torch.tensor(flags, dtype=torch.bool).to(dev).unbind(0)
        top_k_t, seeds = torch.tensor(ints, dtype=torch.int64).to(dev).unbind(0)
        return cls(
            batch_size=batch_size,
            vocab_size=vocab_size,
            device=dev,
            temperature=temperature,
            greedy=greedy,
            top_k=top_k_t,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition,
            presence_penalty=presence,
            frequency_penalty=frequency,
            seeds=seeds,
            seeded=seeded,
            allowed=None if allowed is None else torch.from_numpy(allowed).to(dev),
            want_logprobs=all_features or bool(logprob_counts),
            num_top_logprobs=(
                min(MAX_LOGPROBS, vocab_size) if all_features else max(logprob_counts, default=0)
            ),
            all_greedy=not all_features and all(flags[0]),
            any_seeded=all_features or any(flags[1]),
            any_top_k=all_features or any(k < vocab_size for k in ints[0]),
            any_top_p=all_features or any(v < 1.0 for v in floats[1]),
            any_min_p=all_features or any(v > 0.0 for v in floats[2]),
            any_penalties=all_features or any(p is not None and p.has_penalties for p in rows),
        )

    def features(self) -> tuple[str, ...]:
        """The work ``sample`` does for this object, in a fixed order (a program identity)."""
        named = (
            ("random", not self.all_greedy),
            ("seeded", self.any_seeded),
            ("top_k", self.any_top_k),
            ("top_p", self.any_top_p),
            ("min_p", self.any_min_p),
            ("penalties", self.any_penalties),
            ("logprobs", self.want_logprobs),
            (f"top{self.num_top_logprobs}", self.num_top_logprobs > 0),
        )
        return tuple(name for name, on in named if on)

    def to_device(self, upload: Callable[[Tensor], Tensor]) -> SamplingTensors:
        """A copy whose tensors are ``upload(tensor)`` (owned by whoever ``upload`` gives
        them to, e.g. a device port); flags are kept."""
        moved: dict[str, Any] = {name: upload(getattr(self, name)) for name in _TENSOR_FIELDS}
        if self.allowed is not None:
            moved["allowed"] = upload(self.allowed)
        return attrs.evolve(self, device=moved["temperature"].device, **moved)

    def refresh_from(
        self, source: SamplingTensors, refresh: Callable[[Tensor, Tensor], None] | None = None
    ) -> None:
        """Overwrite this object's tensors in place with ``source``'s values (same shapes).

        ``refresh(dst, src)`` does each copy (default ``dst.copy_(src)``; a device port's
        ``refresh`` for host-to-device). This object must do at least the work
        ``source`` needs: its features cover ``source.features()``.
        """
        for name, mine, theirs in (
            ("batch_size", self.batch_size, source.batch_size),
            ("vocab_size", self.vocab_size, source.vocab_size),
        ):
            if mine != theirs:
                raise RequestError(
                    name, f"persistent sampling tensors have {name}={mine}", value=theirs
                )
        needed = set(source.features()) - set(self.features())
        if source.num_top_logprobs <= self.num_top_logprobs:
            needed.discard(f"top{source.num_top_logprobs}")
        if source.allowed is not None:
            needed.add("structured")  # a per-step mask is never baked into persistent tensors
        if needed:
            raise RequestError(
                "sampling_features",
                "the persistent sampling tensors skip work this batch needs "
                "(build them with all_features=True)",
                value=tuple(sorted(needed)),
            )
        for name in _TENSOR_FIELDS:
            dst, src = getattr(self, name), getattr(source, name)
            if refresh is None:
                dst.copy_(src)
            else:
                refresh(dst, src)


@attrs.frozen(kw_only=True, eq=False)
class SampleResult:
    """One sampled token per row, with log-probabilities when any row asked for them.

    ``logprobs`` [B] is the chosen token's log-probability; ``top_logprobs`` is
    ``(values [B, N], ids [B, N])``, largest first, N = ``tensors.num_top_logprobs``.
    Rows that did not ask get values too; callers slice per row.
    """

    tokens: Tensor  # int64 [B]
    logprobs: Tensor | None = None
    top_logprobs: tuple[Tensor, Tensor] | None = None


def token_counts(token_ids: Tensor, *, vocab_size: int, pad_id: int = -1) -> Tensor:
    """Per-row occurrence counts ``int32 [B, vocab_size]`` of padded ids ``[B, L]``.

    Entries equal to ``pad_id`` are ignored; other ids must lie in ``[0, vocab_size)``.
    """
    if token_ids.dim() != 2:
        raise RequestError("token_ids", "must be [batch, length]", value=tuple(token_ids.shape))
    ids = torch.where(token_ids == pad_id, vocab_size, token_ids.long())
    counts = torch.zeros(
        (token_ids.shape[0], vocab_size + 1), dtype=torch.int32, device=token_ids.device
    )
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: Tensor,
    *,
    tensors: SamplingTensors,
    prompt_counts: Tensor | None = None,
    output_counts: Tensor | None = None,
) -> Tensor:
    """Repetition, presence and frequency penalties with vLLM semantics.

    Repetition applies to tokens seen in the prompt or the output (positive logits are
    divided by the penalty, the rest multiplied); presence and frequency subtract
    ``presence * (count > 0) + frequency * count`` over output tokens only. Counts are
    ``[B, V]`` (see ``token_counts``); a persistent decode loop can keep them and
    ``scatter_add_`` each new token. Entries not penalised stay bit-identical. Returns
    ``logits`` itself when the batch has no penalties, a new tensor otherwise.
    """
    _check_logits(logits, tensors)
    for name, counts in (("prompt_counts", prompt_counts), ("output_counts", output_counts)):
        if counts is not None:
            _check_shape(name, counts, tuple(logits.shape))
            if counts.device != logits.device:
                raise RequestError(
                    name, f"must be on the logits' device {logits.device}", value=str(counts.device)
                )
    if not tensors.any_penalties or (prompt_counts is None and output_counts is None):
        return logits
    out_seen = None if output_counts is None else output_counts > 0
    seen: Tensor | None = out_seen
    if prompt_counts is not None:
        seen = prompt_counts > 0 if seen is None else (prompt_counts > 0) | seen
    rep = tensors.repetition_penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    out = logits if seen is None else torch.where(seen, penalised, logits)
    if output_counts is not None and out_seen is not None:
        count = output_counts.to(torch.float32)
        shifted = (out - tensors.frequency_penalty.unsqueeze(1) * count) - (
            tensors.presence_penalty.unsqueeze(1)
        )
        out = torch.where(out_seen, shifted, out)
    return out


def device_generator(device: torch.device | str, *, seed: int = 0) -> torch.Generator:
    """The generator unseeded rows draw from on ``device`` (a CUDA tensor needs a CUDA one)."""
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def _check_generator(generator: torch.Generator | None, device: torch.device) -> None:
    if generator is None:
        return
    placed = torch.device(generator.device)
    if placed.type != device.type or (
        placed.index is not None and device.index is not None and placed.index != device.index
    ):
        raise DeviceError(
            f"gumbel_noise: the generator is on {placed} but the noise is drawn on {device} "
            "(torch rejects a generator on another device; use device_generator)"
        )


def gumbel_noise(
    tensors: SamplingTensors,
    *,
    step_offsets: Tensor | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Gumbel noise ``float32 [B, V]`` on ``tensors.device`` for one sampling step.

    Unseeded rows come from one batched draw on ``generator`` (the device's default
    generator when None). Each seeded row is drawn on the CPU from its own generator
    seeded with ``mix_seed(seed=row seed, step=step_offsets[row])`` and copied over, so
    it does not depend on the batch, the row position or the device.
    """
    shape = (tensors.batch_size, tensors.vocab_size)
    _check_generator(generator, torch.device(tensors.device))
    exp = torch.empty(shape, dtype=torch.float32, device=tensors.device)
    noise = exp.exponential_(generator=generator).clamp_min_(_TINY).log_().neg_()
    if not tensors.any_seeded:
        return noise
    rows = [int(r) for r in tensors.seeded.nonzero().flatten().tolist()]
    if not rows:
        return noise
    seeds = [int(v) for v in tensors.seeds[rows].tolist()]
    if step_offsets is None:
        raise RequestError("step_offsets", "required when a row is seeded")
    if isinstance(step_offsets, Tensor):
        _check_shape("step_offsets", step_offsets, (tensors.batch_size,))
        steps = [int(v) for v in step_offsets[rows].tolist()]
    else:
        if len(step_offsets) != tensors.batch_size:
            raise RequestError(
                "step_offsets", f"must have {tensors.batch_size} entries", value=len(step_offsets)
            )
        steps = [int(step_offsets[r]) for r in rows]
    host = torch.empty((len(rows), tensors.vocab_size), dtype=torch.float32)
    for j, (row, seed, step) in enumerate(zip(rows, seeds, steps, strict=True)):
        if step < 0:
            raise RequestError("step_offsets", "must be >= 0", row=row, value=step)
        g = torch.Generator()
        g.manual_seed(mix_seed(seed=seed, step=step))
        host[j].exponential_(generator=g)
    host.clamp_min_(_TINY).log_().neg_()
    index = torch.tensor(rows, dtype=torch.int64, device=tensors.device)
    noise.index_copy_(0, index, host.to(tensors.device))
    return noise


#: Logit dtypes ``greedy_argmax`` hands to numpy on the CPU.
_NUMPY_ARGMAX_DTYPES = (torch.float32, torch.float64)


def greedy_argmax(x: Tensor) -> Tensor:
    """``x.argmax(dim=-1)`` (int64; ties and NaN to the lowest index, as torch), through
    numpy for CPU float32 logits outside compiled code. Why: torch's CPU argmax reads ~1 G
    elements/s, so a 49,152-token vocabulary costs 77 us a row and 0.35 ms at batch 8,
    against 5 and 37 us for numpy's SIMD argmax (measured on a 2-core EPYC); that is a
    visible share of a 4.4 ms decode step."""
    if (
        x.device.type != "cpu"
        or x.dtype not in _NUMPY_ARGMAX_DTYPES
        or x.dim() == 0
        or x.shape[-1] == 0
        or torch.compiler.is_compiling()
    ):
        return x.argmax(dim=-1)
    return torch.from_numpy(np.asarray(x.detach().numpy().argmax(axis=-1), dtype=np.int64))


def sample(
    logits: Tensor,
    tensors: SamplingTensors,
    *,
    step_offsets: Tensor | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
) -> SampleResult:
    """Draw one token per row from float32 ``logits [B, V]``.

    ``step_offsets[b]`` is the output index of the token being generated (seeds mix it
    in; required only when a row is seeded). ``noise`` (from ``gumbel_noise``) replaces
    the draw, for traced programs; otherwise it is drawn here.
    """
    _check_logits(logits, tensors)
    logprobs: Tensor | None = None
    top: tuple[Tensor, Tensor] | None = None
    raw = logits
    if tensors.allowed is not None:
        # Structured rows: what would break the output is impossible (before temperature
        # and filters, as vLLM applies its grammar bitmask). Log-probabilities stay those of
        # the unmasked logits (vLLM's raw_logprobs), never -inf for a masked top token.
        logits = logits.masked_fill(~tensors.allowed, -math.inf)
    greedy_tokens = greedy_argmax(logits)
    if tensors.all_greedy:
        tokens = greedy_tokens
    else:
        if noise is None:
            noise = gumbel_noise(tensors, step_offsets=step_offsets, generator=generator)
        else:
            _check_shape("noise", noise, tuple(logits.shape))
        scores = _filtered(logits / tensors.temperature.unsqueeze(1), tensors)
        sampled = greedy_argmax(scores.add_(noise))
        tokens = torch.where(tensors.greedy, greedy_tokens, sampled)
    if tensors.want_logprobs:
        all_logprobs = torch.log_softmax(raw, dim=-1)
        logprobs = all_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        if tensors.num_top_logprobs > 0:
            values, ids = all_logprobs.topk(tensors.num_top_logprobs, dim=-1)
            top = (values, ids)
    return SampleResult(tokens=tokens, logprobs=logprobs, top_logprobs=top)


def _allowed_tokens(rows: Sequence[SamplingParams | None], *, vocab_size: int) -> np.ndarray | None:
    """Bool ``[B, V]`` of the tokens each row may take next (all on unconstrained rows), or
    None when no row is constrained; each constrained row's constraint fills its mask."""
    constrained = [i for i, p in enumerate(rows) if p is not None and p.constraint is not None]
    for i, p in enumerate(rows):
        if p is not None and p.structured_output is not None and p.constraint is None:
            raise RequestError(
                "structured_output",
                "has no constraint bound (the engine compiles one per request; pass the "
                "request through LLM or the engine)",
                row=i,
            )
    if not constrained:
        return None
    bitmask = np.full((len(rows), (vocab_size + 31) // 32), -1, dtype=np.int32)
    for i in constrained:
        constraint = rows[i].constraint  # type: ignore[union-attr]
        assert constraint is not None
        bitmask[i] = 0
        constraint.fill_bitmask(bitmask, i)
    return bitmask_to_allowed(bitmask, vocab_size)


def _filtered(scaled: Tensor, tensors: SamplingTensors) -> Tensor:
    """Mask (to -inf, in place) what top-k, then top-p, then min-p drop; keeps each row's max."""
    if tensors.any_top_k or tensors.any_top_p:
        ascending, order = scaled.sort(dim=-1, stable=True)
        if tensors.any_top_k:
            kth = ascending.gather(1, (tensors.vocab_size - tensors.top_k).unsqueeze(1))
            ascending.masked_fill_(ascending < kth, -math.inf)
        if tensors.any_top_p:
            cumulative = ascending.softmax(dim=-1).cumsum_(dim=-1)
            drop = cumulative <= (1.0 - tensors.top_p).unsqueeze(1)
            drop[:, -1] = False
            ascending.masked_fill_(drop, -math.inf)
        scaled = scaled.scatter_(1, order, ascending)
    if tensors.any_min_p:
        floor = scaled.amax(dim=-1, keepdim=True) + tensors.min_p.log().unsqueeze(1)
        scaled.masked_fill_(scaled < floor, -math.inf)
    return scaled


def _check_logits(logits: Tensor, tensors: SamplingTensors) -> None:
    _check_shape("logits", logits, (tensors.batch_size, tensors.vocab_size))
    if logits.dtype != torch.float32:
        raise RequestError("logits", "must be float32", value=logits.dtype)
    if logits.device != tensors.device:
        raise RequestError(
            "logits", f"must be on the sampling device {tensors.device}", value=logits.device
        )


def _check_shape(name: str, tensor: Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise RequestError(name, f"must have shape {expected}", value=tuple(tensor.shape))
