"""Importable helpers that assemble one tiny eager lane by hand, for unit/fault/parity tests.

A lane is what the model executor would build: a tensor model, a device port, the paged-KV
manager (allocated and bound), one ``OutputReader``, the prefill and decode runtimes, the
program compiler and the ``EagerExecutor`` over them. ``Lane.cleanup`` tears it down
through the product's own cleanup root (a ``ModelExecutor`` over the lane's parts). The KV
cache is filled with seeded random values right after allocation so "unchanged" checks
compare real bytes, not zeros.

Import with ``from lane_fixtures import ...`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import attrs
import pytest
import torch

from llmrt.device.base import Device
from llmrt.device.torch import TorchDevice
from llmrt.families.base import CausalLM
from llmrt.families.registry import get_family
from llmrt.runtime.config import PagedKVCacheConfig, PageTableLayout, TraceConfig, WarmupConfig
from llmrt.runtime.decode import DecodeRuntime, DecodeRuntimeConfig
from llmrt.runtime.execution import EagerExecutor, TracedExecutor
from llmrt.runtime.model_executor import ModelExecutor
from llmrt.runtime.output_reader import OutputReader
from llmrt.runtime.paged_kv_cache import PagedKVCacheContext, PagedKVCacheManager
from llmrt.runtime.prefill.config import PrefillRuntimeConfig
from llmrt.runtime.prefill.plan import PrefillRow, WaveRules
from llmrt.runtime.prefill.result_collector import PrefillOutput
from llmrt.runtime.prefill.runtime import PrefillRuntime, TokenHistory
from llmrt.runtime.program_compiler import ProgramCompiler
from llmrt.runtime.trace_compiler import TraceCompiler
from llmrt.runtime.warmup import CaptureBarrier, WarmupCoordinator, WarmupCoordinatorConfig
from llmrt.sampling.params import SamplingParams

#: A tiny GQA Llama (HF ``config.json`` form): 2 layers, 4 query heads over 2 KV heads.
TINY_LLAMA: Mapping[str, Any] = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}


@pytest.fixture(scope="module", autouse=True)
def module_torch_thread() -> Iterator[None]:
    """``single_torch_thread`` for a whole module (its module-scoped fixtures build models)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def single_torch_thread() -> Iterator[None]:
    """Run a test's tiny-model torch ops on one thread (restored afterwards).

    Import it into a test module to make it autouse there. Tiny matmuls gain nothing from
    intra-op threads, and on a shared 2-core machine they lose a lot to contention.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def tiny_llama(
    *, seed: int = 0, std: float = 0.15, device: str = "cpu", **overrides: Any
) -> CausalLM:
    """A float32 Llama on ``device`` with seeded N(0, std) weights (drawn on the CPU, so
    every device gets the same ones; large enough for peaked logits)."""
    family = get_family("llama")
    hf_config = {**TINY_LLAMA, **overrides}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(family.expected_tensors(hf_config).items()):
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        else:
            tensors[name] = std * torch.randn(shape, generator=generator)
    return family.build(hf_config=hf_config, tensors=tensors, dtype=torch.float32, device=device)


@attrs.define(eq=False)
class Lane:
    """One hand-assembled eager lane; the test owns it and calls ``cleanup``."""

    model: CausalLM
    device: Device  # the port every component uses (a FaultyDevice in fault tests)
    inner: TorchDevice  # the TorchDevice underneath, for stats
    baseline_live: int  # inner live tensors before the KV cache was allocated
    kv: PagedKVCacheManager
    context: PagedKVCacheContext
    layout: PageTableLayout
    reader: OutputReader
    prefill: PrefillRuntime
    decode: DecodeRuntime
    compiler: ProgramCompiler
    executor: EagerExecutor
    notes: dict[str, Any] = attrs.Factory(dict)  # scratch space for a test module's fixtures
    tracing: Tracing | None = None  # set by ``add_tracing``
    root: ModelExecutor | None = None  # the cleanup root, made at the first ``cleanup``

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def kv_tensors(self) -> list[torch.Tensor]:
        """Every live K then every live V tensor."""
        return [*self.context.keys, *self.context.values]

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of every K then every V tensor."""
        return [t.clone() for t in self.kv_tensors()]

    def restore(self, snapshot: Sequence[torch.Tensor]) -> None:
        """Overwrite the live KV with ``snapshot`` (to rerun from the same state)."""
        with torch.no_grad():
            for live, saved in zip(self.kv_tensors(), snapshot, strict=True):
                live.copy_(saved)

    def live_tensors(self) -> int:
        return self.inner.stats().live_tensors

    def prefill_runtime(
        self,
        *,
        max_chunk: int | None = None,
        batching_enabled: bool = True,
        max_batch_size: int = 8,
    ) -> PrefillRuntime:
        """Another prefill runtime over this lane's model/device/reader with its own policy."""
        layout = self.layout
        if max_chunk is not None:
            layout = PageTableLayout.resolve(
                block_size=layout.block_size,
                model_max_sequence_length=layout.model_max_sequence_length,
                physical_num_blocks=layout.num_blocks,
                max_prefill_chunk_size=max_chunk,
            )
        return PrefillRuntime(
            PrefillRuntimeConfig.resolve(
                model=self.model,
                device=self.device,
                output_reader=self.reader,
                page_table_layout=layout,
                lane_capacity=self.prefill.config.lane_capacity,
                batching_enabled=batching_enabled,
                max_batch_size=max_batch_size,
                buckets="fine",
                bucket_step=8,
            )
        )

    def cleanup(self) -> None:
        """The product's teardown: ``ModelExecutor.cleanup`` over this lane's parts (the spec's
        eight steps, each once; failures kept and raised as one ``CleanupError``; a retry
        runs only the failed steps)."""
        if self.root is None:
            if self.tracing is not None:
                traced, warmup = self.tracing.executor, self.tracing.warmup
            else:
                traced = None
                warmup = WarmupCoordinator(
                    WarmupCoordinatorConfig.resolve(
                        warmup=WarmupConfig(prefill_seq_lens=(8,), prefill_batch_sizes=(1,)),
                        trace=TraceConfig(mode="none"),
                        execution=self.executor,
                    ),
                    execution=self.executor,
                )
            self.root = ModelExecutor(
                kv_cache=self.kv,
                output_reader=self.reader,
                eager=self.executor,
                traced=traced,
                warmup=warmup,
            )
        self.root.cleanup()


