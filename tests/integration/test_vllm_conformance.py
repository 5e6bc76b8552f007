"""vLLM TT plugin conformance: the plugin's own call sequence and argument forms, replayed.

``PluginSession`` re-enacts what ``vllm_tt_plugin`` (tenstorrent/vllm-tt-plugin ``main``;
see docs/vllm.md for the commit and the ``dev`` differences) does with a TT model class:

- ``worker.get_num_available_blocks_tt``: ``get_max_tokens_all_users(model_name=,
  num_devices=, tt_data_parallel=, max_model_len=, max_num_seqs=)`` then
  ``ceil((tokens + block_size * max_num_seqs) / block_size)`` blocks per lane;
- ``loader.TTModelLoader``: ``initialize_vllm_model(hf_config, mesh_device, max_batch_size,
  max_seq_len=, tt_data_parallel=, optimizations=)``, first three positional;
- ``model_runner.TTModelRunner``: ``allocate_kv_cache(shape, dtype, num_layers)`` with
  vLLM's model dtype (bfloat16), two-phase ``warmup_model`` with ``num_blocks`` =
  ``min(cdiv(max_model_len, block_size), num_blocks)``, ``submit_prefill`` kwargs
  (int32 token buffer whose tail is stale, numpy ``prompt_lens`` / ``start_pos``,
  zero-padded page tables of that width, ``empty_slots``), the host sampler reading
  ``out[rows, -1, :]``, decode padded to the lane's slots with ``-1`` positions and zero
  page-table rows, and ``slot_remap`` from ``_decode_state_slot_remap`` after a condense;
- ``async_decode``: ``TTSamplingParams`` columns as lists when sampling on device,
  ``decode_forward(read_from_device=False)``; the synchronous path hands that raw output
  to ``process_decode_output_host``, the async one calls ``read_decode_output(out,
  async_read=True)`` and ``ttnn.event_synchronize`` on every event first.

The tokens must equal llmrt's own ``LLM.generate`` on the same recipe and prompts, on the
torch CPU backend (``tiny-llama``: the plugin's mesh goes unused) and on the strict fake ttnn
(``toy-ttnn``: the plugin's raw mesh is wrapped, ``import ttnn`` gives the fake, as it gives the
real module under vLLM).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dependency_injector import providers
from llmrt.containers import RuntimeContainer

from llmrt.recipe.loader import load_recipe
from llmrt.sampling.params import SamplingParams
from llmrt.serving.llm import LLM
from llmrt.testing.fake_ttnn import FakeTtnn
from llmrt.vllm.adapter import VLLMAdapter

MAX_NUM_SEQS = 4  # == the recipes' decode.lane_capacity
BLOCK_SIZE = 16
VOCAB = 258
STALE = 7  # what the plugin's persistent token buffer holds past a prompt


@dataclass(frozen=True)
class TTSamplingParams:
    """The plugin's sampling columns (``vllm_tt_plugin/model_input.py``), field for field."""

    temperature: Any
    top_k: Any
    top_p: Any
    presence_penalty: Any = 0.0
    frequency_penalty: Any = 0.0
    repetition_penalty: Any = 1.0
    seed: Any = 0
    num_logprobs: Any = None
    enable_log_probs: Any = None


@dataclass
class Req:
    prompt: list[int]
    params: SamplingParams
    outputs: list[int]
    blocks: list[int]
    slot: int = -1

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.params.max_tokens


@dataclass(frozen=True)
class HFConfig:
    """What vLLM's ``model_config.hf_config`` carries (transformers-like attributes)."""

    model_type: str
    _name_or_path: str
    num_key_value_heads: int
    head_dim: int
    architectures: tuple[str, ...] = ("TTLlamaForCausalLM",)  # the platform prefixes TT
    vocab_size: int = VOCAB
    num_hidden_layers: int = 2
    torch_dtype: torch.dtype = torch.bfloat16


@dataclass(frozen=True)
class Backend:
    """A recipe (with ``LLMRT_VLLM_OVERRIDES``), the hf_config vLLM would hold for it, its
    max_model_len and KV capacity. ``eager_prefill``: prefill runs eagerly while the decode
    trace lives (host allocations then, which tt-metal warns of and the fake records)."""

    recipe: str
    hf: HFConfig
    max_model_len: int
    capacity: int
    ttnn: bool
    overrides: str = ""
    eager_prefill: bool = False


