"""Parity harness: an llmrt model vs Hugging Face transformers on the same weights.

The harness allocates the paged KV cache itself (per-layer zeros or random bytes of
``[num_blocks, kv_heads, block_size, head_dim]``) and hands rows scattered,
non-contiguous block ids, so any page-table mistake shows up as a mismatch. The model may
live on any torch device (``Harness(device=...)``): inputs and the KV cache are placed there,
logits come back to the CPU, and transformers runs on the CPU in float32. It serves
the project's parity tests, the ``parity_harness`` fixture of the pytest plugin
(``llmrt.testing.plugin``) and ``llmrt check`` (``llmrt.cli.check``). transformers is only
needed for the reference runs (``hf_greedy``); nothing here imports it.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs
import torch

from llmrt.families.base import CausalLM

if TYPE_CHECKING:
    import pytest

BLOCK_SIZE = 4
NUM_BLOCKS = 160
STEPS = 32
LOGIT_TOL = 1e-4


@attrs.define
class PagedKV:
    """A test-owned paged KV cache (satisfies ``KVCacheView``)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    block_size: int

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of every K then every V tensor."""
        return [t.clone() for t in (*self.keys, *self.values)]

    def tensors(self) -> list[torch.Tensor]:
        """Every K then every V tensor (live)."""
        return [*self.keys, *self.values]


def allocate_kv(
    model: CausalLM,
    *,
    num_blocks: int,
    block_size: int,
    fill_seed: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> PagedKV:
    """Zeros (or seeded random values, to make "unchanged" checks meaningful) per layer, on
    ``device`` (random values are drawn on the CPU, so every device gets the same ones), in
    the model's per-layer KV dtypes or ``dtype`` (what ``kv_cache.dtype`` stores)."""
    meta = model.attention_metadata()
    shape = meta.kv_shape(num_blocks, block_size)
    generator = torch.Generator().manual_seed(fill_seed or 0)

    def make(layer_dtype: torch.dtype) -> torch.Tensor:
        if fill_seed is None:
            return torch.zeros(shape, dtype=layer_dtype, device=device)
        return torch.randn(shape, generator=generator).to(device=device, dtype=layer_dtype)

    dtypes = meta.kv_dtypes if dtype is None else (dtype,) * meta.num_layers
    return PagedKV(
        keys=[make(d) for d in dtypes],
        values=[make(d) for d in dtypes],
        block_size=block_size,
    )


class BlockPool:
    """Hands out physical block ids in a seeded random (scattered) order."""

    def __init__(self, *, num_blocks: int, seed: int) -> None:
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self._free = order.tolist()

    def take(self, count: int) -> list[int]:
        """``count`` fresh block ids (non-contiguous, unordered)."""
        if count > len(self._free):
            raise RuntimeError("test KV pool exhausted; raise NUM_BLOCKS")
        taken, self._free = self._free[:count], self._free[count:]
        return taken


def page_table(rows: Sequence[Sequence[int]], *, width: int) -> torch.Tensor:
    """int32 ``[len(rows), width]`` page table, ``-1`` past each row's blocks."""
    table = torch.full((len(rows), width), -1, dtype=torch.int32)
    for r, blocks in enumerate(rows):
        table[r, : len(blocks)] = torch.tensor(list(blocks), dtype=torch.int32)
    return table


@attrs.frozen
class Reference:
    """HF greedy run: logits before each generated token ``[steps, vocab]`` and the tokens."""

    logits: torch.Tensor
    tokens: list[int]


def hf_greedy(hf_model: Any, prompt: Sequence[int], *, steps: int) -> Reference:
    """Greedy decoding with the HF model's own KV cache (no EOS stop)."""
    # transformers 5.x renames `past_key_values` to `cache` (argument and output field).
    field = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else None
    field = field or "past_key_values"
    with torch.no_grad():
        out = hf_model(input_ids=torch.tensor([list(prompt)]), use_cache=True)
        logits, tokens = [out.logits[0, -1].float()], []
        for _ in range(steps - 1):
            tokens.append(int(logits[-1].argmax()))
            out = hf_model(
                input_ids=torch.tensor([[tokens[-1]]]), use_cache=True, **{field: out[field]}
            )
            logits.append(out.logits[0, -1].float())
        tokens.append(int(logits[-1].argmax()))
    return Reference(logits=torch.stack(logits), tokens=tokens)