@attrs.define(eq=False)
class Tracing:
    """A lane's trace layer: the trace compiler over the lane's program compiler, the traced
    executor over the lane's eager executor, and the warmup coordinator driving it."""

    traces: TraceCompiler
    executor: TracedExecutor
    warmup: WarmupCoordinator

    def warm(self, *, decode_first: bool = False) -> None:
        """Run both warmups (captures when traced and the barrier is complete)."""
        if decode_first:
            self.warmup.warmup_decode()
            self.warmup.warmup_prefill()
        else:
            self.warmup.warmup_prefill()
            self.warmup.warmup_decode()


def add_tracing(
    lane: Lane,
    *,
    mode: str = "all",
    seq_lens: Sequence[int] = (8, 16),
    batch_sizes: Sequence[int] = (1, 2),
    barrier: CaptureBarrier | None = None,
    lane_index: int = 0,
) -> Tracing:
    """Compose a ``TraceCompiler``, ``TracedExecutor`` and ``WarmupCoordinator`` over ``lane``
    (nothing is compiled yet); ``lane.cleanup`` then releases the traces before the programs."""
    trace = TraceConfig(mode=mode)
    traces = TraceCompiler(program_compiler=lane.compiler, device=lane.device, lane=lane_index)
    executor = TracedExecutor(
        eager_executor=lane.executor, trace_compiler=traces, trace_config=trace
    )
    config = WarmupCoordinatorConfig.resolve(
        warmup=WarmupConfig(
            prefill_seq_lens=tuple(seq_lens), prefill_batch_sizes=tuple(batch_sizes)
        ),
        trace=trace,
        execution=executor,
        lane=lane_index,
    )
    warmup = WarmupCoordinator(config, execution=executor, barrier=barrier)
    lane.tracing = Tracing(traces=traces, executor=executor, warmup=warmup)
    return lane.tracing