TORCH = Backend(
    recipe="tiny-llama",
    hf=HFConfig("llama", "llmrt/tiny-llama", num_key_value_heads=2, head_dim=16),
    max_model_len=512,
    capacity=128,
    ttnn=False,
)
TTNN = Backend(
    recipe="toy-ttnn",
    hf=HFConfig("toy_ttnn", "llmrt/toy-ttnn", num_key_value_heads=1, head_dim=8),
    max_model_len=256,
    capacity=64,
    ttnn=True,
)



def _doc_exports() -> dict[str, str]:
    """The ``export NAME=VALUE`` lines of docs/vllm.md's decoder-on-ttnn example."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "vllm.md").read_text()
    block = text[text.index("LLMRT_VLLM_RECIPE=tiny-llama") - len("export ") :]
    block = block[: block.index("```")]
    exports = {}
    for line in block.strip().splitlines():
        name, _, value = line.strip().removeprefix("export ").partition("=")
        exports[name] = value.strip('"')
    return exports


DOC = _doc_exports()
#: A decoder family on ttnn, with the settings docs/vllm.md gives for it.
TTNN_DECODER = Backend(
    recipe=DOC["LLMRT_VLLM_RECIPE"],
    hf=HFConfig("llama", "llmrt/tiny-llama", num_key_value_heads=2, head_dim=32),
    max_model_len=512,
    capacity=128,
    ttnn=True,
    overrides=DOC["LLMRT_VLLM_OVERRIDES"],
    eager_prefill=True,
)


class PluginSession:
    """One vLLM engine's model runner, reduced to the calls it makes on the TT model."""

    def __init__(
        self,
        *,
        backend: Backend,
        mesh: object,
        ttnn: FakeTtnn,
        trace_mode: str = "all",
        warmup: bool = True,
    ) -> None:
        self.ttnn = ttnn
        hf = backend.hf
        self.calls: list[str] = []
        cls = VLLMAdapter
        # The worker's ``self.num_devices = self.mesh_device.get_num_devices()``.
        num_devices = mesh.get_num_devices()  # type: ignore[attr-defined]
        tokens = cls.get_max_tokens_all_users(
            model_name=hf._name_or_path,
            num_devices=num_devices,
            tt_data_parallel=1,
            max_model_len=backend.max_model_len,
            max_num_seqs=MAX_NUM_SEQS,
        )
        self.num_blocks = math.ceil((tokens + BLOCK_SIZE * MAX_NUM_SEQS) / BLOCK_SIZE)
        self.model = cls.initialize_vllm_model(
            hf,
            mesh,
            MAX_NUM_SEQS,
            max_seq_len=backend.max_model_len,
            tt_data_parallel=1,
            optimizations=None,
        )
        self.width = min(math.ceil(backend.max_model_len / BLOCK_SIZE), self.num_blocks)
        # ``_kv_cache_shape``: KV heads divided over the lane's devices (tt_data_parallel=1).
        heads = hf.num_key_value_heads // min(num_devices, hf.num_key_value_heads)
        self.kv_heads = heads
        shape = (self.num_blocks, heads, BLOCK_SIZE, hf.head_dim)
        self.kv_caches = self.call("allocate_kv_cache", shape, hf.torch_dtype, hf.num_hidden_layers)
        prefill_kwargs = {"kv_cache": self.kv_caches, "can_sample_on_device": True}
        decode_kwargs = {
            "kv_cache": self.kv_caches,
            "max_batch_size": MAX_NUM_SEQS,
            "num_blocks": self.width,
            "can_sample_on_device": True,
        }
        self.trace_prefill = trace_mode == "all"
        self.trace_decode = trace_mode in ("all", "decode_only")
        if warmup:  # the worker's ``enable_model_warmup`` (tt_config), true by default
            self.call("warmup_model_prefill", enable_trace=False, **prefill_kwargs)
            self.call("warmup_model_decode", enable_trace=False, **decode_kwargs)
            if self.trace_prefill:
                self.call("warmup_model_prefill", enable_trace=True, **prefill_kwargs)
            if self.trace_decode:
                self.call("warmup_model_decode", enable_trace=True, **decode_kwargs)
        self.rows: list[Req] = []  # the persistent batch, condensed
        self.state_slot: dict[int, int] = {}  # id(req) -> device state slot
        self.free_blocks = list(range(self.num_blocks))
        self.layout_changed = True  # the runner's sticky "decode layout changed" flag
        self.decode_steps = 0
        self.overlapped = 0  # decode steps submitted before the previous one was read

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(method)
        return getattr(self.model, method)(*args, **kwargs)

    # -- scheduling (the bits of vLLM's scheduler and input batch the model sees) --------

    def _grow(self, req: Req) -> None:
        need = math.ceil((len(req.prompt) + len(req.outputs) + 1) / BLOCK_SIZE)
        while len(req.blocks) < need:
            req.blocks.append(self.free_blocks.pop(0))

    def _table(self, reqs: list[Req], rows: int) -> torch.Tensor:
        table = torch.zeros((rows, self.width), dtype=torch.int32)
        for i, req in enumerate(reqs):
            table[i, : len(req.blocks)] = torch.tensor(req.blocks, dtype=torch.int32)
        return table

    def _columns(self, reqs: list[Req], rows: int) -> TTSamplingParams:
        """``slice_tt_sampling_params`` then ``.tolist()`` (padding rows: greedy defaults)."""
        cols: dict[str, list[Any]] = {f.name: [] for f in fields(TTSamplingParams)}
        for i in range(rows):
            p = reqs[i].params if i < len(reqs) else SamplingParams(temperature=0.0, top_k=1)
            cols["temperature"].append(p.temperature)
            cols["top_k"].append(p.top_k if 0 < p.top_k < VOCAB else VOCAB)
            cols["top_p"].append(0.0 if p.top_k == 1 else p.top_p)
            cols["presence_penalty"].append(p.presence_penalty)
            cols["frequency_penalty"].append(p.frequency_penalty)
            cols["repetition_penalty"].append(p.repetition_penalty)
            cols["seed"].append(p.seed)  # the runner maps its -1 sentinel back to None
            cols["num_logprobs"].append(-2)
            cols["enable_log_probs"].append(False)
        return TTSamplingParams(**cols)

    def prefill(self, new: list[Req], *, on_device: bool) -> None:
        held = set(self.state_slot.values())
        for req in new:
            req.slot = min(set(range(MAX_NUM_SEQS)) - held)
            held.add(req.slot)
            self.state_slot[id(req)] = req.slot
            self._grow(req)
        width = max(len(r.prompt) for r in new)
        tokens = torch.full((len(new), width + 3), STALE, dtype=torch.int32)
        for i, req in enumerate(new):
            tokens[i, : len(req.prompt)] = torch.tensor(req.prompt, dtype=torch.int32)
        kwargs: dict[str, Any] = {
            "tokens": tokens[:, :width],
            "page_table": self._table(new, len(new)),
            "kv_cache": self.kv_caches,
            "enable_trace": self.trace_prefill,
            "prompt_lens": np.array([len(r.prompt) for r in new], dtype=np.int64),
            "start_pos": np.zeros(len(new), dtype=np.int32),
        }
        if on_device:
            kwargs["sampling_params"] = self._columns(new, len(new))
        kwargs["empty_slots"] = [r.slot for r in new]
        out = self.call("prefill_forward", **kwargs)
        if on_device:
            sampled = out.reshape(len(new))
        else:
            rows = torch.arange(len(new))
            sampled = out[rows, -1, :].argmax(-1)  # the host sampler, greedy
        for req, token in zip(new, sampled.tolist(), strict=True):
            req.outputs.append(int(token))
        self.rows.extend(new)
        self.layout_changed = True

    def _slot_remap(self) -> torch.Tensor | None:
        want = [self.state_slot[id(r)] for r in self.rows]
        remap = want + [s for s in range(MAX_NUM_SEQS) if s not in want]
        for row, req in enumerate(self.rows):
            self.state_slot[id(req)] = row
        if remap == list(range(MAX_NUM_SEQS)):
            return None
        return torch.tensor(remap, dtype=torch.int32)

    def decode(self, *, on_device: bool, async_path: bool) -> None:
        live = self.rows
        for req in live:
            self._grow(req)
        n, pad = len(live), MAX_NUM_SEQS - len(live)
        tokens = torch.tensor([[r.outputs[-1]] for r in live], dtype=torch.int32)
        positions = torch.tensor([len(r.prompt) + len(r.outputs) - 1 for r in live])
        kwargs: dict[str, Any] = {
            "tokens": torch.cat([tokens, torch.zeros(pad, 1, dtype=torch.int32)]),
            "page_table": self._table(live, MAX_NUM_SEQS),
            "kv_cache": self.kv_caches,
            "start_pos": torch.cat([positions.int(), torch.full((pad,), -1, dtype=torch.int32)]),
        }
        if on_device:
            kwargs["sampling_params"] = self._columns(live, MAX_NUM_SEQS)
            if any(r.params.has_penalties for r in live):
                kwargs["prompt_tokens"] = _padded([r.prompt for r in live], MAX_NUM_SEQS)
                kwargs["output_tokens"] = _padded([r.outputs for r in live], MAX_NUM_SEQS)
            kwargs["reset_batch"] = self.layout_changed
        self.layout_changed = False
        remap = self._slot_remap()
        if remap is not None:
            kwargs["slot_remap"] = remap
        out = self.call(
            "decode_forward", **kwargs, enable_trace=self.trace_decode, read_from_device=False
        )
        if async_path:
            out, events = self.call("read_decode_output", out, async_read=True)
            for event in events:
                self.ttnn.event_synchronize(event)
        out = self.call("process_decode_output_host", out, is_tokens=on_device)
        sampled = out[:n].reshape(n) if on_device else out[torch.arange(n), -1, :].argmax(-1)
        for req, token in zip(live, sampled.tolist(), strict=True):
            req.outputs.append(int(token))
        self._retire()

    def _retire(self) -> None:
        """Finished requests leave; vLLM's condense moves the last rows into the holes."""
        for req in [r for r in self.rows if r.done]:
            self.free_blocks.extend(req.blocks)
            del self.state_slot[id(req)]
            hole = self.rows.index(req)
            last = self.rows.pop()
            if last is not req:
                self.rows[hole] = last
            self.layout_changed = True

    # -- vLLM's async scheduling: step k+1 submitted before step k is read ---------------

    def run_overlapped(self, reqs: list[Req], *, late: int) -> list[list[int]]:
        """Device sampling under vLLM's async scheduling, as the plugin runs it.

        vLLM's ``step_with_batch_queue`` schedules and submits step k+1 (the runner's
        ``execute_model``) before it resolves step k's output, so the runner's input batch
        (``num_tokens``, ``token_ids_cpu``) has not seen step k's tokens: the host tokens and
        positions of an overlapped step repeat the previous step's. The block table is the
        scheduler's, current for the step. ``async_decode`` overlaps a step only on its
        steady fast path (device sampling, no ``reset_batch``, no penalties or logprobs) and
        drains every pending step first otherwise (``must_drain_pending_async_steps``).
        """
        first, rest = reqs[: len(reqs) - late], reqs[len(reqs) - late :]
        self.prefill(first, on_device=True)
        self._retire()
        pending: tuple[Any, list[Req], bool] | None = None
        while self.rows or pending is not None or rest:
            if rest and self.decode_steps >= 1:  # a prefill step: never overlapped
                pending = self._resolve(pending)
                self.prefill(rest, on_device=True)
                self._retire()
                rest = []
                continue
            if not self.rows:
                pending = self._resolve(pending)
                continue
            steady = not self.layout_changed and not any(r.params.has_penalties for r in self.rows)
            if pending is not None and not (steady and pending[2]):
                pending = self._resolve(pending)  # the plugin's drain
                continue
            reset = self.layout_changed
            live = list(self.rows)
            handle = self._submit([] if pending is None else pending[1])
            if pending is not None:
                self.overlapped += 1
            self._resolve(pending)
            pending = (handle, live, steady and not reset)
        return [r.outputs for r in reqs]

    def _submit(self, inflight: list[Req]) -> Any:
        """``execute_model`` for one decode step: host inputs from the applied outputs only."""
        live = self.rows
        for req in live:  # the scheduler's blocks cover the step's true position
            ahead = 1 if any(r is req for r in inflight) else 0
            need = math.ceil((len(req.prompt) + len(req.outputs) + ahead) / BLOCK_SIZE)
            while len(req.blocks) < need:
                req.blocks.append(self.free_blocks.pop(0))
        n, pad = len(live), MAX_NUM_SEQS - len(live)
        tokens = torch.tensor([[r.outputs[-1]] for r in live], dtype=torch.int32)
        positions = torch.tensor([len(r.prompt) + len(r.outputs) - 1 for r in live])
        kwargs: dict[str, Any] = {
            "tokens": torch.cat([tokens, torch.zeros(pad, 1, dtype=torch.int32)]),
            "page_table": self._table(live, MAX_NUM_SEQS),
            "kv_cache": self.kv_caches,
            "start_pos": torch.cat([positions.int(), torch.full((pad,), -1, dtype=torch.int32)]),
            "sampling_params": self._columns(live, MAX_NUM_SEQS),
            "reset_batch": self.layout_changed,
        }
        self.layout_changed = False
        remap = self._slot_remap()
        if remap is not None:
            kwargs["slot_remap"] = remap
        out = self.call(
            "decode_forward", **kwargs, enable_trace=self.trace_decode, read_from_device=False
        )
        # ``submit_decode(async_read=True)``: the read is started right after the submit.
        out, events = self.call("read_decode_output", out, async_read=True)
        self.decode_steps += 1
        return (out, events, n)

    def _resolve(self, pending: tuple[Any, list[Req], bool] | None) -> None:
        """``finalize_decode`` then ``_apply_sampled_tokens_to_state`` for a submitted step.

        A request that finished while the step was in flight drops its extra token.
        """
        if pending is None:
            return None
        (out, events, n), live, _ = pending
        for event in events:
            self.ttnn.event_synchronize(event)
        out = self.call("process_decode_output_host", out, is_tokens=True)
        for req, token in zip(live, out[:n].reshape(n).tolist(), strict=True):
            if not req.done:
                req.outputs.append(int(token))
        self._retire()
        return None

    def run(
        self, reqs: list[Req], *, late: int, on_device: bool, async_path: bool
    ) -> list[list[int]]:
        """Prefill all but the last ``late`` requests, decode once, admit those, drain."""
        first, rest = reqs[: len(reqs) - late], reqs[len(reqs) - late :]
        self.prefill(first, on_device=on_device)
        self._retire()
        self.decode(on_device=on_device, async_path=async_path)
        if rest:
            self.prefill(rest, on_device=on_device)
            self._retire()
        while self.rows:
            self.decode(on_device=on_device, async_path=async_path)
        return [r.outputs for r in reqs]


