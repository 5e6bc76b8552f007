"""vLLM call normalization and legacy physical KV-shape validation.

:class:`VLLMAdapter` is the plugin-facing facade a vLLM model runner drives. It sits
over a :class:`~llmrt.lane_group.LaneGroupExecutor` (one lane is the degenerate
group) and turns vLLM-shaped arguments into the runtime's own calls:

``initialize_vllm_model(recipe=..., ...)``
    Builds a :class:`~llmrt.containers.RuntimeContainer` from a recipe; vLLM's
    ``tt_data_parallel`` becomes the ``lanes`` override, ``max_batch_size`` and
    ``max_seq_len`` are checked against the recipe, a ``mesh_device`` (an llmrt
    ``Device``) overrides the container's device provider. The adapter owns that
    container (``close()`` tears it down).
``allocate_kv_cache(kv_cache_shape, dtype, num_layers)``
    The legacy spec: ``kv_cache_shape = (num_blocks, kv_heads_per_device, block_size,
    head_dim)`` per lane. Layer count, KV heads, block size, head dim and dtype must
    match the model (``ConfigError`` naming the mismatch); ``num_blocks`` becomes the
    physical capacity (shrink only), then every lane allocates. Returns one borrowed
    :class:`~llmrt.paged_kv_cache.PagedKVCacheContext` per lane (the lanes own the tensors).
``prefill_forward(tokens, page_table, kv_cache, enable_trace, prompt_lens, start_pos,
sampling_params, empty_slots)``
    ``tokens`` ``[B, S]`` right-padded full prompts (cached prefix included), ``prompt_lens``
    ``[B]`` (None: ``S``), ``page_table`` ``[B, W]`` lane-local block ids of each row's lane,
    ``start_pos`` ``[B]`` cached prefix tokens per row (None: 0), ``empty_slots`` ``[B]``
    global decode slots (None: ``0..B-1``; lane = slot // lane capacity). Returns tokens
    ``[B]`` (int64), or last-token logits ``[B, vocab]`` when ``sampling_params`` is None,
    in row order.
``decode_forward(tokens, page_table, kv_cache, start_pos, sampling_params, reset_batch,
enable_trace, read_from_device)``
    Row ``i`` is global slot ``i``; ``tokens`` ``[B]`` or ``[B, 1]``; a negative
    ``start_pos`` marks an inactive slot (its page-table row becomes ``-1``: no KV write).
    Page-table columns past the lane layout's width must be ``-1`` and are dropped.
    Returns tokens ``[B]`` / logits ``[B, vocab]``, or with ``read_from_device=False`` an
    opaque lease for ``read_decode_output``.
``read_decode_output(out, async_read)`` / ``process_decode_output_host(value, is_tokens)``
    ``async_read=False`` returns the host value, ``True`` returns ``(host_value, events)``;
    ``process_decode_output_host`` completes the read and returns tokens or logits.
``warmup_model_prefill(...)`` / ``warmup_model_decode(...)``
    Drive every lane's ``WarmupCoordinator`` (either order, idempotent). Traces are
    captured as soon as both have compiled, so the traced warmup calls vLLM makes after
    the eager ones are no-ops.

Every method takes its parameters by keyword (``allocate_kv_cache`` also positionally,
as vLLM calls it). ``kv_cache`` may be one handle (one lane) or a list with one handle
per lane. ``prompt_tokens`` / ``output_tokens`` (per-row token lists, or 2-D tensors
whose out-of-vocabulary entries are padding) feed repetition penalties. Any other
keyword argument raises ``RequestError`` naming it, unless it is in
``VLLMAdapterConfig.ignored_kwargs`` — by default the documented whitelist
:data:`IGNORED_KWARGS` of vLLM hints that carry no information for this runtime.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import attrs
import torch

from llmrt.checks import first_outside
from llmrt.config import KV_DTYPES
from llmrt.device.base import Device
from llmrt.errors import ConfigError, IdentityError, RequestError
from llmrt.lane_group import LaneGroupExecutor, LaneGroupHost, LaneGroupLease
from llmrt.paged_kv_cache import PagedKVCacheContext
from llmrt.prefill.plan import PrefillRow
from llmrt.sampling_params import SamplingParams
from llmrt.startup import StartupSequence
from llmrt.weights.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llmrt.containers import RuntimeContainer
    from llmrt.recipe import Overrides

IGNORED_KWARGS: Mapping[str, str] = MappingProxyType(
    {
        "greedy_only": "warmup hint; warmup compiles the greedy and the sampled paths anyway",
        "optimizations": "precision preset of initialize_vllm_model; the recipe sets precision",
    }
)
"""Keyword arguments accepted and ignored by default, with the reason each carries nothing."""

KVCacheArg = PagedKVCacheContext | Sequence[PagedKVCacheContext] | None
SamplingArg = SamplingParams | Sequence[SamplingParams | None] | None
TokenListsArg = torch.Tensor | Sequence[Sequence[int]] | None


def _dtype_of(field: str, value: object) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    dtype = KV_DTYPES.get(name)
    if dtype is None:
        raise ConfigError(field, value, f"must be a torch dtype or one of {sorted(KV_DTYPES)}")
    return dtype


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@attrs.frozen(kw_only=True)
class VLLMAdapterConfig:
    """The geometry a vLLM server must agree with, resolved once from the lane group."""

    block_size: int
    kv_dtype: torch.dtype
    num_layers: int
    kv_heads_per_device: int
    head_dim: int
    lane_capacity: int
    num_lanes: int
    max_num_blocks: int
    max_model_len: int
    vocab_size: int
    page_table_width: int
    ignored_kwargs: frozenset[str]

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
        ignored_kwargs: Mapping[str, str] | frozenset[str] = IGNORED_KWARGS,
    ) -> VLLMAdapterConfig:
        """Read the KV geometry, capacity and limits every lane must share."""
        first = group.lanes[0]
        meta = first.kv_cache.borrowed_model.attention_metadata()
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
            kv_heads_per_device=meta.num_kv_heads,
            head_dim=meta.head_dim,
            lane_capacity=group.lane_capacity,
            num_lanes=len(group.lanes),
            max_num_blocks=kv.num_blocks if kv.num_blocks is not None else kv.max_num_blocks,
            max_model_len=max_model_len,
            vocab_size=first.decode.config.vocab_size,
            page_table_width=first.layout.width,
            ignored_kwargs=frozenset(ignored_kwargs),
        )

    def validate_kv_spec(
        self, *, kv_cache_shape: Sequence[int], dtype: object, num_layers: int
    ) -> int:
        """Check a legacy KV spec against the model; returns its ``num_blocks``."""
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
                raise ConfigError(
                    f"kv_cache_shape[{index}] ({name})",
                    shape[index],
                    f"the model's {name} is {expected[index]} (expected shape {expected})",
                )
        got = _dtype_of("dtype", dtype)
        if got != self.kv_dtype:
            raise ConfigError("dtype", dtype, f"the model's KV cache dtype is {self.kv_dtype}")
        num_blocks = shape[0]
        if not 0 < num_blocks <= self.max_num_blocks:
            raise ConfigError(
                "kv_cache_shape[0] (num_blocks)",
                num_blocks,
                f"must be in [1, {self.max_num_blocks}] (physical capacity may only shrink)",
            )
        return num_blocks


class VLLMAdapter:
    """vLLM's model interface over a lane group; borrows the group (owns a container it built)."""

    #: What the vLLM plugin may rely on (prefix caching: cached prefixes via ``start_pos``).
    model_capabilities: Mapping[str, bool] = MappingProxyType({"supports_prefix_caching": True})

    def __init__(
        self,
        *,
        group: LaneGroupExecutor,
        config: VLLMAdapterConfig,
        tokenizer: Tokenizer | None = None,
        owned_container: RuntimeContainer | None = None,
        startup: StartupSequence | None = None,
    ) -> None:
        self.group = group
        self.config = config
        self.tokenizer = tokenizer
        self._container = owned_container
        # vLLM drives the runtime's one startup sequence phase by phase, in its own call order.
        self.startup = startup if startup is not None else StartupSequence(group=group)
        if self.startup.group is not group:
            raise IdentityError(
                "the startup sequence starts the adapter's lane group", self.startup.group, group
            )

    # -- construction --------------------------------------------------------------------

    @classmethod
    def initialize_vllm_model(
        cls,
        *,
        recipe: str,
        overrides: Overrides | None = None,
        hf_config: object | None = None,
        mesh_device: object | None = None,
        max_batch_size: int | None = None,
        max_seq_len: int | None = None,
        tt_data_parallel: int | None = None,
        **extra: Any,
    ) -> VLLMAdapter:
        """Build the recipe's container and wrap its lane group (the adapter owns it)."""
        from llmrt.containers import Borrowed, RuntimeContainer, close_runtime
        from llmrt.recipe import load_recipe

        _reject(extra, "initialize_vllm_model", IGNORED_KWARGS)
        merged = _with_lanes(overrides, tt_data_parallel)
        loaded = load_recipe(recipe, overrides=merged)
        if max_batch_size is not None and max_batch_size > loaded.decode_slots:
            raise ConfigError(
                "max_batch_size",
                max_batch_size,
                f"exceeds the recipe's decode slots lanes * decode.lane_capacity = "
                f"{loaded.lanes} * {loaded.decode.lane_capacity}",
            )
        if max_seq_len is not None and max_seq_len > loaded.serving.max_model_len:
            raise ConfigError(
                "max_seq_len",
                max_seq_len,
                f"exceeds the recipe's serving.max_model_len={loaded.serving.max_model_len}",
            )
        if mesh_device is not None and not isinstance(mesh_device, Device):
            raise ConfigError(
                "mesh_device", mesh_device, "must be an llmrt Device (or None: the recipe's)"
            )
        container = RuntimeContainer(recipe=loaded)
        if mesh_device is not None:
            # vLLM opened the mesh and closes it: the runtime borrows it (teardown leaves it).
            container.device.device.override(Borrowed(mesh_device))
        try:
            group = container.lane_group()
            config = VLLMAdapterConfig.resolve(
                group=group,
                max_model_len=min(
                    max_seq_len or loaded.serving.max_model_len,
                    group.lanes[0].layout.max_sequence_length,
                ),
            )
            vocab = _vocab_of(hf_config)
            if vocab is not None and vocab != config.vocab_size:
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
            startup=startup,
        )

    def close(self, *, primary: BaseException | None = None) -> None:
        """Tear down the container this adapter built (nothing when it borrows); idempotent."""
        if self._container is not None:
            from llmrt.containers import close_runtime

            close_runtime(self._container, primary=primary)

    def __enter__(self) -> VLLMAdapter:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close(primary=exc)

    # -- KV cache ------------------------------------------------------------------------

    def allocate_kv_cache(
        self, kv_cache_shape: Sequence[int], dtype: object, num_layers: int
    ) -> list[PagedKVCacheContext]:
        """Validate the legacy spec, fix the physical capacity, allocate every lane's KV."""
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
        *,
        kv_cache: KVCacheArg = None,
        enable_trace: bool = False,
        can_sample_on_device: bool | None = None,
        **extra: Any,
    ) -> None:
        """Compile every lane's prefill coverage (capture follows once decode is warm too)."""
        self._check_warmup(
            extra, "warmup_model_prefill", kv_cache, enable_trace, can_sample_on_device
        )
        self.startup.warmup_prefill()
        self._activate_when_warm()

    def warmup_model_decode(
        self,
        *,
        kv_cache: KVCacheArg = None,
        enable_trace: bool = False,
        max_batch_size: int | None = None,
        num_blocks: int | None = None,
        can_sample_on_device: bool | None = None,
        **extra: Any,
    ) -> None:
        """Compile every lane's decode program (capture follows once prefill is warm too)."""
        self._check_warmup(
            extra, "warmup_model_decode", kv_cache, enable_trace, can_sample_on_device
        )
        if max_batch_size is not None and not 0 < max_batch_size <= self.config.max_batch_size:
            raise RequestError(
                "max_batch_size",
                f"must be in [1, {self.config.max_batch_size}] (the decode slots)",
                value=max_batch_size,
            )
        physical = self.group.lanes[0].layout.num_blocks
        if num_blocks is not None and num_blocks != physical:
            raise RequestError(
                "num_blocks",
                f"the allocated cache has {physical} blocks per lane",
                value=num_blocks,
            )
        self.startup.warmup_decode()
        self._activate_when_warm()

    def _activate_when_warm(self) -> None:
        """vLLM warms prefill and decode in either order; the second one activates."""
        if self.startup.warmed:
            self.startup.activate()

    def _check_warmup(
        self,
        extra: Mapping[str, Any],
        method: str,
        kv_cache: KVCacheArg,
        enable_trace: bool,
        can_sample_on_device: bool | None,
    ) -> None:
        _reject(extra, method, self.config.ignored_kwargs)
        self._check_kv(kv_cache)
        if enable_trace and any(lane.traced is None for lane in self.group.lanes):
            raise RequestError("enable_trace", "the recipe's trace.mode is none", value=True)
        if can_sample_on_device and not self.group.lanes[0].decode.config.device_sampling:
            raise RequestError(
                "can_sample_on_device", "the recipe sets decode.device_sampling=false", value=True
            )

    # -- prefill -------------------------------------------------------------------------

    def prefill_rows(
        self,
        *,
        tokens: torch.Tensor | Sequence[Sequence[int]],
        page_table: torch.Tensor | Sequence[Sequence[int]],
        prompt_lens: torch.Tensor | Sequence[int] | None = None,
        start_pos: torch.Tensor | Sequence[int] | None = None,
        empty_slots: torch.Tensor | Sequence[int] | None = None,
    ) -> list[PrefillRow]:
        """vLLM prefill arguments as planner rows with GLOBAL slots (the group routes them)."""
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
        *,
        tokens: torch.Tensor | Sequence[Sequence[int]],
        page_table: torch.Tensor | Sequence[Sequence[int]],
        kv_cache: KVCacheArg = None,
        enable_trace: bool | None = None,
        prompt_lens: torch.Tensor | Sequence[int] | None = None,
        start_pos: torch.Tensor | Sequence[int] | None = None,
        sampling_params: SamplingArg = None,
        empty_slots: torch.Tensor | Sequence[int] | None = None,
        prompt_tokens: TokenListsArg = None,
        output_tokens: TokenListsArg = None,
        **extra: Any,
    ) -> torch.Tensor:
        """Prefill vLLM's padded batch; tokens ``[B]`` or logits ``[B, vocab]`` in row order."""
        _reject(extra, "prefill_forward", self.config.ignored_kwargs)
        self._check_kv(kv_cache)
        rows = self.prefill_rows(
            tokens=tokens,
            page_table=page_table,
            prompt_lens=prompt_lens,
            start_pos=start_pos,
            empty_slots=empty_slots,
        )
        params = _sampling(sampling_params, len(rows))
        out = self.group.prefill_forward(
            rows=rows,
            sampling_params=params,
            history=self._history(prompt_tokens, output_tokens, len(rows)),
            enable_trace=enable_trace,
        )
        value = out.logits if params is None else out.tokens
        if value is None:
            raise RuntimeError("prefill produced no " + ("logits" if params is None else "tokens"))
        return value

    # -- decode --------------------------------------------------------------------------

    def decode_forward(
        self,
        *,
        tokens: torch.Tensor | Sequence[int],
        start_pos: torch.Tensor | Sequence[int],
        page_table: torch.Tensor | Sequence[Sequence[int]],
        kv_cache: KVCacheArg = None,
        sampling_params: SamplingArg = None,
        reset_batch: bool = False,
        enable_trace: bool | None = None,
        read_from_device: bool = True,
        prompt_tokens: TokenListsArg = None,
        output_tokens: TokenListsArg = None,
        **extra: Any,
    ) -> torch.Tensor | LaneGroupLease:
        """One decode step over global slots ``0..B-1``; a lease when not reading back."""
        _reject(extra, "decode_forward", self.config.ignored_kwargs)
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
        table = _int_tensor("page_table", page_table)
        if table.dim() != 2 or table.shape[0] != rows:
            raise RequestError("page_table", f"must be [{rows}, width]", value=tuple(table.shape))
        width = cfg.page_table_width
        if table.shape[1] > width:
            beyond = (table[:, width:] >= 0).nonzero()
            if beyond.numel():
                r = int(beyond[0, 0])
                raise RequestError(
                    "page_table",
                    f"maps a block past column {width - 1}, the lane layout's last column",
                    row=r,
                    value=int(table[r, width + int(beyond[0, 1])]),
                )
            table = table[:, :width]
        inactive = pos < 0
        tok = torch.where(inactive, torch.zeros_like(tok), tok)
        pos = torch.where(inactive, torch.zeros_like(pos), pos)
        table = torch.where(inactive.unsqueeze(1), torch.full_like(table, -1), table)
        params = _sampling(sampling_params, rows)
        out = self.group.decode_forward(
            tokens=tok,
            start_pos=pos,
            page_table=table,
            sampling_params=params,
            reset_batch=reset_batch,
            read_from_device=read_from_device,
            history=self._history(prompt_tokens, output_tokens, rows),
            enable_trace=enable_trace,
        )
        if isinstance(out, LaneGroupLease):
            return out
        value = out.logits if params is None else out.tokens
        if value is None:
            raise RuntimeError("decode produced no " + ("logits" if params is None else "tokens"))
        return value

    def read_decode_output(
        self, out: LaneGroupLease, *, async_read: bool = False
    ) -> LaneGroupHost | tuple[LaneGroupHost, tuple[Any, ...]]:
        """Start reading a decode lease: the host value, or ``(host_value, events)`` if async."""
        if not isinstance(out, LaneGroupLease):
            raise RequestError(
                "out", "must be the lease decode_forward(read_from_device=False) returned"
            )
        host, events = self.group.read_decode_output(out, async_read=async_read)
        if not isinstance(host, LaneGroupHost):
            raise RuntimeError("the lane group returned an unexpected host value")
        return (host, events) if async_read else host

    def process_decode_output_host(
        self, value: LaneGroupHost, *, is_tokens: bool = True
    ) -> torch.Tensor:
        """Complete a read and return tokens ``[B]`` (``is_tokens``) or logits ``[B, vocab]``."""
        out = self.group.process_decode_output_host(value, is_tokens=is_tokens)
        result = out.tokens if is_tokens else out.logits
        if result is None:
            raise RequestError(
                "is_tokens", "the decode output holds no such value", value=is_tokens
            )
        return result

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


