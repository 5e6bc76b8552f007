"""The model class Tenstorrent's vLLM plugin (``vllm_tt_plugin``) drives, over a lane group.

The plugin loads a registered ``TT<Architecture>`` class and calls it in a fixed order with
fixed argument forms (its ``loader.py``, ``worker.py``, ``model_runner.py``,
``async_decode.py`` and ``model_input.py``); :class:`VLLMAdapter` accepts exactly those:

``get_max_tokens_all_users(model_name=, num_devices=, tt_data_parallel=, max_model_len=,
max_num_seqs=)`` (class method)
    The KV token budget the plugin sizes its block pool from. The plugin then adds one
    block per sequence and divides by the block size, so the budget returned here makes
    that pool exactly the recipe's per-lane KV capacity.
``initialize_vllm_model(hf_config, mesh_device, max_batch_size, max_seq_len=,
tt_data_parallel=, optimizations=)`` (class method, first three positional)
    Picks the recipe from ``hf_config`` (:mod:`llmrt.vllm.recipe`), sets ``lanes`` to
    ``tt_data_parallel`` and ``decode.lane_capacity`` to ``max_batch_size //
    tt_data_parallel`` (the plugin pads each lane's decode batch to that many rows), wraps
    a raw ttnn mesh in a borrowed :class:`~llmrt.device.ttnn.TtnnDevice` when the recipe
    runs on ttnn, and builds the recipe's container (the adapter owns it).
``allocate_kv_cache(kv_cache_shape, dtype, num_layers)``
    ``kv_cache_shape = (num_blocks, kv_heads_per_device, block_size, head_dim)`` per lane.
    ``dtype`` is vLLM's model dtype, a sizing surrogate: the recipe's KV dtype is what is
    allocated (as tt-metal's generators do). Returns one KV handle per lane.
``warmup_model_prefill(kv_cache, enable_trace, can_sample_on_device[,
non_greedy_decoding_on_device])`` / ``warmup_model_decode(kv_cache, enable_trace,
max_batch_size, num_blocks, can_sample_on_device[, non_greedy_decoding_on_device])``
    ``num_blocks`` is vLLM's page-table width per request, ``min(cdiv(max_model_len,
    block_size), physical blocks)``. The ``non_greedy_decoding_on_device`` flag is the
    plugin's ``dev`` branch (llmrt samples every row on device either way).
``prefill_forward(tokens, page_table, kv_cache, enable_trace, prompt_lens, start_pos
[, sampling_params, empty_slots, page_tables_per_layer])``
    Logits ``[B, 1, vocab]`` (the plugin's host sampler reads ``out[rows, -1, :]``), or
    tokens ``[B]`` when the plugin samples on device (``sampling_params`` given; with
    log-probabilities requested, ``(tokens, logprobs)``).
``decode_forward(tokens, start_pos, page_table, kv_cache, enable_trace, read_from_device
[, sampling_params, prompt_tokens, output_tokens, reset_batch, slot_remap,
page_tables_per_layer, rope_deltas_all_users])``
    Row ``i`` is global decode slot ``i``; a negative ``start_pos`` is a padding row.
    Page tables arrive zero-padded to the plugin's width: only the columns a row's
    position reaches are read. ``slot_remap`` (row ``i`` takes the per-slot state of slot
    ``remap[i]``) moves the per-slot sampling step counters. With
    ``read_from_device=False`` the result is an opaque :class:`VLLMDecodeOutput`.
``read_decode_output(tt_out, async_read=)`` / ``process_decode_output_host(tt_out,
is_tokens=)``
    ``read_decode_output(..., async_read=True)`` returns ``(tt_out, events)`` whose events
    are what ``ttnn.event_synchronize`` accepts (the mesh's own events; none on a torch
    device, whose reads complete in ``process_decode_output_host``).
    ``process_decode_output_host`` takes the raw ``decode_forward`` output (the plugin's
    synchronous path), a read's output (the async path) or host tensors (returned as given).

``model_capabilities``, ``cache_path`` and ``cleanup`` complete what the plugin reads.
Direct callers may also pass llmrt ``SamplingParams`` and ``recipe=`` / ``overrides=``.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import attrs
import torch

from llmrt.device.base import Device
from llmrt.errors import ConfigError, IdentityError, RequestError
from llmrt.runtime.checks import first_outside
from llmrt.runtime.lane_group import LaneGroupExecutor, LaneGroupHost, LaneGroupLease
from llmrt.runtime.paged_kv_cache import PagedKVCacheContext
from llmrt.runtime.prefill.plan import PrefillRow
from llmrt.runtime.startup import StartupSequence
from llmrt.vllm.recipe import select_recipe
from llmrt.vllm.sampling import SamplingArg, per_row_params
from llmrt.weights.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llmrt.containers import RuntimeContainer
    from llmrt.recipe.loader import Overrides, Recipe
    from llmrt.runtime.decode import DecodeOutput
    from llmrt.runtime.prefill.result_collector import PrefillOutput

KVCacheArg = PagedKVCacheContext | Sequence[PagedKVCacheContext] | None
TokenListsArg = torch.Tensor | Sequence[Sequence[int]] | None
IntsArg = torch.Tensor | Sequence[int] | Any
TableArg = torch.Tensor | Sequence[Sequence[int]]
HostOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

#: vLLM's ``optimizations`` presets (the plugin accepts only these); the recipe fixes precision.
OPTIMIZATION_PRESETS = ("performance", "accuracy")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@attrs.frozen(kw_only=True)
class VLLMAdapterConfig:
    """The geometry a vLLM server must agree with, resolved once from the lane group."""

    block_size: int
    kv_dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    lane_capacity: int
    num_lanes: int
    max_num_blocks: int
    max_model_len: int
    vocab_size: int
    page_table_width: int
    devices_per_lane: int = 1
    """Chips of vLLM's mesh per lane (``mesh_device.get_num_devices() // tt_data_parallel``)."""

    @property
    def kv_heads_per_device(self) -> int:
        """The KV heads the plugin allocates per device: the model's over the lane's chips.

        The plugin's ``_kv_cache_shape`` (tensor parallelism is the model's business:
        ``num_kv_heads // min(devices per lane, num_kv_heads)``). It sizes vLLM's pool; a
        decoder family's lane holds the same heads per chip (its tensor-parallel layers split
        them over the lane's chips, or hold one replicated head a chip when the chips
        outnumber them; ``resolve`` checks the two agree); a model without tensor-parallel
        layers keeps every head on each chip."""
        return self.num_kv_heads // min(self.devices_per_lane, self.num_kv_heads)

    @property
    def max_batch_size(self) -> int:
        """Decode slots over all lanes."""
        return self.lane_capacity * self.num_lanes

    def legacy_kv_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """Legacy per-lane KV shape: ``(num_blocks, kv_heads_per_device, block_size, head_dim)``."""
        return (num_blocks, self.kv_heads_per_device, self.block_size, self.head_dim)

    @classmethod
    def resolve(
        cls,
        *,
        group: LaneGroupExecutor,
        max_model_len: int | None = None,
        mesh_devices: int | None = None,
    ) -> VLLMAdapterConfig:
        """Read the KV geometry, capacity and limits every lane must share.

        ``mesh_devices``: the chips of vLLM's mesh (None without one: one per lane); the
        lanes split them evenly, as the plugin's ``tt_data_parallel`` does."""
        lanes = len(group.lanes)
        if mesh_devices is None:
            mesh_devices = lanes
        elif not _is_int(mesh_devices) or mesh_devices < 1 or mesh_devices % lanes:
            raise ConfigError(
                "tt_data_parallel",
                lanes,
                f"must divide the vLLM mesh's {mesh_devices} devices into equal lanes",
            )
        first = group.lanes[0]
        meta = first.kv_cache.borrowed_model.attention_metadata()
        if meta.tensor_parallel > 1 and meta.tensor_parallel != mesh_devices // lanes:
            raise ConfigError(
                "tt_data_parallel",
                lanes,
                f"gives {mesh_devices // lanes} of vLLM's {mesh_devices} devices a lane, but "
                f"the lanes' models are tensor-parallel over {meta.tensor_parallel} chips "
                "(the recipe's device.ttnn.tensor_parallel)",
            )
        kv = first.kv_cache.config
        for lane in group.lanes[1:]:
            other = lane.kv_cache
            if (
                other.borrowed_model.attention_metadata() != meta
                or other.config.block_size != kv.block_size
                or other.config.dtype != kv.dtype
            ):
                raise IdentityError("every lane shares one KV geometry", first, lane)
        layout_len = first.layout.max_sequence_length
        if max_model_len is None:
            max_model_len = layout_len
        if not _is_int(max_model_len) or not 0 < max_model_len <= layout_len:
            raise ConfigError(
                "max_model_len",
                max_model_len,
                f"must be a positive integer within the lane layout's {layout_len} tokens",
            )
        return cls(
            block_size=kv.block_size,
            kv_dtype=kv.torch_dtype,
            num_layers=meta.num_layers,
            num_kv_heads=meta.num_kv_heads,
            head_dim=meta.head_dim,
            lane_capacity=group.lane_capacity,
            num_lanes=len(group.lanes),
            max_num_blocks=kv.num_blocks if kv.num_blocks is not None else kv.max_num_blocks,
            max_model_len=max_model_len,
            vocab_size=first.decode.config.vocab_size,
            page_table_width=first.layout.width,
            devices_per_lane=mesh_devices // lanes,
        )

    def validate_kv_spec(
        self, *, kv_cache_shape: Sequence[int], dtype: object, num_layers: int
    ) -> int:
        """Check a legacy KV spec against the model; returns its ``num_blocks``.

        ``dtype`` must be a floating torch dtype: vLLM sends the model's dtype as a
        surrogate for sizing, while the recipe's ``kv_cache.dtype`` is what is stored.
        """
        shape = tuple(kv_cache_shape)
        if len(shape) != 4 or not all(_is_int(d) for d in shape):
            raise ConfigError(
                "kv_cache_shape",
                shape,
                "must be (num_blocks, kv_heads_per_device, block_size, head_dim) integers",
            )
        if num_layers != self.num_layers:
            raise ConfigError(
                "num_layers", num_layers, f"the model has {self.num_layers} attention layers"
            )
        expected = self.legacy_kv_shape(shape[0])
        for index, name in ((1, "kv_heads_per_device"), (2, "block_size"), (3, "head_dim")):
            if shape[index] != expected[index]:
                what = (
                    f"the model's {self.num_kv_heads} KV heads over {self.devices_per_lane} "
                    f"device(s) per lane are {expected[index]} per device"
                    if index == 1
                    else f"the model's {name} is {expected[index]}"
                )
                raise ConfigError(
                    f"kv_cache_shape[{index}] ({name})",
                    shape[index],
                    f"{what} (expected shape {expected})",
                )
        named = (
            getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
        )
        if not isinstance(named, torch.dtype) or not named.is_floating_point:
            raise ConfigError("dtype", dtype, "must be a floating torch dtype (vLLM's model dtype)")
        num_blocks = shape[0]
        if not 0 < num_blocks <= self.max_num_blocks:
            raise ConfigError(
                "kv_cache_shape[0] (num_blocks)",
                num_blocks,
                f"must be in [1, {self.max_num_blocks}], the recipe's per-lane KV capacity "
                "(raise kv_cache.max_num_blocks, e.g. through LLMRT_VLLM_OVERRIDES)",
            )
        return num_blocks


@attrs.define(kw_only=True, eq=False)
class VLLMDecodeOutput:
    """A decode step not yet read back (``decode_forward(read_from_device=False)``)."""

    lease: LaneGroupLease
    is_tokens: bool
    logprobs: bool
    host: LaneGroupHost | None = None


class VLLMAdapter:
    """vLLM's TT model interface over a lane group (owns the container it built, if any)."""

    #: What the plugin reads before loading the model (``platform.py``).
    model_capabilities: Mapping[str, bool] = MappingProxyType(
        {
            "supports_prefix_caching": True,  # cached prefixes arrive as start_pos
            # read_from_device=False + read_decode_output; a steady step submitted before the
            # previous one was read continues it on the device (see decode_forward)
            "supports_async_decode": True,
            "supports_sample_on_device": True,  # TTSamplingParams in, tokens out
        }
    )

    def __init__(
        self,
        *,
        group: LaneGroupExecutor,
        config: VLLMAdapterConfig,
        tokenizer: Tokenizer | None = None,
        owned_container: RuntimeContainer | None = None,
        recipe: Recipe | None = None,
        optimizations: str | None = None,
        startup: StartupSequence | None = None,
    ) -> None:
        self.group = group
        self.config = config
        self.tokenizer = tokenizer
        self.recipe = recipe
        self.optimizations = optimizations
        self._container = owned_container
        self._closed = False
        # vLLM drives the runtime's one startup sequence phase by phase, in its own call order.
        self.startup = startup if startup is not None else StartupSequence(group=group)
        if self.startup.group is not group:
            raise IdentityError(
                "the startup sequence starts the adapter's lane group", self.startup.group, group
            )
        #: Per decode slot: how many tokens the request there has produced (seeded sampling
        #: draws output ``n`` from ``(seed, n)``, as ``LLM.generate`` does).
        self._steps = [0] * config.max_batch_size
        #: The last decode step when it sampled on the device: its live slots and positions.
        #: A next step on the same slots without ``reset_batch`` continues it on the device.
        self._continued: tuple[frozenset[int], torch.Tensor] | None = None

    # -- construction --------------------------------------------------------------------

    @classmethod
    def get_max_tokens_all_users(
        cls,
        model_name: str = "",
        num_devices: int = 1,
        tt_data_parallel: int = 1,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        **_: Any,
    ) -> int:
        """KV tokens per lane that make vLLM's pool exactly the recipe's KV capacity.

        The plugin computes ``ceil((this + block_size * max_num_seqs) / block_size)``
        blocks per lane (``max_num_seqs`` per lane), so this is the capacity less one
        block per sequence (at least one block).
        """
        choice = select_recipe(hf_config=_local_hf_config(model_name), model_name=model_name)
        recipe = choice.load()
        kv = recipe.kv_cache
        blocks = kv.num_blocks if kv.num_blocks is not None else kv.max_num_blocks
        per_lane = max_num_seqs if max_num_seqs else recipe.decode.lane_capacity
        return max(blocks - int(per_lane), 1) * kv.block_size

    @classmethod
    def initialize_vllm_model(
        cls,
        hf_config: object,
        mesh_device: object = None,
        max_batch_size: int | None = None,
        max_seq_len: int | None = None,
        tt_data_parallel: int = 1,
        optimizations: str | None = None,
        *,
        recipe: str | None = None,
        overrides: Overrides | None = None,
    ) -> VLLMAdapter:
        """Build the recipe's container for vLLM's sizes and wrap its lane group."""
        from llmrt.containers import Borrowed, RuntimeContainer, close_runtime

        if optimizations is not None and optimizations not in OPTIMIZATION_PRESETS:
            raise ConfigError(
                "optimizations", optimizations, f"must be None or one of {OPTIMIZATION_PRESETS}"
            )
        lanes = 1 if tt_data_parallel is None else tt_data_parallel
        if not _is_int(lanes) or lanes < 1:
            raise ConfigError("tt_data_parallel", tt_data_parallel, "must be a positive integer")
        lane_capacity = None
        if max_batch_size is not None:
            if not _is_int(max_batch_size) or max_batch_size < lanes:
                raise ConfigError(
                    "max_batch_size", max_batch_size, f"must be an integer >= {lanes} (lanes)"
                )
            if max_batch_size % lanes:
                raise ConfigError(
                    "max_batch_size",
                    max_batch_size,
                    f"must split evenly over tt_data_parallel={lanes} lanes",
                )
            lane_capacity = max_batch_size // lanes
        choice = select_recipe(hf_config=hf_config, recipe=recipe, overrides=overrides)
        loaded = choice.load_for(lanes=lanes, lane_capacity=lane_capacity)
        if max_seq_len is not None and (
            not _is_int(max_seq_len) or not 0 < max_seq_len <= loaded.max_model_len
        ):
            raise ConfigError(
                "max_seq_len",
                max_seq_len,
                f"exceeds the recipe's serving.max_model_len={loaded.max_model_len} "
                "(pass vLLM --max-model-len at most that)",
            )
        device = _device_for(mesh_device, loaded)
        container = RuntimeContainer(recipe=loaded)
        if device is not None:
            # vLLM opened the mesh and closes it: the runtime borrows it (teardown leaves it).
            container.device.device.override(Borrowed(device))
        try:
            group = container.lane_group()
            config = VLLMAdapterConfig.resolve(
                group=group,
                max_model_len=min(
                    max_seq_len or loaded.max_model_len,
                    group.lanes[0].layout.max_sequence_length,
                ),
                mesh_devices=_mesh_devices(mesh_device),
            )
            vocab = _field(hf_config, "vocab_size")
            if _is_int(vocab) and vocab != config.vocab_size:
                raise ConfigError(
                    "hf_config.vocab_size", vocab, f"the recipe's model has {config.vocab_size}"
                )
            tokenizer = container.model.tokenizer()
            startup = container.startup()
        except BaseException as exc:
            close_runtime(container, primary=exc)
            raise
        return cls(
            group=group,
            config=config,
            tokenizer=tokenizer,
            owned_container=container,
            recipe=loaded,
            optimizations=optimizations,
            startup=startup,
        )

    @property
    def cache_path(self) -> Path:
        """Where llmrt keeps converted checkpoints and compiled programs (``LLMRT_CACHE_DIR``)."""
        from llmrt.paths import default_cache_dir

        return default_cache_dir()

    def close(self, *, primary: BaseException | None = None) -> None:
        """Tear down the container this adapter built (nothing when it borrows); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._container is not None:
            from llmrt.containers import close_runtime

            close_runtime(self._container, primary=primary)

    def cleanup(self) -> None:
        """The name tt-metal's generators use for :meth:`close`."""
        self.close()

    def __del__(self) -> None:
        # The plugin never calls cleanup: its worker drops the model runner, then closes the
        # mesh. Release the runtime first; an error here cannot propagate, so warn.
        if getattr(self, "_closed", True):
            return
        try:
            self.close()
        except Exception as exc:  # pragma: no cover - depends on interpreter teardown
            warnings.warn(f"VLLMAdapter teardown failed: {exc}", RuntimeWarning, stacklevel=1)

    def __enter__(self) -> VLLMAdapter:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close(primary=exc)

    # -- KV cache ------------------------------------------------------------------------

    def allocate_kv_cache(
        self, kv_cache_shape: Sequence[int], dtype: object, num_layers: int
    ) -> list[PagedKVCacheContext]:
        """Validate vLLM's KV spec, fix the physical capacity, allocate every lane's KV."""
        num_blocks = self.config.validate_kv_spec(
            kv_cache_shape=kv_cache_shape, dtype=dtype, num_layers=num_layers
        )
        for lane in self.group.lanes:
            lane.kv_cache.validate_vllm_cache_spec(
                block_size=self.config.block_size, dtype=self.config.kv_dtype, num_blocks=num_blocks
            )
        self.startup.configure_kv_capacity(num_blocks)
        return self.startup.allocate_kv_cache()

    def _check_kv(self, kv_cache: KVCacheArg) -> None:
        lanes = self.group.lanes
        if kv_cache is None:
            for lane in lanes:
                _ = lane.kv_cache.context  # raises unless allocated and bound
            return
        handles = [kv_cache] if isinstance(kv_cache, PagedKVCacheContext) else list(kv_cache)
        if len(handles) != len(lanes):
            raise RequestError("kv_cache", f"has {len(handles)} handle(s) for {len(lanes)} lane(s)")
        for lane, handle in zip(lanes, handles, strict=True):
            lane.kv_cache.validate_handle(handle)

    # -- warmup --------------------------------------------------------------------------

    def warmup_model_prefill(
        self,
        kv_cache: KVCacheArg = None,
        enable_trace: bool = False,
        can_sample_on_device: bool = False,
        non_greedy_decoding_on_device: bool = False,
    ) -> None:
        """Compile every lane's prefill coverage (capture follows once decode is warm too).

        Both sampling flags are hints: llmrt compiles the logits and the sampled paths.
        """
        self._check_warmup(kv_cache, enable_trace)
        self.startup.warmup_prefill()
        self._activate_when_warm()

    def warmup_model_decode(
        self,
        kv_cache: KVCacheArg = None,
        enable_trace: bool = False,
        max_batch_size: int | None = None,
        num_blocks: int | None = None,
        can_sample_on_device: bool = False,
        non_greedy_decoding_on_device: bool = False,
    ) -> None:
        """Compile every lane's decode program (capture follows once prefill is warm too).

        ``num_blocks`` is vLLM's blocks per request (its page-table width).
        """
        self._check_warmup(kv_cache, enable_trace)
        cfg = self.config
        if max_batch_size is not None and not 0 < max_batch_size <= cfg.max_batch_size:
            raise RequestError(
                "max_batch_size",
                f"must be in [1, {cfg.max_batch_size}] (the decode slots)",
                value=max_batch_size,
            )
        if num_blocks is not None and not 0 < num_blocks <= cfg.page_table_width:
            raise RequestError(
                "num_blocks",
                f"blocks per request must be in [1, {cfg.page_table_width}] (the lane "
                "layout's page-table width)",
                value=num_blocks,
            )
        self.startup.warmup_decode()
        self._activate_when_warm()

    def _activate_when_warm(self) -> None:
        """vLLM warms prefill and decode in either order; the second one activates."""
        if self.startup.warmed:
            self.startup.activate()

    def _start_if_not_warmed(self) -> None:
        """Warm and capture at the first request when vLLM skipped the warmup.

        The plugin's ``enable_model_warmup: false`` skips ``warmup_model`` (the model is not
        told): like tt-metal's generators, which capture a trace at its first use, llmrt then
        runs its whole warmup (compile every covered shape, capture the traces) before the
        first request, and warns with what it cost. Nothing is left uncaptured, so a traced
        step never meets a missing trace.
        """
        if self.startup.active:
            return
        started = time.perf_counter()
        self.startup.warmup_decode()
        self.startup.warmup_prefill()
        self.startup.activate()
        took = time.perf_counter() - started
        warnings.warn(
            "vLLM skipped the model warmup (enable_model_warmup: false): llmrt compiled and "
            f"captured its coverage at the first request instead ({took:.2f} s added to it)",
            RuntimeWarning,
            stacklevel=3,
        )

    def _check_warmup(self, kv_cache: KVCacheArg, enable_trace: bool) -> None:
        self._check_kv(kv_cache)
        if enable_trace and any(lane.traced is None for lane in self.group.lanes):
            raise RequestError(
                "enable_trace",
                "the recipe's trace.mode is none (set the plugin's trace_mode to none)",
                value=True,
            )

    # -- prefill -------------------------------------------------------------------------

    def prefill_rows(
        self,
        *,
        tokens: TableArg,
        page_table: TableArg,
        prompt_lens: IntsArg | None = None,
        start_pos: IntsArg | None = None,
        empty_slots: IntsArg | None = None,
    ) -> list[PrefillRow]:
        """vLLM prefill arguments as planner rows with GLOBAL slots (the group routes them).

        ``page_table`` columns past the blocks a prompt needs are padding (vLLM zero-fills).
        """
        cfg = self.config
        tok, given_lens = _padded("tokens", tokens)
        rows, width = int(tok.shape[0]), int(tok.shape[1])
        if rows == 0:
            raise RequestError("tokens", "prefill needs at least one row")
        lens = (
            _int_list("prompt_lens", prompt_lens, rows) if prompt_lens is not None else given_lens
        )
        cached = _int_list("start_pos", start_pos, rows) if start_pos is not None else [0] * rows
        slots = (
            _int_list("empty_slots", empty_slots, rows)
            if empty_slots is not None
            else list(range(rows))
        )
        table = _int_tensor("page_table", page_table)
        if table.dim() != 2 or table.shape[0] != rows:
            raise RequestError("page_table", f"must be [{rows}, width]", value=tuple(table.shape))
        bs = cfg.block_size
        seen: dict[int, int] = {}
        out = []
        for i in range(rows):
            n, c, slot = lens[i], cached[i], slots[i]
            if not 0 < n <= width:
                raise RequestError("prompt_lens", f"must be in [1, {width}]", row=i, value=n)
            if n > cfg.max_model_len:
                raise RequestError(
                    "prompt_lens", f"exceeds max_model_len={cfg.max_model_len}", row=i, value=n
                )
            prompt = tok[i, :n]
            bad = first_outside(prompt, low=0, high=cfg.vocab_size)
            if bad is not None:
                (at,) = bad
                raise RequestError(
                    "tokens",
                    f"token id at position {at} out of range [0, {cfg.vocab_size})",
                    row=i,
                    value=int(prompt[at]),
                )
            if not 0 <= c < n or c % bs:
                raise RequestError(
                    "start_pos",
                    f"cached prefix must be a multiple of block_size={bs} below the prompt "
                    f"length {n}",
                    row=i,
                    value=c,
                )
            if not 0 <= slot < cfg.max_batch_size:
                raise RequestError(
                    "empty_slots", f"must be a slot in [0, {cfg.max_batch_size})", row=i, value=slot
                )
            if slot in seen:
                raise RequestError(
                    "empty_slots", f"slot is already used by row {seen[slot]}", row=i, value=slot
                )
            seen[slot] = i
            need = -(-n // bs)
            if need > table.shape[1]:
                raise RequestError(
                    "page_table",
                    f"has {table.shape[1]} columns; {n} tokens need {need} blocks",
                    row=i,
                )
            blocks = table[i, :need]
            physical = self.group.lanes[slot // cfg.lane_capacity].layout.num_blocks
            invalid = first_outside(blocks, low=0, high=physical)
            if invalid is not None:
                (col,) = invalid
                raise RequestError(
                    "page_table",
                    f"block id at column {col} must be in [0, {physical})",
                    row=i,
                    value=int(blocks[col]),
                )
            out.append(
                PrefillRow(
                    source_row=i,
                    tokens=prompt.to(torch.int64).clone(),
                    cached_tokens=c,
                    slot=slot,
                    block_ids=tuple(int(b) for b in blocks.tolist()),
                )
            )
        return out

    def prefill_forward(
        self,
        tokens: TableArg,
        page_table: TableArg,
        kv_cache: KVCacheArg = None,
        enable_trace: bool | None = None,
        prompt_lens: IntsArg | None = None,
        start_pos: IntsArg | None = None,
        sampling_params: SamplingArg = None,
        empty_slots: IntsArg | None = None,
        page_tables_per_layer: Sequence[TableArg] | None = None,
        prompt_tokens: TokenListsArg = None,
        output_tokens: TokenListsArg = None,
    ) -> HostOutput:
        """Prefill vLLM's padded batch: logits ``[B, 1, vocab]``, or tokens ``[B]`` if sampling."""
        self._check_kv(kv_cache)
        _check_per_layer(page_tables_per_layer, page_table, self.config.num_layers)
        rows = self.prefill_rows(
            tokens=tokens,
            page_table=page_table,
            prompt_lens=prompt_lens,
            start_pos=start_pos,
            empty_slots=empty_slots,
        )
        params = per_row_params(sampling_params, len(rows), vocab_size=self.config.vocab_size)
        history = self._history(prompt_tokens, output_tokens, len(rows))
        if history is None and any(p is not None and p.has_penalties for p in params or ()):
            # The plugin sends no history with a prefill: penalties see the prompt.
            history = [(row.tokens.tolist(), []) for row in rows]
        self._start_if_not_warmed()  # after the arguments are checked
        out = self.group.prefill_forward(
            rows=rows, sampling_params=params, history=history, enable_trace=enable_trace
        )
        for row in rows:
            self._steps[row.slot] = 1  # output 0 came from this prefill
        self._continued = None  # the plugin resets the decode batch after a prefill
        return _host_output(out, params, what="prefill")

    # -- decode --------------------------------------------------------------------------

    def decode_forward(
        self,
        tokens: IntsArg,
        start_pos: IntsArg,
        page_table: TableArg,
        kv_cache: KVCacheArg = None,
        enable_trace: bool | None = None,
        read_from_device: bool = True,
        sampling_params: SamplingArg = None,
        prompt_tokens: TokenListsArg = None,
        output_tokens: TokenListsArg = None,
        reset_batch: bool = False,
        slot_remap: IntsArg | None = None,
        page_tables_per_layer: Sequence[TableArg] | None = None,
        rope_deltas_all_users: Sequence[float] | IntsArg | None = None,
    ) -> HostOutput | VLLMDecodeOutput:
        """One decode step over global slots ``0..B-1``; a handle when not reading back."""
        self._check_kv(kv_cache)
        cfg = self.config
        tok = _int_tensor("tokens", tokens)
        if tok.dim() == 2 and tok.shape[1] == 1:
            tok = tok.reshape(-1)
        if tok.dim() != 1 or tok.numel() == 0:
            raise RequestError("tokens", "must be [batch] or [batch, 1]", value=tuple(tok.shape))
        rows = int(tok.numel())
        if rows > cfg.max_batch_size:
            raise RequestError(
                "tokens", f"batch exceeds the {cfg.max_batch_size} decode slots", value=rows
            )
        pos = torch.tensor(_int_list("start_pos", start_pos, rows), dtype=torch.int64)
        _check_per_layer(page_tables_per_layer, page_table, cfg.num_layers)
        _check_rope_deltas(rope_deltas_all_users)
        params = per_row_params(sampling_params, rows, vocab_size=cfg.vocab_size)
        inactive = pos < 0
        active = [i for i in range(rows) if not bool(inactive[i])]
        continues = self._continues(params is not None, reset_batch, slot_remap, active)
        if continues:
            pos = self._continued_positions(pos, active)
        table = self._decode_table(page_table, pos, rows)
        tok = torch.where(inactive, torch.zeros_like(tok), tok)
        pos = torch.where(inactive, torch.zeros_like(pos), pos)
        self._remap_slots(slot_remap, rows)
        offsets = [self._steps[i] if i in active else 0 for i in range(rows)]
        self._start_if_not_warmed()  # after the arguments are checked
        out = self.group.decode_forward(
            tokens=tok,
            start_pos=pos,
            page_table=table,
            sampling_params=params,
            step_offsets=offsets,
            reset_batch=reset_batch,
            read_from_device=read_from_device,
            history=self._history(prompt_tokens, output_tokens, rows),
            enable_trace=enable_trace,
            tokens_from_device=continues,
        )
        for i in active:
            self._steps[i] += 1
        self._continued = (frozenset(active), pos.clone()) if params is not None else None
        if isinstance(out, LaneGroupLease):
            return VLLMDecodeOutput(
                lease=out, is_tokens=params is not None, logprobs=_wants_logprobs(params)
            )
        return _host_output(out, params, what="decode")

    def _continues(
        self,
        sampling_on_device: bool,
        reset_batch: bool,
        slot_remap: IntsArg | None,
        active: list[int],
    ) -> bool:
        """Whether this step continues the last one on the device (tt-metal's generators).

        Sampling on device without ``reset_batch``, the plugin's steady decode, which it
        may submit before it read the previous step (vLLM's async scheduling): its host
        tokens and positions can lag. Such a step takes the previous step's sampled tokens
        and advances its positions by one, as the generators skip copying host inputs then.
        The plugin sets ``reset_batch`` whenever its batch layout changed; a step whose live
        slots differ from the last one's is refused rather than fed from the wrong rows.
        """
        last = self._continued
        if not sampling_on_device or reset_batch or last is None:
            return False
        if slot_remap is not None:
            remap = _int_tensor("slot_remap", slot_remap).reshape(-1).tolist()
            if remap != list(range(len(remap))):
                return False  # the rows moved: the host's inputs are the layout's
        if frozenset(active) != last[0]:
            raise RequestError(
                "reset_batch",
                "the decode batch's live slots changed without reset_batch "
                f"(last step {sorted(last[0])}, this one {sorted(active)})",
            )
        return True

    def _continued_positions(self, pos: torch.Tensor, active: list[int]) -> torch.Tensor:
        """Each live slot's position on the device: the last step's + 1.

        The host's may lag (the plugin submitted before reading), never lead.
        """
        last = self._continued
        assert last is not None
        out = pos.clone()
        for i in active:
            expected = int(last[1][i]) + 1
            if int(pos[i]) > expected:
                raise RequestError(
                    "start_pos",
                    f"is ahead of the device's position {expected} for this slot "
                    "(the previous decode step was not on it)",
                    row=i,
                    value=int(pos[i]),
                )
            out[i] = expected
        return out

    def _decode_table(self, page_table: TableArg, pos: torch.Tensor, rows: int) -> torch.Tensor:
        """vLLM's zero-padded table as lane-layout columns: only the blocks a row reaches."""
        cfg = self.config
        table = _int_tensor("page_table", page_table)
        if table.dim() != 2 or table.shape[0] != rows:
            raise RequestError("page_table", f"must be [{rows}, width]", value=tuple(table.shape))
        width = cfg.page_table_width
        reach = torch.where(pos < 0, torch.zeros_like(pos), pos // cfg.block_size + 1)
        too_far = (reach > min(width, int(table.shape[1]))).nonzero()
        if too_far.numel():
            r = int(too_far[0, 0])
            raise RequestError(
                "start_pos",
                f"position needs block column {int(reach[r]) - 1}, past the page table's "
                f"{min(width, int(table.shape[1]))} columns",
                row=r,
                value=int(pos[r]),
            )
        cols = torch.arange(min(width, int(table.shape[1])))
        kept = table[:, : cols.numel()]
        return torch.where(cols.unsqueeze(0) < reach.unsqueeze(1), kept, torch.full_like(kept, -1))

    def _remap_slots(self, slot_remap: IntsArg | None, rows: int) -> None:
        """Row ``i`` takes slot ``remap[i]``'s per-slot state (a gather over the slots)."""
        if slot_remap is None:
            return
        remap = [int(v) for v in _int_tensor("slot_remap", slot_remap).reshape(-1).tolist()]
        n = len(remap)
        cfg = self.config
        if not rows <= n <= cfg.max_batch_size or sorted(remap) != list(range(n)):
            raise RequestError(
                "slot_remap",
                f"must be a permutation of 0..{n - 1} covering the {rows} rows "
                f"(at most {cfg.max_batch_size} slots)",
                value=remap,
            )
        cap = cfg.lane_capacity
        for i, src in enumerate(remap):
            if src // cap != i // cap:
                raise RequestError(
                    "slot_remap",
                    f"moves slot {src} to row {i} across lanes (KV blocks are lane-local)",
                    row=i,
                    value=src,
                )
        moved = [self._steps[src] for src in remap]
        self._steps[:n] = moved

    # -- decode output -------------------------------------------------------------------

    def read_decode_output(
        self, tt_out: VLLMDecodeOutput, async_read: bool = False
    ) -> VLLMDecodeOutput | tuple[VLLMDecodeOutput, list[Any]]:
        """Start reading a decode step: ``(tt_out, events)`` if async, else ``tt_out`` read.

        The events are what ``ttnn.event_synchronize`` takes: the mesh's own events (none
        on a torch device, whose read completes in ``process_decode_output_host``).
        """
        out = _decode_handle(tt_out)
        if out.host is not None:
            raise RequestError("tt_out", "this decode output is already being read")
        host, events = self.group.read_decode_output(out.lease, async_read=async_read)
        if not isinstance(host, LaneGroupHost):
            raise RuntimeError("the lane group returned an unexpected host value")
        out.host = host
        return (out, _native_events(events)) if async_read else out

    def process_decode_output_host(self, tt_out: Any, is_tokens: bool = False) -> HostOutput:
        """Complete a decode read: tokens ``[B]`` or logits ``[B, 1, vocab]``.

        Takes ``decode_forward``'s raw output (read here), ``read_decode_output``'s, or
        host tensors (returned as they are: the plugin's ``dev`` branch passes those too).
        """
        if isinstance(tt_out, torch.Tensor) or (
            isinstance(tt_out, tuple) and all(isinstance(t, torch.Tensor) for t in tt_out)
        ):
            return tt_out
        out = _decode_handle(tt_out)
        if is_tokens != out.is_tokens:
            raise RequestError(
                "is_tokens",
                f"the decode step produced {'tokens' if out.is_tokens else 'logits'}",
                value=is_tokens,
            )
        host = out.host
        if host is None:
            host, _ = self.group.read_decode_output(out.lease, async_read=False)
        out.host = None
        result = self.group.process_decode_output_host(host, is_tokens=is_tokens)
        return _format(result, tokens=is_tokens, logprobs=out.logprobs, what="decode")

    # -- helpers -------------------------------------------------------------------------

    def _history(
        self, prompt_tokens: TokenListsArg, output_tokens: TokenListsArg, rows: int
    ) -> list[tuple[list[int], list[int]]] | None:
        if prompt_tokens is None and output_tokens is None:
            return None
        vocab = self.config.vocab_size
        prompts = _token_lists("prompt_tokens", prompt_tokens, rows, vocab)
        outputs = _token_lists("output_tokens", output_tokens, rows, vocab)
        return list(zip(prompts, outputs, strict=True))


# -- module helpers ----------------------------------------------------------------------


def _field(obj: object, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _local_hf_config(model_name: str) -> dict[str, Any] | None:
    """``config.json`` of a local checkpoint directory (the plugin passes only its name)."""
    path = Path(model_name) / "config.json" if model_name else None
    if path is None or not path.is_file():
        return None
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    return {**data, "_name_or_path": model_name} if isinstance(data, dict) else None


def _device_for(mesh_device: object, recipe: Recipe) -> Device | None:
    """The device vLLM's mesh becomes: None keeps the recipe's own."""
    if mesh_device is None or isinstance(mesh_device, Device):
        return mesh_device
    if recipe.device.backend != "ttnn":
        warnings.warn(
            f"recipe {recipe.name!r} runs on device.backend={recipe.device.backend}; the "
            "vLLM mesh is not used (set device.backend=ttnn to run on it)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    from llmrt.device.ttnn import TtnnDevice, import_ttnn

    return TtnnDevice(mesh_device, ttnn_module=import_ttnn(), owns_mesh=False)


def _mesh_devices(mesh_device: object) -> int | None:
    """Chips in vLLM's mesh, as the plugin's worker counts them (None without a mesh)."""
    if mesh_device is None:
        return None
    if isinstance(mesh_device, Device):  # a ttnn device counts its chips; torch: one a lane
        chips = getattr(mesh_device, "num_devices", None)
        return chips if isinstance(chips, int) and not isinstance(chips, bool) else None
    count = getattr(mesh_device, "get_num_devices", None)
    if count is None:
        raise ConfigError(
            "mesh_device",
            type(mesh_device).__name__,
            "must be a ttnn MeshDevice (get_num_devices) or an llmrt Device",
        )
    return int(count())


def _native_events(events: Sequence[Any]) -> list[Any]:
    from llmrt.device.ttnn import TtnnEvent

    return [e.mesh_event for e in events if isinstance(e, TtnnEvent)]


def _decode_handle(value: object) -> VLLMDecodeOutput:
    if not isinstance(value, VLLMDecodeOutput):
        raise RequestError(
            "tt_out",
            "must be what decode_forward(read_from_device=False) returned",
            value=type(value).__name__,
        )
    return value


def _wants_logprobs(params: Sequence[Any] | None) -> bool:
    return params is not None and any(p is not None and p.logprobs is not None for p in params)


def _host_output(
    out: PrefillOutput | DecodeOutput, params: Sequence[Any] | None, *, what: str
) -> HostOutput:
    return _format(out, tokens=params is not None, logprobs=_wants_logprobs(params), what=what)


def _format(
    out: PrefillOutput | DecodeOutput, *, tokens: bool, logprobs: bool, what: str
) -> HostOutput:
    if not tokens:
        if out.logits is None:
            raise RuntimeError(f"{what} produced no logits")
        return out.logits.unsqueeze(1)  # [B, 1, vocab]: the plugin reads out[rows, -1, :]
    if out.tokens is None:
        raise RuntimeError(f"{what} produced no tokens")
    if logprobs:
        if out.logprobs is None:
            raise RuntimeError(f"{what} produced no log-probabilities")
        return out.tokens, out.logprobs
    return out.tokens


def _check_per_layer(tables: Sequence[TableArg] | None, page_table: TableArg, layers: int) -> None:
    """llmrt models have one KV group: per-layer tables must all be the page table."""
    if tables is None:
        return
    listed = list(tables)
    if len(listed) != layers:
        raise RequestError("page_tables_per_layer", f"has {len(listed)} tables for {layers} layers")
    main = _int_tensor("page_table", page_table)
    for i, table in enumerate(listed):
        if not torch.equal(_int_tensor("page_tables_per_layer", table), main):
            raise RequestError(
                "page_tables_per_layer",
                "differs from page_table: llmrt models use one KV group for every layer",
                row=i,
            )


def _check_rope_deltas(deltas: object) -> None:
    """mRoPE position deltas: llmrt's families use plain RoPE, so every delta must be 0."""
    if deltas is None:
        return
    values = torch.as_tensor(deltas).reshape(-1)
    if bool((values != 0).any()):
        raise RequestError(
            "rope_deltas_all_users",
            "llmrt families have no mRoPE (every delta must be 0)",
            value=values.tolist(),
        )


def _int_tensor(field: str, value: object) -> torch.Tensor:
    try:
        tensor = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise RequestError(field, f"must be an integer tensor ({exc})") from exc
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise RequestError(field, "must hold integers", value=str(tensor.dtype))
    return tensor.to(torch.int64)


def _int_list(field: str, value: object, rows: int) -> list[int]:
    values = _int_tensor(field, value).reshape(-1).tolist()
    if len(values) != rows:
        raise RequestError(field, f"has {len(values)} entries for {rows} rows")
    return [int(v) for v in values]


def _padded(field: str, value: TableArg) -> tuple[torch.Tensor, list[int]]:
    """A ``[B, S]`` tensor and each row's given length (ragged lists are right-padded)."""
    if isinstance(value, torch.Tensor) or hasattr(value, "__array__"):
        tensor = _int_tensor(field, value)
        if tensor.dim() != 2:
            raise RequestError(field, "must be [batch, length]", value=tuple(tensor.shape))
        return tensor, [int(tensor.shape[1])] * int(tensor.shape[0])
    seqs = [_int_tensor(field, list(seq)).reshape(-1) for seq in value]
    width = max((s.numel() for s in seqs), default=0)
    tensor = torch.zeros((len(seqs), width), dtype=torch.int64)
    for i, seq in enumerate(seqs):
        tensor[i, : seq.numel()] = seq
    return tensor, [int(s.numel()) for s in seqs]


def _token_lists(field: str, value: TokenListsArg, rows: int, vocab: int) -> list[list[int]]:
    """Per-row token ids; in a 2-D tensor, ids outside ``[0, vocab)`` (vLLM's -1) are padding.

    A tensor with fewer rows than the batch leaves the rest without history.
    """
    if value is None:
        return [[] for _ in range(rows)]
    if isinstance(value, torch.Tensor):
        tensor = _int_tensor(field, value)
        if tensor.dim() != 2 or tensor.shape[0] > rows:
            raise RequestError(field, f"must be [<= {rows}, length]", value=tuple(tensor.shape))
        lists = [[int(t) for t in row.tolist() if 0 <= t < vocab] for row in tensor]
        return lists + [[] for _ in range(rows - len(lists))]
    lists = [[int(t) for t in seq] for seq in value]
    if len(lists) != rows:
        raise RequestError(field, f"has {len(lists)} rows for {rows}")
    for i, seq in enumerate(lists):
        bad = [t for t in seq if not 0 <= t < vocab]
        if bad:
            raise RequestError(field, f"token id out of range [0, {vocab})", row=i, value=bad[0])
    return lists