def _padded(lists: list[list[int]], rows: int) -> torch.Tensor:
    width = max(len(x) for x in lists)
    out = torch.full((rows, width), -1, dtype=torch.int32)
    for i, x in enumerate(lists):
        out[i, : len(x)] = torch.tensor(x, dtype=torch.int32)
    return out


PROMPTS = [
    [(3 * i + 1) % 250 + 1 for i in range(10)],
    [(5 * i + 2) % 250 + 1 for i in range(33)],
    [(7 * i + 3) % 250 + 1 for i in range(20)],
    [(11 * i + 4) % 250 + 1 for i in range(40)],
]
#: Each wave admits its last request one decode step late, after the first finished and the
#: batch condensed: it prefills into the freed state slot 0 but decodes at row 2, so the
#: rows' per-slot state arrives through ``slot_remap``.
#: Wave 1: host sampling, greedy.
HOST_WAVE = [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in (2, 6, 5, 6)]
#: Wave 2: device sampling: seeded (the late one too), penalized and greedy rows.
DEVICE_WAVE = [
    SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=1234, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=5, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=99, max_tokens=6, ignore_eos=True),
]

#: Wave 3: device sampling without penalties, so the plugin overlaps its steady steps:
#: greedy and seeded rows, one admitted late.
OVERLAP_WAVE = [
    SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True),
]