class Runtimes(NamedTuple):
    reader: OutputReader
    prefill: PrefillRuntime
    decode: DecodeRuntime
    compiler: ProgramCompiler
    eager: EagerExecutor


def build_runtimes(
    *,
    model: CausalLM,
    device: Device,
    kv: PagedKVCacheManager,
    layout: PageTableLayout,
    lane_capacity: int,
    max_batch_size: int,
    batching_enabled: bool = True,
    wave_rules: WaveRules = "spec",
    width_ladder: int | None = None,
) -> Runtimes:
    """A lane's reader, prefill/decode runtimes, program compiler and eager executor over a
    bound KV cache (fine buckets of 8, device sampling on)."""
    reader = OutputReader(device=device)
    prefill = PrefillRuntime(
        PrefillRuntimeConfig.resolve(
            model=model,
            device=device,
            output_reader=reader,
            page_table_layout=layout,
            lane_capacity=lane_capacity,
            batching_enabled=batching_enabled,
            max_batch_size=max_batch_size,
            buckets="fine",
            bucket_step=8,
            wave_rules=wave_rules,
        )
    )
    decode = DecodeRuntime(
        DecodeRuntimeConfig.resolve(
            model=model,
            device=device,
            output_reader=reader,
            lane_capacity=lane_capacity,
            page_table_layout=layout,
            device_sampling_enabled=True,
            width_ladder=width_ladder,
        )
    )
    compiler = ProgramCompiler(device=device, kv_cache=kv)
    eager = EagerExecutor(prefill=prefill, decode=decode, program_compiler=compiler)
    return Runtimes(reader, prefill, decode, compiler, eager)


def build_lane(
    *,
    model: CausalLM | None = None,
    device: Device | None = None,
    block_size: int = 4,
    num_blocks: int = 64,
    max_chunk: int = 32,
    lane_capacity: int = 8,
    batching_enabled: bool = True,
    max_batch_size: int = 8,
    kv_fill_seed: int | None = 1,
    wave_rules: WaveRules = "spec",
    torch_device: str = "cpu",
    width_ladder: int | None = None,
) -> Lane:
    """Assemble a lane over ``device`` (default a fresh ``TorchDevice(torch_device)``) for
    ``model`` (default ``tiny_llama`` on ``torch_device``)."""
    model = tiny_llama(device=torch_device) if model is None else model
    port: Device = TorchDevice(torch_device) if device is None else device
    inner = port
    while not isinstance(inner, TorchDevice):
        inner = inner.inner  # type: ignore[attr-defined]
    baseline = inner.stats().live_tensors
    kv = PagedKVCacheManager(
        model=model,
        device=port,
        config=PagedKVCacheConfig(
            block_size=block_size, max_num_blocks=num_blocks, num_blocks=num_blocks
        ),
    )
    kv.configure()
    context = kv.allocate()
    if kv_fill_seed is not None:
        generator = torch.Generator().manual_seed(kv_fill_seed)
        with torch.no_grad():
            for t in (*context.keys, *context.values):
                t.copy_(torch.randn(t.shape, generator=generator).to(t.dtype))
    layout = PageTableLayout.resolve(
        block_size=block_size,
        model_max_sequence_length=model.config.max_position_embeddings,
        physical_num_blocks=num_blocks,
        max_prefill_chunk_size=max_chunk,
    )
    reader, prefill, decode, compiler, executor = build_runtimes(
        model=model,
        device=port,
        kv=kv,
        layout=layout,
        lane_capacity=lane_capacity,
        max_batch_size=max_batch_size,
        batching_enabled=batching_enabled,
        wave_rules=wave_rules,
        width_ladder=width_ladder,
    )
    return Lane(
        model=model,
        device=port,
        inner=inner,
        baseline_live=baseline,
        kv=kv,
        context=context,
        layout=layout,
        reader=reader,
        prefill=prefill,
        decode=decode,
        compiler=compiler,
        executor=executor,
    )