def _reject(
    extra: Mapping[str, Any], method: str, allowed: Mapping[str, str] | frozenset[str]
) -> None:
    for name in extra:
        if name not in allowed:
            raise RequestError(
                name,
                f"is not a keyword argument of VLLMAdapter.{method} "
                f"(ignored extras: {', '.join(sorted(allowed)) or 'none'})",
            )


def _with_lanes(overrides: Overrides | None, lanes: int | None) -> Overrides | None:
    if lanes is None:
        return overrides
    if not _is_int(lanes) or lanes < 1:
        raise ConfigError("tt_data_parallel", lanes, "must be a positive integer")
    if overrides is None:
        return {"lanes": lanes}
    if isinstance(overrides, Mapping):
        if "lanes" in overrides and overrides["lanes"] != lanes:
            raise ConfigError(
                "tt_data_parallel", lanes, f"disagrees with the override lanes={overrides['lanes']}"
            )
        return {**overrides, "lanes": lanes}
    return [*overrides, f"lanes={lanes}"]


def _vocab_of(hf_config: object | None) -> int | None:
    if hf_config is None:
        return None
    value = (
        hf_config.get("vocab_size")
        if isinstance(hf_config, Mapping)
        else getattr(hf_config, "vocab_size", None)
    )
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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


def _padded(
    field: str, value: torch.Tensor | Sequence[Sequence[int]]
) -> tuple[torch.Tensor, list[int]]:
    """A ``[B, S]`` tensor and each row's given length (ragged lists are right-padded)."""
    if isinstance(value, torch.Tensor):
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