@pytest.fixture(
    scope="module", params=[TORCH, TTNN, TTNN_DECODER], ids=["torch", "ttnn", "tiny-llama-ttnn"]
)
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.param


@pytest.fixture(scope="module")
def expected(
    backend: Backend,
) -> Iterator[tuple[list[list[int]], list[list[int]], list[list[int]]]]:
    """``LLM.generate`` on the same recipe (a ttnn recipe over its own fake machine)."""
    yield tuple(_generated(backend, HOST_WAVE, DEVICE_WAVE, OVERLAP_WAVE))  # type: ignore[misc]


def _generated(
    backend: Backend, *waves: list[SamplingParams], mesh_shape: tuple[int, int] = (1, 1)
) -> list[list[list[int]]]:
    """``LLM.generate``'s tokens of ``PROMPTS`` for each wave, on a ``mesh_shape`` mesh."""
    overrides = backend.overrides.split()
    if mesh_shape != (1, 1):
        mesh = f"device.mesh_shape={list(mesh_shape)}"
        overrides += [mesh, "device.ttnn.fabric_config=fabric_1d"]
    recipe = load_recipe(backend.recipe, overrides=overrides)
    container = RuntimeContainer(recipe=recipe)
    if backend.ttnn:
        fake = _fake(backend, system_mesh_shape=mesh_shape)
        container.device.ttnn_module.override(providers.Object(fake))
    with LLM(recipe=recipe, container=container) as llm:
        return [[list(o.token_ids) for o in llm.generate(PROMPTS, wave)] for wave in waves]


@contextlib.contextmanager
def _plugin_session(
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
    *,
    trace_mode: str = "all",
    mesh_shape: tuple[int, int] = (1, 1),
    warmup: bool = True,
) -> Iterator[PluginSession]:
    """The plugin's worker: a mesh opened through ``ttnn`` (the fake), then the model runner."""
    monkeypatch.setenv("LLMRT_VLLM_RECIPE", backend.recipe)
    monkeypatch.setenv("LLMRT_VLLM_OVERRIDES", backend.overrides)
    fake = _fake(backend, system_mesh_shape=mesh_shape)
    monkeypatch.setitem(sys.modules, "ttnn", fake)  # what ``import ttnn`` gives the plugin
    if mesh_shape != (1, 1):  # the plugin's worker: a fabric for a multi-chip mesh (a ring
        # on a Galaxy), before it opens the mesh
        galaxy = mesh_shape == (4, 8)
        fabric = fake.FabricConfig.FABRIC_1D_RING if galaxy else fake.FabricConfig.FABRIC_1D
        fake.set_fabric_config(fabric)
    mesh = fake.open_mesh_device(fake.MeshShape(*mesh_shape), trace_region_size=1 << 20)
    kwargs: dict[str, Any] = {"trace_mode": trace_mode, "warmup": warmup}
    if backend.ttnn:
        replay = PluginSession(backend=backend, mesh=mesh, ttnn=fake, **kwargs)
    else:
        with pytest.warns(RuntimeWarning, match=r"device\.backend=torch; the vLLM mesh is not"):
            replay = PluginSession(backend=backend, mesh=mesh, ttnn=fake, **kwargs)
    yield replay
    replay.model.close()
    fake.close_mesh_device(mesh)
    if mesh_shape != (1, 1):
        fake.set_fabric_config(fake.FabricConfig.DISABLED)
    assert fake.violations == ()
    if backend.ttnn:  # the model ran on the plugin's mesh (its lane submeshes): reads
        # synchronized, traces replayed when traced
        names = fake.call_names()
        assert "event_synchronize" in names
        assert ("execute_trace" in names) == (trace_mode != "none")


def _fake(backend: Backend, *, system_mesh_shape: tuple[int, int] = (1, 1)) -> FakeTtnn:
    return FakeTtnn(
        system_mesh_shape=system_mesh_shape,
        allocation_while_trace_live="warn" if backend.eager_prefill else "raise",
    )


@pytest.fixture
def session(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginSession]:
    with _plugin_session(backend, monkeypatch) as replay:
        yield replay


Expected = tuple[list[list[int]], list[list[int]], list[list[int]]]


def test_the_plugins_call_sequence_generates_what_llm_generate_does(
    backend: Backend, session: PluginSession, expected: Expected
) -> None:
    host = session.run(_requests(HOST_WAVE), late=1, on_device=False, async_path=False)
    device = session.run(_requests(DEVICE_WAVE), late=1, on_device=True, async_path=True)

    assert (host, device) == expected[:2]
    assert session.num_blocks == backend.capacity  # the recipe's KV, through the plugin's sizing
    assert session.calls[:5] == [
        "allocate_kv_cache",
        *["warmup_model_prefill", "warmup_model_decode"] * 2,  # the plugin's trace_mode "all"
    ]
    assert {"read_decode_output", "process_decode_output_host"} <= set(session.calls)
    for lane in session.model.group.lanes:
        assert lane.warmup.captured and lane.decode.outstanding_leases == 0