def poisons_pending_reads(lane: Lane) -> bool:
    """Whether a pending non-blocking read's host value is poison until its event (the CPU
    device's simulation of an in-flight copy; a CUDA copy lands whenever its stream runs)."""
    return torch.device(lane.inner.torch_device).type == "cpu"


def run_prefill(
    runtime: PrefillRuntime,
    rows: Sequence[PrefillRow],
    *,
    sampling_params: SamplingParams | Sequence[SamplingParams | None] | None = None,
    history: TokenHistory | None = None,
) -> PrefillOutput:
    """The eager prefill call chain (prepare, invoke, finish, assemble) without a compiler."""
    prepared = runtime.prepare(rows=rows, sampling_params=sampling_params)
    raws = [
        runtime.finish(request, runtime.invoke(request), history=history)
        for request in prepared.requests
    ]
    return runtime.assemble(prepared, raws)


def make_rows(
    prompts: Sequence[Sequence[int]],
    blocks: Sequence[Sequence[int]],
    *,
    cached: Sequence[int] | None = None,
    slots: Sequence[int] | None = None,
) -> list[PrefillRow]:
    """One ``PrefillRow`` per prompt (source rows in order, slots ``0..n-1`` by default)."""
    return [
        PrefillRow(
            source_row=i,
            tokens=torch.tensor(list(prompt), dtype=torch.int64),
            cached_tokens=0 if cached is None else int(cached[i]),
            slot=i if slots is None else int(slots[i]),
            block_ids=tuple(int(b) for b in blocks[i]),
        )
        for i, prompt in enumerate(prompts)
    ]


def page_table(blocks: Sequence[Sequence[int]], *, width: int) -> torch.Tensor:
    """int32 ``[rows, width]``, ``-1`` after each row's blocks."""
    table = torch.full((len(blocks), width), -1, dtype=torch.int32)
    for r, row in enumerate(blocks):
        if len(row):
            table[r, : len(row)] = torch.tensor(list(row), dtype=torch.int32)
    return table


def prompt(length: int, *, seed: int, vocab_size: int = TINY_LLAMA["vocab_size"]) -> list[int]:
    """A seeded random prompt."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def written_mask(
    rows: Sequence[tuple[Sequence[int], int]], *, num_blocks: int, block_size: int
) -> torch.Tensor:
    """bool ``[num_blocks, block_size]``: slots of positions ``< length`` of each row's blocks."""
    mask = torch.zeros((num_blocks, block_size), dtype=torch.bool)
    for blocks, length in rows:
        for pos in range(length):
            mask[blocks[pos // block_size], pos % block_size] = True
    return mask


def assert_unchanged_outside(
    before: Sequence[torch.Tensor], after: Sequence[torch.Tensor], mask: torch.Tensor
) -> None:
    """Every slot not in ``mask`` (host bool) is bit-for-bit equal in every K/V tensor."""
    for index, (old, new) in enumerate(zip(before, after, strict=True)):
        changed = (old.view(torch.int32) != new.view(torch.int32)).any(dim=3).any(dim=1)
        stray = changed.cpu() & ~mask
        assert not stray.any(), (
            f"KV tensor {index}: slots outside the active rows changed: "
            f"{sorted(map(tuple, stray.nonzero().tolist()))[:8]}"
        )


def row_kv(lane: Lane, blocks: Sequence[int], length: int) -> torch.Tensor:
    """``[2 * layers, kv_heads, length, head_dim]``: a row's K/V for positions ``< length``."""
    bs = lane.block_size
    block = torch.tensor([blocks[p // bs] for p in range(length)])
    offset = torch.tensor([p % bs for p in range(length)])
    return torch.stack([t[block, :, offset].transpose(0, 1) for t in lane.kv_tensors()])