def _sampling(params: SamplingArg, rows: int) -> list[SamplingParams | None] | None:
    if params is None:
        return None
    if isinstance(params, SamplingParams):
        return [params] * rows
    listed = list(params)
    if len(listed) == 1 and rows > 1:
        listed = listed * rows
    if len(listed) != rows:
        raise RequestError("sampling_params", f"has {len(listed)} entries for {rows} rows")
    for i, p in enumerate(listed):
        if p is not None and not isinstance(p, SamplingParams):
            raise RequestError(
                "sampling_params", "must be a SamplingParams or None", row=i, value=type(p).__name__
            )
    return listed


def _token_lists(field: str, value: TokenListsArg, rows: int, vocab: int) -> list[list[int]]:
    """Per-row token ids; in a 2-D tensor, ids outside ``[0, vocab)`` are padding."""
    if value is None:
        return [[] for _ in range(rows)]
    if isinstance(value, torch.Tensor):
        tensor = _int_tensor(field, value)
        if tensor.dim() != 2 or tensor.shape[0] != rows:
            raise RequestError(field, f"must be [{rows}, length]", value=tuple(tensor.shape))
        return [[int(t) for t in row.tolist() if 0 <= t < vocab] for row in tensor]
    lists = [[int(t) for t in seq] for seq in value]
    if len(lists) != rows:
        raise RequestError(field, f"has {len(lists)} rows for {rows}")
    for i, seq in enumerate(lists):
        bad = [t for t in seq if not 0 <= t < vocab]
        if bad:
            raise RequestError(field, f"token id out of range [0, {vocab})", row=i, value=bad[0])
    return lists