def _requests(params: list[SamplingParams]) -> list[Req]:
    return [
        Req(prompt=list(p), params=sp, outputs=[], blocks=[])
        for p, sp in zip(PROMPTS, params, strict=True)
    ]


@pytest.mark.parametrize("trace_mode", ["all", "none"])
def test_overlapped_steps_under_async_scheduling_generate_what_llm_generate_does(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, expected: Expected, trace_mode: str
) -> None:
    """Step k+1 submitted before step k is read, with the host inputs that lag one step."""
    if backend.ttnn and not backend.eager_prefill and trace_mode == "none":
        pytest.skip("toy-ttnn captures its traces at startup: eager steps would allocate")
    with _plugin_session(backend, monkeypatch, trace_mode=trace_mode) as session:
        overlapped = session.run_overlapped(_requests(OVERLAP_WAVE), late=1)

        assert overlapped == expected[2]
        assert session.overlapped >= 10  # most steady steps really overlapped
        for lane in session.model.group.lanes:
            assert lane.decode.outstanding_leases == 0


@pytest.mark.parametrize("mesh_shape", [(1, 2), (1, 8), (4, 8)], ids=["n300", "t3k", "galaxy"])
def test_multi_chip_meshes_take_the_plugins_per_device_kv_heads(
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
    expected: Expected,
    mesh_shape: tuple[int, int],
) -> None:
    """N300, T3K and Galaxy: the plugin divides the KV heads over the mesh's devices; the
    model loads, allocates and generates what ``LLM.generate`` does (a decoder family's lane
    is tensor-parallel over its chips, each holding the plugin's heads per device; the toy
    runs replicated; the torch backend leaves the mesh unused)."""
    if backend.eager_prefill and mesh_shape != (1, 2):
        pytest.skip("the decoder family's 1x2 case stands for the larger meshes (seconds each)")
    with _plugin_session(backend, monkeypatch, mesh_shape=mesh_shape) as session:
        heads = backend.hf.num_key_value_heads
        devices = mesh_shape[0] * mesh_shape[1]
        assert session.kv_heads == heads // min(devices, heads)
        assert session.model.config.devices_per_lane == devices
        device = session.run(_requests(DEVICE_WAVE), late=1, on_device=True, async_path=True)

        assert device == expected[1]


@pytest.mark.slow
def test_a_t3k_with_fewer_kv_heads_than_chips_takes_the_plugins_one_head_per_chip(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two KV heads on a T3K's 8 chips: the plugin allocates ``2 // min(8, 2)`` = 1 head per
    chip, the decoder family's lane replicates each KV head on the 4 chips of its query group
    and generates what ``LLM.generate`` does on the same 1x8 mesh (the 1x8 lane's tokens
    equal the one-chip lane's where bfloat16 leaves a margin: tests/integration/
    test_ttnn_families.py; here one penalized row starts on a near-tie). A minute and a half
    on the emulator's 8 chips: test_vllm_adapter.py checks the allocation in the default
    suite."""
    backend = replace(
        TTNN_DECODER,
        overrides=f"{TTNN_DECODER.overrides} model.hidden_size=256 model.num_attention_heads=8",
    )
    (expected,) = _generated(backend, DEVICE_WAVE, mesh_shape=(1, 8))
    with _plugin_session(backend, monkeypatch, mesh_shape=(1, 8)) as session:
        assert session.kv_heads == 1
        meta = session.model.group.lanes[0].kv_cache.borrowed_model.attention_metadata()
        assert (meta.tensor_parallel, meta.kv_heads_per_device) == (8, 1)
        device = session.run(_requests(DEVICE_WAVE), late=1, on_device=True, async_path=True)

        assert device == expected


def test_warmup_skipped_with_traces_on_warms_and_captures_at_the_first_request(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, expected: Expected
) -> None:
    """The worker's ``enable_model_warmup: false`` skips ``warmup_model``; traces stay on."""
    with _plugin_session(backend, monkeypatch, warmup=False) as session:
        assert not session.model.startup.active
        with pytest.warns(RuntimeWarning, match=r"skipped the model warmup .* s added to it"):
            device = session.run(_requests(DEVICE_WAVE), late=1, on_device=True, async_path=True)

        assert device == expected[1]
        assert "warmup_model_decode" not in session.calls
        for lane in session.model.group.lanes:
            assert lane.warmup.captured