@attrs.frozen
class Run:
    """One llmrt row's greedy run, shaped like ``Reference``."""

    logits: torch.Tensor
    tokens: list[int]


class Harness:
    """Drives an llmrt model over a test-owned paged KV cache and checks it against HF.

    ``device`` is where ``model`` lives: the harness places the KV cache and every input
    there and brings the logits back to the CPU for the comparison. ``kv_dtype`` is the
    cache's dtype (the model's own when None), as ``kv_cache.dtype`` sets it for a lane;
    ``block_size`` its tokens per page (small by default: prompts span many pages).
    """

    def __init__(
        self,
        *,
        hf_model: Any,
        model: CausalLM,
        vocab_size: int,
        seed: int,
        device: torch.device | str = "cpu",
        kv_dtype: torch.dtype | None = None,
        block_size: int = BLOCK_SIZE,
    ) -> None:
        self.hf_model = hf_model
        self.kv_dtype = kv_dtype
        self.block_size = block_size
        self.model = model
        self.vocab_size = vocab_size
        self.seed = seed
        self.device = torch.device(device)
        self._references: dict[tuple[int, ...], Reference] = {}  # (*prompt, -steps)
        self.pad_token = vocab_size - 1

    def prompt(self, length: int, *, seed: int) -> list[int]:
        """A seeded random prompt."""
        generator = torch.Generator().manual_seed(self.seed * 1000 + seed)
        return torch.randint(0, self.vocab_size, (length,), generator=generator).tolist()

    def reference(self, prompt: Sequence[int], *, steps: int = STEPS) -> Reference:
        """HF greedy reference for ``prompt`` (memoised per harness)."""
        key = (*prompt, -steps)
        if key not in self._references:
            self._references[key] = hf_greedy(self.hf_model, prompt, steps=steps)
        return self._references[key]

    def bind(self, *, fill_seed: int | None = None) -> tuple[PagedKV, BlockPool]:
        """A fresh cache bound to the model and a scattered block pool."""
        kv = allocate_kv(
            self.model,
            num_blocks=NUM_BLOCKS,
            block_size=self.block_size,
            fill_seed=fill_seed,
            device=self.device,
            dtype=self.kv_dtype,
        )
        self.model.set_kv_cache(kv)
        return kv, BlockPool(num_blocks=NUM_BLOCKS, seed=self.seed)

    def prefill(
        self,
        *,
        chunks: Sequence[Sequence[int]],
        starts: Sequence[int],
        table: torch.Tensor,
        pad_to: int | None = None,
    ) -> torch.Tensor:
        """One padded prefill call; row ``r`` adds ``chunks[r]`` at ``starts[r]`` (logits on
        the CPU)."""
        width = max(pad_to or 0, max(len(c) for c in chunks), 1)
        tokens = torch.full((len(chunks), width), self.pad_token, dtype=torch.int64)
        for r, chunk in enumerate(chunks):
            tokens[r, : len(chunk)] = torch.tensor(list(chunk), dtype=torch.int64)
        lens = [len(c) for c in chunks]
        on = self.device
        logits = self.model.prefill_forward(
            tokens=tokens.to(on),
            start_pos=torch.tensor(list(starts), dtype=torch.int32, device=on),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=on),
            page_table=table.to(on),
            last_token_index=torch.tensor(
                [max(n - 1, 0) for n in lens], dtype=torch.int64, device=on
            ),
        )
        return logits.to("cpu")

    def decode(
        self, *, tokens: Sequence[int], positions: Sequence[int], table: torch.Tensor
    ) -> torch.Tensor:
        """One decode step for every row (logits on the CPU)."""
        on = self.device
        logits = self.model.decode_forward(
            tokens=torch.tensor(list(tokens), dtype=torch.int64, device=on),
            positions=torch.tensor(list(positions), dtype=torch.int32, device=on),
            page_table=table.to(on),
        )
        return logits.to("cpu")

    def greedy(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        cuts: Sequence[Sequence[int]] | None = None,
        align: Literal["start", "end"] = "start",
        pad_row: bool = False,
        steps: int = STEPS,
    ) -> list[Run]:
        """Prefill ``prompts`` as one ragged batch, then decode them in lock-step.

        ``cuts[r]`` splits row ``r``'s prompt into prefill chunks (one call per chunk
        index; ``align="end"`` makes rows with fewer chunks join late). ``pad_row``
        adds an inert row (all ``-1`` page table) whose logits must stay finite.
        """
        kv, pool = self.bind()
        row_cuts = [list(c) for c in cuts] if cuts is not None else [[] for _ in prompts]
        segments = [_segments(len(p), c) for p, c in zip(prompts, row_cuts, strict=True)]
        calls = max(len(s) for s in segments)
        if align == "end":
            segments = [_late(s, calls) for s in segments]
        rows = [pool.take(math.ceil((len(p) + steps) / self.block_size)) for p in prompts]
        if pad_row:
            rows.append([])
        table = page_table(rows, width=max(len(r) for r in rows) + 1)
        last = [torch.empty(0)] * len(prompts)
        for call in range(calls):
            chunks: list[list[int]] = []
            starts: list[int] = []
            for r, prompt in enumerate(prompts):
                span = segments[r][call] if call < len(segments[r]) else None
                if span is None:
                    done = call >= len(segments[r]) or align == "start"
                    chunks.append([])
                    starts.append(len(prompt) if done else 0)
                else:
                    chunks.append(list(prompt[span[0] : span[1]]))
                    starts.append(span[0])
            if pad_row:
                chunks.append([])
                starts.append(0)
            pad_to = max(len(c) for c in chunks) + 2  # trailing padding tokens in every row
            logits = self.prefill(chunks=chunks, starts=starts, table=table, pad_to=pad_to)
            assert logits.dtype == torch.float32
            assert logits.shape == (len(chunks), self.vocab_size)
            assert torch.isfinite(logits).all()
            for r, prompt in enumerate(prompts):
                span = segments[r][call] if call < len(segments[r]) else None
                if span is not None and span[1] == len(prompt):
                    last[r] = logits[r]
        history = [[row] for row in last]
        tokens = [[int(row.argmax())] for row in last]
        for step in range(1, steps):
            feed = [t[-1] for t in tokens] + ([0] * pad_row)
            positions = [len(p) + step - 1 for p in prompts] + ([0] * pad_row)
            logits = self.decode(tokens=feed, positions=positions, table=table)
            assert torch.isfinite(logits).all()
            for r in range(len(prompts)):
                history[r].append(logits[r])
                tokens[r].append(int(logits[r].argmax()))
        del kv
        return [Run(logits=torch.stack(h), tokens=t) for h, t in zip(history, tokens, strict=True)]

    def greedy_error(
        self, prompts: Sequence[Sequence[int]], *, steps: int, describe: Callable[[Any], str] = str
    ) -> float:
        """Run ``greedy`` on ``prompts``; assert every greedy token equals HF's (a failure
        names the prompt through ``describe``) and return the largest |logit error|."""
        worst = 0.0
        for prompt, run in zip(prompts, self.greedy(prompts, steps=steps), strict=True):
            ref = self.reference(prompt, steps=steps)
            assert run.tokens == ref.tokens, describe(prompt)
            worst = max(worst, (run.logits - ref.logits).abs().max().item())
        return worst

    def assert_parity(self, prompts: Sequence[Sequence[int]], runs: Sequence[Run]) -> None:
        """First-token logits within ``LOGIT_TOL`` and every greedy token identical to HF."""
        for r, (prompt, run) in enumerate(zip(prompts, runs, strict=True)):
            ref = self.reference(prompt, steps=len(run.tokens))
            first = (run.logits[0] - ref.logits[0]).abs().max().item()
            assert first <= LOGIT_TOL, f"row {r}: prefill logits differ by {first:.3g}"
            assert run.tokens == ref.tokens, f"row {r}: greedy tokens diverge"
            every = (run.logits - ref.logits).abs().max().item()
            assert every <= LOGIT_TOL, f"row {r}: decode logits differ by {every:.3g}"

    # Scenarios shared by the family parity tests -------------------------------------

    def check_single_prompt(self) -> None:
        """One prompt: prefill logits and 32 greedy tokens match HF."""
        prompts = [self.prompt(13, seed=1)]
        self.assert_parity(prompts, self.greedy(prompts))

    def check_ragged_batch(self) -> None:
        """Ragged prompts + an inert padding row; decode positions differ per row."""
        prompts = [self.prompt(n, seed=10 + n) for n in (5, 17, 1, 11)]
        self.assert_parity(prompts, self.greedy(prompts, pad_row=True))

    def check_chunked_prefill(self) -> None:
        """Chunks smaller than the prompt (not block aligned), start_pos advancing."""
        prompts = [self.prompt(19, seed=2), self.prompt(10, seed=3)]
        cuts = [list(range(5, 19, 5)), list(range(3, 10, 3))]
        self.assert_parity(prompts, self.greedy(prompts, cuts=cuts))

    def check_cached_prefix(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Rows whose first blocks are cached continue (start_pos > 0) next to a fresh row."""
        import llmrt.families.causal_lm as causal_lm

        modes: list[str] = []
        plan = causal_lm.plan_prefill

        def spy(**kwargs: Any) -> Any:
            result = plan(**kwargs)
            modes.append(result.mode)
            return result

        monkeypatch.setattr(causal_lm, "plan_prefill", spy)
        prompts = [self.prompt(14, seed=4), self.prompt(9, seed=5), self.prompt(12, seed=6)]
        runs = self.greedy(prompts, cuts=[[8], [], [6]], align="end")
        assert modes == ["fresh", "split"], modes
        self.assert_parity(prompts, runs)

    def check_shared_prefix_blocks(self) -> None:
        """A second request reuses the first one's cached blocks and prefills only its suffix."""
        prefix = 8  # tokens the two requests share: whole blocks of the first one
        if prefix % self.block_size:
            raise ValueError(
                f"block_size {self.block_size} does not divide the {prefix}-token prefix"
            )
        shared = prefix // self.block_size
        first = self.prompt(13, seed=7)
        second = first[:prefix] + self.prompt(7, seed=8)
        _, pool = self.bind()
        rows = [pool.take(math.ceil((13 + STEPS) / self.block_size))]
        rows.append(
            rows[0][:shared] + pool.take(math.ceil((15 + STEPS) / self.block_size) - shared)
        )
        table = page_table(rows, width=len(rows[1]) + 1)
        head = self.prefill(chunks=[first, []], starts=[0, 0], table=table, pad_to=15)
        tail = self.prefill(
            chunks=[[], second[prefix:]], starts=[13, prefix], table=table, pad_to=9
        )
        history = [[head[0]], [tail[1]]]
        tokens = [[int(head[0].argmax())], [int(tail[1].argmax())]]
        for step in range(1, STEPS):
            logits = self.decode(
                tokens=[t[-1] for t in tokens], positions=[12 + step, 14 + step], table=table
            )
            for r in range(2):
                history[r].append(logits[r])
                tokens[r].append(int(logits[r].argmax()))
        runs = [Run(logits=torch.stack(h), tokens=t) for h, t in zip(history, tokens, strict=True)]
        self.assert_parity([first, second], runs)

    def check_padding_writes_nothing(self) -> None:
        """Padding rows/tokens and ``-1`` entries leave every other KV byte unchanged."""
        kv, pool = self.bind(fill_seed=1)
        a, b, c, d, e = pool.take(5)
        table = page_table([[a, b], [], [c, d], [e]], width=3)
        before = kv.snapshot()
        self.prefill(
            chunks=[self.prompt(6, seed=20), [], self.prompt(3, seed=21), self.prompt(8, seed=22)],
            starts=[0, 0, 0, 0],
            table=table,
            pad_to=8,
        )
        written = {(a, 0), (a, 1), (a, 2), (a, 3), (b, 0), (b, 1), (c, 0), (c, 1), (c, 2)}
        written |= {(e, 0), (e, 1), (e, 2), (e, 3)}
        _assert_written(before, kv.tensors(), written)
        before = kv.snapshot()
        self.decode(tokens=[1, 2, 3, 4], positions=[6, 5, 3, 8], table=table)
        _assert_written(before, kv.tensors(), {(b, 2), (c, 3)})

    def check_capture_safe(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The CUDA-graph-safe path (no host reads, full-width tables) matches HF too.

        Host syncs are simulated on CPU: inside a forward, any tensor -> Python read raises.
        """
        import llmrt.families.paged_attention as paged_attention

        monkeypatch.setattr(paged_attention, "host_sync_allowed", lambda device: False)
        for method in ("prefill_forward", "decode_forward"):
            monkeypatch.setattr(self.model, method, _without_host_sync(getattr(self.model, method)))
        self.check_ragged_batch()
        self.check_chunked_prefill()
        self.check_shared_prefix_blocks()
        self.check_padding_writes_nothing()


_SYNCING = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


def _without_host_sync(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap ``forward`` so that reading any tensor value on the host inside it raises."""

    def guarded(**kwargs: Any) -> torch.Tensor:
        saved = {name: getattr(torch.Tensor, name) for name in _SYNCING}

        def forbidden(*args: Any, **kw: Any) -> Any:
            raise AssertionError("host sync inside a capture-safe forward")

        try:
            for name in _SYNCING:
                setattr(torch.Tensor, name, forbidden)
            return forward(**kwargs)
        finally:
            for name, original in saved.items():
                setattr(torch.Tensor, name, original)

    return guarded


def _assert_written(
    before: Sequence[torch.Tensor], after: Sequence[torch.Tensor], slots: set[tuple[int, int]]
) -> None:
    """Exactly ``slots`` (block, offset) changed, bit for bit, in every K/V tensor."""
    for index, (old, new) in enumerate(zip(before, after, strict=True)):
        changed = (old.view(torch.int32) != new.view(torch.int32)).any(dim=3).any(dim=1)
        expected = torch.zeros_like(changed)
        for block, offset in slots:
            expected[block, offset] = True
        got = sorted(map(tuple, changed.nonzero().tolist()))
        assert torch.equal(changed, expected), f"tensor {index}: changed slots {got}"


def _late(segments: list[tuple[int, int] | None], calls: int) -> list[tuple[int, int] | None]:
    """``segments`` preceded by idle calls, so the row's last chunk lands on the last call."""
    idle: list[tuple[int, int] | None] = [None] * (calls - len(segments))
    return idle + list(segments)


def _segments(length: int, cuts: list[int]) -> list[tuple[int, int] | None]:
    points = [0, *[c for c in cuts if 0 < c < length], length]
    return list(itertools.pairwise(points))


def perturb(
    model: torch.nn.Module, *, seed: int, is_norm: Callable[[str], bool] | None = None
) -> torch.nn.Module:
    """Perturb norms and biases: HF initialises them to ones/zeros, which hides mistakes."""
    norm = is_norm or (lambda name: "norm" in name or ".ln_" in name)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or norm(name):
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.eval()


def reference_model(config: Mapping[str, Any], *, seed: int = 0) -> Any:
    """transformers' model of the raw ``config.json`` mapping ``config`` (``model_type``
    included): random (seeded), norms and biases perturbed, float32, eager attention.

    transformers fills in every default the mapping leaves out; the llmrt side must read
    ``config`` itself (``family.build(hf_config=config, ...)``), as the runtime reads a
    recipe's ``model`` or a directory's ``config.json``, so a family that reads a default
    differently from transformers fails parity instead of being handed transformers' value.
    """
    import transformers

    from llmrt.errors import ConfigError

    values = dict(config)
    model_type = values.pop("model_type", None)
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **values)
    except ValueError as exc:
        raise ConfigError(
            "model.model_type",
            model_type,
            "transformers has no such architecture, so there is no reference for it",
        ) from exc
    hf_config._attn_implementation = "eager"
    pad = getattr(hf_config, "pad_token_id", None)
    vocab = getattr(hf_config, "vocab_size", None)
    defaulted = "pad_token_id" not in config
    if defaulted and isinstance(pad, int) and isinstance(vocab, int) and pad >= vocab:
        # A default of the full-size architecture (Cohere's, Qwen's) past a tiny
        # vocabulary: transformers would refuse the embedding; the padding id only
        # zero-initialises a row the llmrt side reads from the same weights.
        hf_config.pad_token_id = None
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return perturb(model, seed=seed + 1)


def raw_config(hf_model: Any) -> dict[str, Any]:
    """The ``config.json`` ``hf_model`` was loaded from (``from_pretrained`` of a local
    directory), as the runtime reads it: never transformers' in-memory config, whose filled-in
    defaults would hide a family that reads a default differently."""
    import json
    from pathlib import Path

    from llmrt.errors import ConfigError

    where = str(getattr(hf_model.config, "name_or_path", "") or "")
    path = Path(where) / "config.json" if where else None
    if path is None or not path.is_file():
        raise ConfigError(
            "hf_config",
            None,
            "is required for a model not loaded from a local directory: pass the raw "
            "config.json mapping the model was made from (transformers' filled-in "
            "config.to_dict() would hide a default the family reads differently)",
        )
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded
