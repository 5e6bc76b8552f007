"""Decode preparation, signatures, eager invocation, trace refresh, output leases, cleanup.

One decode step runs a lane batch padded to the smallest configured decode batch size
holding its rows (one program and one trace per size, so a lone request does not pay
for the full slot count): ``prepare`` validates and
normalizes host inputs (page table to the layout's width, int32), classifies the
output path (``logits`` / ``argmax`` / ``sample``) and the device position
feedback, and records reset and page-table-change state; ``invoke`` stages the
inputs and runs the model body; ``consume`` reads and normalizes, or moves the
raw output into a :class:`DecodeOutputLease` for an external scheduler.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import attrs
import numpy as np
import torch

from llmrt.device.base import Device
from llmrt.errors import CleanupError, ConfigError, IdentityError, RequestError
from llmrt.families.base import CausalLM
from llmrt.lifecycle.events import component_logger, emit
from llmrt.runtime.checks import INTEGER_KINDS, first_outside, host_array
from llmrt.runtime.compiled_step import DecodeStep, StepCompiler
from llmrt.runtime.config import PageTableLayout
from llmrt.runtime.output_reader import OutputReader, PendingRead
from llmrt.runtime.prefill.postprocess import (
    Finished,
    HostFinish,
    HostOutputs,
    runs_on_host,
    sample_outputs,
)
from llmrt.runtime.prefill.sampling_helpers import history_counts, plain_argmax
from llmrt.runtime.tensor_resources import (
    ReleaseLedger,
    TensorResourceOrphan,
    allocate_many,
    release_tensors,
    retry_orphans,
)
from llmrt.runtime.trace_compiler import TraceArtifact, TraceCapturePlan
from llmrt.sampling.params import SamplingParams
from llmrt.sampling.sampler import SamplingTensors, apply_penalties, device_generator

DECODE_PATHS = ("logits", "argmax", "sample")
#: The tokens the narrowest width of a decode width ladder covers (rounded up to blocks).
LADDER_FIRST_TOKENS = 256


@functools.cache
def decode_widths(*, block_size: int, width: int, first_tokens: int) -> tuple[int, ...]:
    """A width ladder: the blocks of ``block_size`` tokens that ``first_tokens`` take,
    doubled up to (and ending at) ``width``. Cached: every step's ``prepare`` asks."""
    widths = []
    step = max(1, -(-first_tokens // block_size))
    while step < width:
        widths.append(step)
        step *= 2
    widths.append(width)
    return tuple(widths)


@attrs.frozen(kw_only=True)
class DecodeRuntimeConfig:
    """Resolved static decode collaborators and geometry (all borrowed)."""

    model: CausalLM
    device: Device
    output_reader: OutputReader
    lane_capacity: int
    layout: PageTableLayout
    device_sampling: bool
    vocab_size: int
    batch_sizes: tuple[int, ...] = ()
    """Physical decode batches, increasing, ending at ``lane_capacity`` (a step pads its
    rows to the smallest that holds them)."""
    lane: int = 0
    width_ladder: int | None = None
    """Tokens the narrowest of ``widths`` covers (``LADDER_FIRST_TOKENS`` by default), or None:
    every step runs at the layout's whole width (see ``widths``)."""

    @classmethod
    def resolve(
        cls,
        *,
        model: CausalLM,
        device: Device,
        output_reader: OutputReader,
        lane_capacity: int,
        page_table_layout: PageTableLayout,
        device_sampling_enabled: bool,
        batch_sizes: Sequence[int] | None = None,
        lane: int = 0,
        width_ladder: int | None = None,
    ) -> DecodeRuntimeConfig:
        """``batch_sizes``: the physical decode batches (None: the lane capacity only);
        ``width_ladder``: the tokens of the narrowest page-table width (see ``widths``)."""
        if (
            isinstance(lane_capacity, bool)
            or not isinstance(lane_capacity, int)
            or lane_capacity < 1
        ):
            raise ConfigError("decode.lane_capacity", lane_capacity, "must be a positive integer")
        sizes = (lane_capacity,) if batch_sizes is None else tuple(batch_sizes)
        if (
            not sizes
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes)
            or list(sizes) != sorted(set(sizes))
            or sizes[-1] != lane_capacity
        ):
            raise ConfigError(
                "decode.batch_sizes",
                list(sizes),
                f"must be increasing positive integers ending at the lane capacity {lane_capacity}",
            )
        if output_reader.borrowed_device is not device:
            raise IdentityError(
                "decode output reader uses the lane device", output_reader.borrowed_device, device
            )
        if width_ladder is not None and (
            isinstance(width_ladder, bool) or not isinstance(width_ladder, int) or width_ladder < 1
        ):
            raise ConfigError("width_ladder", width_ladder, "must be a positive number of tokens")
        return cls(
            model=model,
            device=device,
            output_reader=output_reader,
            lane_capacity=lane_capacity,
            layout=page_table_layout,
            device_sampling=device_sampling_enabled,
            vocab_size=model.config.vocab_size,
            batch_sizes=sizes,
            lane=lane,
            width_ladder=width_ladder,
        )

    def padded_batch(self, rows: int) -> int:
        """The physical batch a step of ``rows`` rows runs at."""
        return next(b for b in self.batch_sizes if b >= rows)

    @property
    def widths(self) -> tuple[int, ...]:
        """The page-table widths a step may run at, increasing, ending at the layout's.

        The layout's alone, unless ``width_ladder``: then doubling from that many tokens'
        worth of blocks. Why: a step that attends over its table's whole width (on CUDA: the
        CPU's step trims the table to the blocks in use by reading the positions on the host,
        which a captured graph cannot do and an eager CUDA step would pay a sync for) paid for
        ``max_model_len`` at every step: on an H200 a traced 16-row step of a SmolLM2-shaped
        model ran 22.4 ms with 4096 positions against 8.1 ms with 512. Each width is its own
        program and trace (warmed up), a step at most twice the blocks it needs."""
        if self.width_ladder is None:
            return (self.layout.width,)
        return decode_widths(
            block_size=self.layout.block_size,
            width=self.layout.width,
            first_tokens=self.width_ladder,
        )

    def padded_width(self, blocks: int) -> int:
        """The page-table width a step whose furthest position is in block ``blocks - 1``
        runs at."""
        widths = self.widths
        return next((w for w in widths if w >= blocks), widths[-1])

    def with_layout(self, layout: PageTableLayout) -> DecodeRuntimeConfig:
        self.layout.check_replacement(layout)
        return attrs.evolve(self, layout=layout)


@attrs.frozen(kw_only=True)
class DecodeSignature:
    """Decode program identity: physical batch, page-table width, output path."""

    batch_size: int
    page_table_width: int

    @property
    def operation(self) -> str:
        return "decode"

    def material(self) -> Mapping[str, Any]:
        return {
            "batch_size": self.batch_size,
            "page_table_width": self.page_table_width,
        }

    def describe(self) -> str:
        return f"decode[b{self.batch_size} w{self.page_table_width}]"


@attrs.frozen(kw_only=True, eq=False)
class PreparedDecode:
    """Normalized host inputs of one decode step, padded to its physical batch size."""

    active_rows: int
    tokens: torch.Tensor
    positions: torch.Tensor
    page_table: torch.Tensor
    path: str
    sampling: SamplingTensors | None
    step_offsets: torch.Tensor
    reset_batch: bool
    page_table_changed: bool
    feedback_compatible: bool
    signature: DecodeSignature
    tokens_from_device: bool = False
    """The step's tokens are the previous step's sampled ones, held by the runtime (the
    host's ``tokens`` are ignored: an overlapped scheduler's lag one step)."""


@attrs.frozen(kw_only=True, eq=False)
class DecodeInputs:
    """Device-resident inputs of one decode program (transient or trace-persistent)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    page_table: torch.Tensor

    def owned_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.tokens, self.positions, self.page_table)


@attrs.frozen(kw_only=True)
class DecodeOutput:
    """Host result of one decode step for the active rows."""

    tokens: torch.Tensor | None
    logits: torch.Tensor | None
    logprobs: torch.Tensor | None = None
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None


@attrs.define(kw_only=True, eq=False)
class DecodeOutputLease:
    """A raw device output handed to an external scheduler; the runtime still owns it."""

    raw: dict[str, torch.Tensor]
    active_rows: int
    is_tokens: bool
    pending: PendingRead | None = None
    released: bool = False
    host_finish: Callable[[HostOutputs], HostOutputs] | None = None
    settled: HostOutputs | None = None
    """The finished host outputs once read and post-processed (early, when the next step
    needed its tokens, or by ``process_decode_output_host``)."""


@attrs.define(kw_only=True, eq=False)
class FedTokens:
    """The last decode step's sampled tokens, for a next step that takes them from the device.

    ``device`` holds them where torch sampled them on the device; otherwise ``lease`` or
    ``host`` (ttnn outputs are sampled on the host after their read).
    """

    batch: int
    device: torch.Tensor | None = None
    lease: DecodeOutputLease | None = None
    host: torch.Tensor | None = None


class DecodeRuntime:
    """Runs decode steps for one lane; owns invocation transients and external leases.

    ``step_compiler`` (borrowed; None runs the model's forward as is) supplies the
    step the program body calls: the model's ``decode_forward`` or its compiled form.
    """

    def __init__(
        self, config: DecodeRuntimeConfig, *, step_compiler: StepCompiler | None = None
    ) -> None:
        self.config = config
        self._step: DecodeStep = (
            config.model.decode_forward
            if step_compiler is None
            else step_compiler.decode_step(config.model, block_size=config.layout.block_size)
        )
        self._leases: dict[int, DecodeOutputLease] = {}
        self._lease_by_host: dict[int, DecodeOutputLease] = {}
        self._last_positions: torch.Tensor | None = None
        self._last_page_table: torch.Tensor | None = None
        self._last_artifact: str | None = None
        self._fed: FedTokens | None = None
        self._ledger = ReleaseLedger()
        self._orphans: list[TensorResourceOrphan] = []
        self._generator = device_generator(config.device.torch_device)
        self._log = component_logger("decode_runtime", lane=config.lane, object_id=f"{id(self):#x}")

    @property
    def generator(self) -> torch.Generator:
        """The generator unseeded sampled rows draw from, on the device the logits live on."""
        return self._generator

    @property
    def model_step(self) -> DecodeStep:
        """The step program bodies call (borrowed): the model's forward or its compiled form."""
        return self._step

    def configure_page_table_layout(self, layout: PageTableLayout) -> None:
        self.config = self.config.with_layout(layout)

    # -- prepare -------------------------------------------------------------------------

    def prepare(
        self,
        *,
        tokens: torch.Tensor | Sequence[int],
        start_pos: torch.Tensor | Sequence[int],
        page_table: torch.Tensor,
        sampling_params: Sequence[SamplingParams | None] | None = None,
        step_offsets: Sequence[int] | torch.Tensor | None = None,
        reset_batch: bool = False,
        tokens_from_device: bool = False,
    ) -> PreparedDecode:
        """Validate and normalize one step's host inputs; raises before any device work.

        ``tokens_from_device``: this step continues the previous one on the same rows (each
        live row's position is its previous one + 1) and its tokens are the ones that step
        sampled, kept by the runtime, not the host's (tt-metal's generators skip copying
        host tokens when sampling on device without a batch reset: vLLM's overlapped steps
        send tokens that lag a step).

        Works on numpy views of the host inputs and wraps the padded results as tensors at
        the end. Why: a step's checks and padding are ~40 tiny array ops, each ~1 us in
        numpy against ~4 us as a torch op (10+ us right after a step has streamed the
        weights through the caches): 0.6 ms of a 20 ms batch-8 step as torch ops."""
        cfg = self.config
        tok = host_array(tokens).reshape(-1)
        pos = host_array(start_pos).reshape(-1)
        table = host_array(page_table)
        rows = tok.size
        if rows == 0:
            raise RequestError("tokens", "decode needs at least one row")
        if rows > cfg.lane_capacity:
            raise RequestError(
                "tokens",
                f"batch of {rows} rows exceeds the lane capacity {cfg.lane_capacity}",
                value=rows,
            )
        if pos.size != rows:
            raise RequestError("start_pos", f"has {pos.size} entries for {rows} token rows")
        if table.ndim != 2 or table.shape[0] != rows:
            raise RequestError("page_table", f"must be [{rows}, width], got {tuple(table.shape)}")
        if table.shape[1] > cfg.layout.width:
            raise RequestError(
                "page_table",
                f"width {table.shape[1]} exceeds the layout's decode width {cfg.layout.width}",
                value=int(table.shape[1]),
            )
        if not all(a.dtype.kind in INTEGER_KINDS for a in (tok, pos, table)):
            raise RequestError("tokens", "tokens, start_pos and page_table must be integer tensors")
        self._validate_rows(tok, pos, table)
        cap = cfg.padded_batch(rows)
        # Columns past the furthest position's block are never read or written this step.
        width = cfg.padded_width(int(pos.max()) // cfg.layout.block_size + 1)
        norm_table = np.full((cap, width), -1, dtype=np.int32)
        norm_table[:rows, : min(width, table.shape[1])] = table[:, :width]
        norm_tokens = np.zeros(cap, dtype=np.int64)
        norm_tokens[:rows] = tok
        norm_pos = np.zeros(cap, dtype=np.int32)
        norm_pos[:rows] = pos
        offsets = np.zeros(cap, dtype=np.int64)
        if step_offsets is not None:
            given = host_array(step_offsets).reshape(-1)
            if given.size != rows:
                raise RequestError(
                    "step_offsets", f"has {given.size} entries for {rows} token rows"
                )
            if given.dtype.kind not in INTEGER_KINDS:
                raise RequestError("step_offsets", "must be integers", value=str(given.dtype))
            negative = np.flatnonzero(given < 0)
            if negative.size:
                r = int(negative[0])
                raise RequestError("step_offsets", "must be >= 0", row=r, value=int(given[r]))
            offsets[:rows] = given
        path, sampling = self._classify(sampling_params, rows, batch=cap)
        last_table = None if self._last_page_table is None else self._last_page_table.numpy()
        last_pos = None if self._last_positions is None else self._last_positions.numpy()
        changed = last_table is None or not np.array_equal(last_table, norm_table)
        feedback = (
            not reset_batch
            and last_pos is not None
            and np.array_equal(last_pos[:rows] + 1, norm_pos[:rows])
            and np.array_equal(last_pos[rows:], norm_pos[rows:])
            # A trace advances padding rows too: a row that was padding has no known position.
            and last_table is not None
            and bool((last_table[:rows] >= 0).any(axis=1).all())
        )
        if tokens_from_device:
            self._check_continues(
                rows=rows,
                batch=cap,
                path=path,
                positions=norm_pos,
                table=norm_table,
                reset_batch=reset_batch,
            )
        return PreparedDecode(
            active_rows=rows,
            tokens=torch.from_numpy(norm_tokens),
            positions=torch.from_numpy(norm_pos),
            page_table=torch.from_numpy(norm_table),
            path=path,
            sampling=sampling,
            step_offsets=torch.from_numpy(offsets),
            reset_batch=reset_batch,
            page_table_changed=changed,
            feedback_compatible=feedback,
            signature=DecodeSignature(
                batch_size=cap,
                page_table_width=width,
            ),
            tokens_from_device=tokens_from_device,
        )

    def _check_continues(
        self,
        *,
        rows: int,
        batch: int,
        path: str,
        positions: np.ndarray,
        table: np.ndarray,
        reset_batch: bool,
    ) -> None:
        """Raise unless this step may take the previous one's tokens (``tokens_from_device``)."""
        fed, last_pos = self._fed, self._last_positions
        why = None
        if reset_batch:
            why = "a batch reset takes the host's tokens"
        elif path == "logits":
            why = "the step samples no tokens on the device (no sampling_params)"
        elif fed is None or last_pos is None or self._last_page_table is None:
            why = "the previous decode step on this lane sampled no tokens"
        elif fed.batch != batch:
            why = f"the previous step ran a batch of {fed.batch} rows, this one {batch}"
        if why is not None:
            raise RequestError("tokens_from_device", why)
        assert last_pos is not None and self._last_page_table is not None
        live = (table[:rows] >= 0).any(axis=1)
        was_live = (self._last_page_table.numpy()[:rows] >= 0).any(axis=1)
        moved = live & ((positions[:rows] != last_pos.numpy()[:rows] + 1) | ~was_live)
        if moved.any():
            r = int(np.flatnonzero(moved)[0])
            raise RequestError(
                "start_pos",
                "with tokens_from_device each live row continues the previous step at its "
                "position + 1",
                row=r,
                value=int(positions[r]),
            )

    def _validate_rows(self, tok_a: np.ndarray, pos_a: np.ndarray, table_a: np.ndarray) -> None:
        cfg = self.config
        bs = cfg.layout.block_size
        bad_tok = first_outside(tok_a, low=0, high=cfg.vocab_size)
        if bad_tok is not None:
            (r,) = bad_tok
            raise RequestError(
                "tokens", f"token id out of range [0, {cfg.vocab_size})", row=r, value=int(tok_a[r])
            )
        bad_pos = first_outside(pos_a, low=0, high=cfg.layout.max_sequence_length)
        if bad_pos is not None:
            (r,) = bad_pos
            raise RequestError(
                "start_pos",
                f"position out of range [0, {cfg.layout.max_sequence_length})",
                row=r,
                value=int(pos_a[r]),
            )
        bad_blk = first_outside(table_a, low=-1, high=cfg.layout.num_blocks)
        if bad_blk is not None:
            r, c = bad_blk
            raise RequestError(
                "page_table",
                f"block id at column {c} out of range [0, {cfg.layout.num_blocks}) (or -1 to skip)",
                row=r,
                value=int(table_a[r, c]),
            )
        needed = pos_a.astype(np.int64) // bs
        missing = np.flatnonzero(needed >= table_a.shape[1])
        if missing.size:
            r = int(missing[0])
            raise RequestError(
                "page_table",
                f"has no column for position {int(pos_a[r])} (block {int(needed[r])})",
                row=r,
            )
        current = table_a[np.arange(table_a.shape[0]), needed]
        # A row whose page table is all -1 is an inert padding row (no write, output ignored).
        live = (table_a >= 0).any(axis=1)
        unmapped = np.flatnonzero((current < 0) & live)
        if unmapped.size:
            r = int(unmapped[0])
            raise RequestError(
                "page_table", f"block for position {int(pos_a[r])} is -1 (unmapped)", row=r
            )

    def _classify(
        self, params: Sequence[SamplingParams | None] | None, rows: int, *, batch: int
    ) -> tuple[str, SamplingTensors | None]:
        if params is None:
            return "logits", None
        if len(params) != rows:
            raise RequestError("sampling_params", f"has {len(params)} entries for {rows} rows")
        for i, p in enumerate(params):
            if p is not None and not isinstance(p, SamplingParams):
                raise RequestError(
                    "sampling_params", "must be SamplingParams or None", row=i, value=type(p)
                )
        if all(plain_argmax(p) for p in params):
            return "argmax", None
        tensors = SamplingTensors.from_params(
            list(params),
            batch_size=batch,
            vocab_size=self.config.vocab_size,
            device=self.config.device.torch_device,
        )
        return "sample", tensors

    # -- invoke --------------------------------------------------------------------------

    def stage(self, prepared: PreparedDecode) -> DecodeInputs:
        """Upload one step's inputs as transients owned by this runtime until released."""
        device = self.config.device
        uploaded: list[torch.Tensor] = []
        try:
            for host in (prepared.tokens, prepared.positions, prepared.page_table):
                uploaded.append(device.upload(host))
            if prepared.tokens_from_device:
                self._write_fed_tokens(uploaded[0], prepared)
        except BaseException:
            self._release(uploaded)
            raise
        return DecodeInputs(tokens=uploaded[0], positions=uploaded[1], page_table=uploaded[2])

    def _write_fed_tokens(self, dst: Any, prepared: PreparedDecode) -> None:
        """Write the previous step's sampled tokens into a step's token input.

        Device to device where torch sampled them on the lane's device; otherwise from the
        host copy (a ttnn step's tokens are sampled on the host once its read completes, so
        this waits for that read: the overlap is lost there, not the tokens).
        """
        fed = self._fed
        if fed is None:
            raise RequestError("tokens_from_device", "the previous decode step sampled no tokens")
        if (
            fed.device is not None
            and isinstance(dst, torch.Tensor)
            and fed.device.device == dst.device
        ):
            with torch.no_grad():
                dst.copy_(fed.device.to(dst.dtype))
            return
        host = self._fed_host(fed)
        self.config.device.refresh(
            dst, host.to(prepared.tokens.dtype).reshape(prepared.tokens.shape)
        )

    def _fed_host(self, fed: FedTokens) -> torch.Tensor:
        if fed.host is None:
            if fed.device is not None:
                fed.host = fed.device.detach().to("cpu")
            elif fed.lease is not None:
                tokens = self._settle(fed.lease)["tokens"]
                fed.host = torch.zeros(fed.batch, dtype=tokens.dtype)
                fed.host[: tokens.shape[0]] = tokens.reshape(-1)[: fed.batch]
            else:  # pragma: no cover - FedTokens is built with one source
                raise RuntimeError("fed tokens without a source")
        return fed.host

    def _settle(self, lease: DecodeOutputLease) -> HostOutputs:
        """Complete a lease's read and post-processing once (its host value is kept)."""
        if lease.settled is None:
            reader = self.config.output_reader
            host = (
                reader.complete(lease.pending)
                if lease.pending is not None
                else reader.read(lease.raw)
            )
            lease.pending = None
            if lease.host_finish is not None:
                host = lease.host_finish(host)
                lease.host_finish = None
            lease.settled = dict(host)
        return lease.settled

    def note_outputs(
        self, prepared: PreparedDecode, result: DecodeOutput | DecodeOutputLease
    ) -> None:
        """Keep this step's sampled tokens for a next step that takes them from the device."""
        batch = prepared.signature.batch_size
        if prepared.path == "logits":
            self._fed = None
        elif isinstance(result, DecodeOutput):
            tokens = result.tokens
            if tokens is None:
                self._fed = None
                return
            host = torch.zeros(batch, dtype=tokens.dtype)
            host[: tokens.shape[0]] = tokens.reshape(-1)
            self._fed = FedTokens(batch=batch, host=host)
        elif (
            "tokens" in result.raw
            and isinstance(result.raw["tokens"], torch.Tensor)
            and (result.pending is None and result.host_finish is None)
        ):
            self._fed = FedTokens(batch=batch, device=result.raw["tokens"])
        else:
            self._fed = FedTokens(batch=batch, lease=result)

    @property
    def step(self) -> DecodeStep:
        """The forward the program body calls: the model's own, or its compiled form."""
        return self._step

    def body(self, inputs: DecodeInputs) -> dict[str, torch.Tensor]:
        """The device program: one model decode step returning logits."""
        logits = self._step(
            tokens=inputs.tokens, positions=inputs.positions, page_table=inputs.page_table
        )
        return {"logits": logits}

    def body_once(self, prepared: PreparedDecode) -> dict[str, torch.Tensor]:
        """Stage and run one step without touching the step state (compilation)."""
        inputs = self.stage(prepared)
        try:
            return self.body(inputs)
        finally:
            self._release(inputs)

    def invoke(self, prepared: PreparedDecode) -> dict[str, torch.Tensor]:
        """Eager step: stage, run, release the staged inputs."""
        inputs = self.stage(prepared)
        try:
            return self.body(inputs)
        finally:
            self._release(inputs)
            self.note_submitted(prepared, artifact=None)

    def finish(
        self,
        prepared: PreparedDecode,
        raw: dict[str, torch.Tensor],
        *,
        history: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
    ) -> Finished:
        """Argmax or sampling after the program; penalties read each row's token history.

        Outputs torch cannot compute on are read first and post-processed on the host.
        """
        if runs_on_host(raw):
            return HostFinish.submit(
                raw,
                reader=self.config.output_reader,
                apply=lambda host: cast(HostOutputs, self.finish(prepared, host, history=history)),
                is_tokens=prepared.path != "logits",
            )
        if prepared.path != "sample" or prepared.sampling is None:
            return sample_outputs(
                raw,
                path=prepared.path,
                sampling=None,
                step_offsets=prepared.step_offsets,
                generator=None,
            )
        sampling = prepared.sampling
        logits = raw["logits"]
        if sampling.any_penalties and history is not None:
            prompt, output = history_counts(
                history,
                batch=prepared.signature.batch_size,
                vocab_size=self.config.vocab_size,
                device=logits.device,
            )
            logits = apply_penalties(
                logits, tensors=sampling, prompt_counts=prompt, output_counts=output
            )
        return sample_outputs(
            {"logits": logits},
            path="sample",
            sampling=sampling,
            step_offsets=prepared.step_offsets.to(logits.device),
            generator=self._generator,
        )

    def _release(self, value: Any) -> None:
        self._orphans.extend(
            release_tensors(value, device=self.config.device, ledger=ReleaseLedger())
        )

    # -- traces --------------------------------------------------------------------------

    def capture_plan(self, prepared: PreparedDecode, *, program_key: str) -> TraceCapturePlan:
        """A plan to capture this step's program over persistent inputs with position feedback."""
        device = self.config.device
        template = prepared

        def allocate_inputs() -> DecodeInputs:
            made = allocate_many(
                device=device,
                specs=[
                    (h.shape, h.dtype)
                    for h in (template.tokens, template.positions, template.page_table)
                ],
            )
            return DecodeInputs(tokens=made[0], positions=made[1], page_table=made[2])

        def prime(inputs: DecodeInputs) -> None:
            self._refresh_all(inputs, template)

        def program(inputs: DecodeInputs) -> dict[str, torch.Tensor]:
            out = self.body(inputs)
            if _feeds_back(inputs):
                inputs.positions.add_(1)  # device position feedback for the next step
            return out

        return TraceCapturePlan(
            program_key=program_key,
            operation="decode",
            batch_size=prepared.signature.batch_size,
            material=prepared.signature.material(),
            description=prepared.signature.describe(),
            allocate_inputs=allocate_inputs,
            prime_inputs=prime,
            program=program,
        )

    def _refresh_all(self, inputs: DecodeInputs, prepared: PreparedDecode) -> None:
        device = self.config.device
        device.refresh(inputs.tokens, prepared.tokens)
        device.refresh(inputs.positions, prepared.positions)
        device.refresh(inputs.page_table, prepared.page_table)

    def refresh_decision(self, prepared: PreparedDecode, artifact: TraceArtifact) -> str:
        """``full`` | ``page_table`` | ``fields``: what a replay must rewrite.

        Full on the artifact's first replay, a batch reset, a graph switch (the last
        replay on this lane was another trace) or when the device-incremented
        positions do not match this step; the page table when it changed; otherwise
        only the per-step fields (tokens, and positions where the trace has no device
        position feedback).
        """
        if (
            artifact.replays == 0
            or prepared.reset_batch
            or self._last_artifact != artifact.trace_key
            or not prepared.feedback_compatible
        ):
            return "full"
        if prepared.page_table_changed:
            return "page_table"
        return "fields"

    def refresh_trace(
        self, prepared: PreparedDecode, inputs: DecodeInputs, artifact: TraceArtifact
    ) -> str:
        decision = self.refresh_decision(prepared, artifact)
        device = self.config.device
        if decision == "full":
            self._refresh_all(inputs, prepared)
        else:
            if not prepared.tokens_from_device:
                device.refresh(inputs.tokens, prepared.tokens)
            if not _feeds_back(inputs):
                device.refresh(inputs.positions, prepared.positions)
            if decision == "page_table":
                device.refresh(inputs.page_table, prepared.page_table)
        if prepared.tokens_from_device:
            self._write_fed_tokens(inputs.tokens, prepared)
        artifact.replay_state["last_refresh"] = decision
        return decision

    def note_submitted(self, prepared: PreparedDecode, *, artifact: TraceArtifact | None) -> None:
        """Remember what the device now holds, for the next step's refresh decision."""
        self._last_positions = prepared.positions
        self._last_page_table = prepared.page_table
        self._last_artifact = artifact.trace_key if artifact is not None else None

    # -- outputs -------------------------------------------------------------------------

    def consume(
        self,
        raw: Finished,
        prepared: PreparedDecode,
        *,
        read_from_device: bool = True,
        copy_outputs: bool = False,
    ) -> DecodeOutput | DecodeOutputLease:
        """Blocking read + normalization, or a lease that keeps the raw output alive.

        A ``HostFinish`` read was submitted when the program ran: it is completed here, or
        the lease keeps it (no device copy) and post-processes the host value when done.
        """
        if isinstance(raw, HostFinish):
            if read_from_device:
                return self._normalize(raw.result(self.config.output_reader), prepared.active_rows)
            return self._lease(
                DecodeOutputLease(
                    raw=dict(raw.raw),
                    active_rows=prepared.active_rows,
                    is_tokens=raw.is_tokens,
                    pending=raw.pending,
                    host_finish=raw.apply,
                )
            )
        if read_from_device:
            host = self.config.output_reader.read(raw)
            return self._normalize(host, prepared.active_rows)
        if copy_outputs:
            # Trace outputs are overwritten by the next replay; a lease must keep its own copy.
            raw = {k: v.clone() for k, v in raw.items()}
        return self._lease(
            DecodeOutputLease(raw=raw, active_rows=prepared.active_rows, is_tokens="tokens" in raw)
        )

    def _lease(self, lease: DecodeOutputLease) -> DecodeOutputLease:
        self._leases[id(lease)] = lease
        emit(self._log, "lease.created", rows=lease.active_rows)
        return lease

    def _normalize(self, host: Mapping[str, torch.Tensor], rows: int) -> DecodeOutput:
        tops = None
        if "top_logprob_values" in host:
            tops = (host["top_logprob_values"][:rows], host["top_logprob_ids"][:rows])
        return DecodeOutput(
            tokens=host["tokens"][:rows] if "tokens" in host else None,
            logits=host["logits"][:rows] if "logits" in host else None,
            logprobs=host["logprobs"][:rows] if "logprobs" in host else None,
            top_logprobs=tops,
        )

    def read_decode_output(
        self, lease: DecodeOutputLease, *, async_read: bool
    ) -> tuple[Any, tuple[Any, ...]]:
        """Start reading a lease: ``(host_value, events)``; host_value is valid after completion."""
        self._check_lease(lease)
        reader = self.config.output_reader
        if lease.settled is not None:  # read early: the next step took its tokens
            self._lease_by_host[id(lease.settled)] = lease
            return lease.settled, ()
        if not async_read:
            if lease.pending is not None:  # submitted when the program ran (HostFinish)
                host = reader.complete(lease.pending)
                lease.pending = None
            else:
                host = reader.read(lease.raw)
            self._lease_by_host[id(host)] = lease
            return host, ()
        pending = lease.pending if lease.pending is not None else reader.submit(lease.raw)
        lease.pending = pending
        self._lease_by_host[id(pending.host_value)] = lease
        return pending.host_value, pending.events

    def process_decode_output_host(
        self, host_value: Any, *, is_tokens: bool | None = None
    ) -> DecodeOutput:
        """Complete a read started by ``read_decode_output``, normalize it and release the lease."""
        lease = self._lease_by_host.get(id(host_value))
        if lease is None:
            raise RequestError(
                "host_value", "was not produced by read_decode_output on this runtime"
            )
        if is_tokens is not None and is_tokens != lease.is_tokens:
            raise RequestError(
                "is_tokens", f"lease holds {'tokens' if lease.is_tokens else 'logits'}"
            )
        del self._lease_by_host[id(host_value)]
        if lease.settled is not None:
            host_value = lease.settled
        else:
            if lease.pending is not None:
                host_value = self.config.output_reader.complete(lease.pending)
                lease.pending = None
            if lease.host_finish is not None:
                host_value = lease.host_finish(host_value)
                lease.host_finish = None
            lease.settled = dict(host_value)  # a next step may still take its tokens
        out = self._normalize(host_value, lease.active_rows)
        self._release_lease(lease)
        return out

    def _check_lease(self, lease: DecodeOutputLease) -> None:
        if self._leases.get(id(lease)) is not lease:
            raise RequestError("lease", "is not an outstanding lease of this decode runtime")

    def _release_lease(self, lease: DecodeOutputLease) -> None:
        if lease.released:
            return
        lease.released = True
        self._leases.pop(id(lease), None)
        emit(self._log, "lease.released", rows=lease.active_rows)

    def owns_lease(self, lease: DecodeOutputLease) -> bool:
        return self._leases.get(id(lease)) is lease

    @property
    def outstanding_leases(self) -> int:
        return len(self._leases)

    def drain_external_outputs(self) -> int:
        """Retire every lease the external scheduler never completed; idempotent."""
        leases = list(self._leases.values())
        if leases:
            self._fed = None  # abandoned outputs: no step continues from them
        if any(lease.pending is not None for lease in leases):
            self.config.output_reader.drain()
        for lease in leases:
            self._release_lease(lease)
        self._lease_by_host.clear()
        return len(leases)

    @property
    def orphans(self) -> tuple[TensorResourceOrphan, ...]:
        """Staged inputs whose deallocation failed (retried by ``cleanup_transients``)."""
        return tuple(self._orphans)

    def cleanup_transients(self) -> None:
        """Release staged inputs that failed to release earlier and forget step state.

        Raises ``CleanupError`` listing the inputs that failed to release again (they stay
        orphans, so a later call retries them).
        """
        self._last_positions = None
        self._last_page_table = None
        self._last_artifact = None
        self._fed = None
        if self._orphans:
            self._orphans = retry_orphans(
                self._orphans, device=self.config.device, ledger=self._ledger
            )
        if self._orphans:
            raise CleanupError([(f"decode:{o.path}", o.error) for o in self._orphans])


def _feeds_back(inputs: DecodeInputs) -> bool:
    """Whether a decode trace advances its positions on device (``add_`` on torch tensors).

    Other backends' positions are refreshed from the host on every replay instead.
    """
    return isinstance(inputs.positions, torch.Tensor)
