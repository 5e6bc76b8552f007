"""The prefill runtime facade: prepare, invoke, assemble; trace hooks; transient cleanup.

``prepare`` plans a public call once (rows, slots, chunking, padded waves) and
derives each step's program signature; ``invoke`` runs one prepared request's
complete chunk sequence eagerly; ``assemble`` reads every request's outputs and
restores source-row order. The runtime borrows the model, device and output
reader; it owns only invocation transients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from llmrt.errors import CleanupError, RequestError
from llmrt.runtime.compiled_step import PrefillStep, StepCompiler
from llmrt.runtime.config import PageTableLayout
from llmrt.runtime.prefill.config import PrefillRuntimeConfig
from llmrt.runtime.prefill.inputs import PrefillInputs, refresh, stage
from llmrt.runtime.prefill.plan import PrefillChunk, PrefillRow, plan_prefill
from llmrt.runtime.prefill.postprocess import (
    Finished,
    HostFinish,
    HostOutputs,
    runs_on_host,
    sample_outputs,
)
from llmrt.runtime.prefill.result_collector import PrefillOutput, ResultCollector
from llmrt.runtime.prefill.sampling_helpers import (
    history_counts,
    normalize_params,
    output_path,
    request_tensors,
)
from llmrt.runtime.prefill.sequence_runner import StepHook, run_sequence
from llmrt.runtime.prefill.signatures import (
    PrefillSignature,
    PreparedPrefill,
    PreparedPrefillRequest,
    chunk_signature,
)
from llmrt.runtime.prefill.trace import capture_plan as build_capture_plan
from llmrt.runtime.tensor_resources import (
    ReleaseLedger,
    TensorResourceOrphan,
    release_tensors,
    retry_orphans,
)
from llmrt.runtime.trace_compiler import TraceCapturePlan
from llmrt.sampling.params import SamplingParams
from llmrt.sampling.sampler import apply_penalties, device_generator

TokenHistory = Sequence[tuple[Sequence[int], Sequence[int]]]


class PrefillRuntime:
    """Prefill for one lane.

    ``step_compiler`` (borrowed; None runs the model's forward as is) supplies the
    step the program body calls: the model's ``prefill_forward`` or its compiled form.
    """

    def __init__(
        self, config: PrefillRuntimeConfig, *, step_compiler: StepCompiler | None = None
    ) -> None:
        self.config = config
        self._step: PrefillStep = (
            config.model.prefill_forward
            if step_compiler is None
            else step_compiler.prefill_step(config.model, block_size=config.layout.block_size)
        )
        self._orphans: list[TensorResourceOrphan] = []
        self._generator = device_generator(config.device.torch_device)

    @property
    def generator(self) -> torch.Generator:
        """The generator unseeded sampled rows draw from, on the device the logits live on."""
        return self._generator

    def configure_page_table_layout(self, layout: PageTableLayout) -> None:
        self.config = self.config.with_layout(layout)

    # -- prepare -------------------------------------------------------------------------

    def rows_from_batch(
        self,
        *,
        tokens: torch.Tensor | Sequence[Sequence[int]],
        page_table: torch.Tensor | Sequence[Sequence[int]],
        prompt_lens: Sequence[int] | torch.Tensor | None = None,
        start_pos: Sequence[int] | torch.Tensor | None = None,
        slots: Sequence[int] | torch.Tensor | None = None,
    ) -> list[PrefillRow]:
        """Normalize vLLM-shaped batch arguments into planner rows (lane-local slots)."""
        bs = self.config.layout.block_size
        table = torch.as_tensor(page_table)
        if table.dim() != 2:
            raise RequestError("page_table", "must be [rows, width]", value=tuple(table.shape))
        given_lens = (
            None if prompt_lens is None else torch.as_tensor(prompt_lens).reshape(-1).tolist()
        )
        if isinstance(tokens, torch.Tensor):
            if tokens.dim() != 2:
                raise RequestError("tokens", "must be [rows, length]", value=tuple(tokens.shape))
            lens = given_lens if given_lens is not None else [tokens.shape[1]] * tokens.shape[0]
            if len(lens) != tokens.shape[0]:
                raise RequestError(
                    "prompt_lens", f"has {len(lens)} entries for {tokens.shape[0]} prompts"
                )
            seqs = [
                tokens[i, : int(n)] if 0 <= int(n) <= tokens.shape[1] else tokens[i]
                for i, n in enumerate(lens)
            ]
            for i, n in enumerate(lens):
                if not 0 < int(n) <= tokens.shape[1]:
                    raise RequestError(
                        "prompt_lens", f"must be in [1, {tokens.shape[1]}]", row=i, value=int(n)
                    )
        else:
            seqs = [torch.as_tensor(list(t), dtype=torch.int64) for t in tokens]
            if given_lens is not None:
                if len(given_lens) != len(seqs):
                    raise RequestError(
                        "prompt_lens", f"has {len(given_lens)} entries for {len(seqs)} prompts"
                    )
                for i, (seq, n) in enumerate(zip(seqs, given_lens, strict=True)):
                    if int(n) != seq.numel():
                        raise RequestError(
                            "prompt_lens",
                            f"disagrees with the {seq.numel()} tokens given",
                            row=i,
                            value=int(n),
                        )
        n_rows = len(seqs)
        if table.shape[0] != n_rows:
            raise RequestError("page_table", f"has {table.shape[0]} rows for {n_rows} prompts")
        cached = (
            [0] * n_rows
            if start_pos is None
            else [int(v) for v in torch.as_tensor(start_pos).tolist()]
        )
        slot_list = (
            list(range(n_rows))
            if slots is None
            else [int(v) for v in torch.as_tensor(slots).tolist()]
        )
        for name, values in (("start_pos", cached), ("slots", slot_list)):
            if len(values) != n_rows:
                raise RequestError(name, f"has {len(values)} entries for {n_rows} prompts")
        rows = []
        for i, seq in enumerate(seqs):
            if seq.dtype.is_floating_point:
                raise RequestError("tokens", "must be integer token ids", row=i)
            vocab = self.config.vocab_size
            if seq.numel() and (int(seq.min()) < 0 or int(seq.max()) >= vocab):
                raise RequestError("tokens", f"token id out of range [0, {vocab})", row=i)
            n_blocks = min(-(-seq.numel() // bs), table.shape[1])
            rows.append(
                PrefillRow(
                    source_row=i,
                    tokens=seq.to(torch.int64),
                    cached_tokens=cached[i],
                    slot=slot_list[i],
                    block_ids=tuple(int(b) for b in table[i, :n_blocks].tolist()),
                )
            )
        return rows

    def prepare(
        self,
        *,
        rows: Sequence[PrefillRow],
        sampling_params: SamplingParams | Sequence[SamplingParams | None] | None = None,
        step_offsets: Sequence[int] | None = None,
    ) -> PreparedPrefill:
        """Plan the call and derive every step's program signature (no device work)."""
        params = normalize_params(sampling_params, num_rows=len(rows))
        plan = plan_prefill(
            rows=rows, policy=self.config.policy, sampling_params_given=params is not None
        )
        path = output_path(params)
        for row in rows:  # the planner checked they are unique non-negative integers
            if row.source_row >= len(rows):
                raise RequestError(
                    "source_row",
                    f"source rows must be 0..{len(rows) - 1} (one per row of this call)",
                    row=row.source_row,
                    value=row.source_row,
                )
        offsets = [0] * len(rows) if step_offsets is None else [int(v) for v in step_offsets]
        if len(offsets) != len(rows):
            raise RequestError("step_offsets", f"has {len(offsets)} entries for {len(rows)} rows")
        for r, offset in enumerate(offsets):
            if offset < 0:
                raise RequestError("step_offsets", "must be >= 0", row=r, value=offset)
        prepared = []
        for request in plan.requests:
            sampling = None
            if path == "sample" and params is not None:
                sampling = request_tensors(
                    params,
                    source_rows=request.source_rows,
                    padded_batch=request.padded_batch_size,
                    vocab_size=self.config.vocab_size,
                    device=self.config.device.torch_device,
                )
            row_offsets = torch.zeros(request.padded_batch_size, dtype=torch.int64)
            row_offsets[: request.active_batch_size] = torch.tensor(
                [offsets[r] for r in request.source_rows], dtype=torch.int64
            )
            sigs = tuple(chunk_signature(request, c, path=path) for c in request.chunks)
            prepared.append(
                PreparedPrefillRequest(
                    request=request,
                    signatures=sigs,
                    path=path,
                    sampling=sampling,
                    step_offsets=row_offsets,
                )
            )
        return PreparedPrefill(
            plan=plan, requests=tuple(prepared), num_rows=len(rows), want_logits=path == "logits"
        )

    # -- execution -----------------------------------------------------------------------

    @property
    def step(self) -> PrefillStep:
        """The forward the program body calls: the model's own, or its compiled form."""
        return self._step

    def body(self, inputs: PrefillInputs, signature: PrefillSignature) -> dict[str, torch.Tensor]:
        """The device program of one step: model prefill returning last-token logits."""
        host: dict[str, int] = {}
        if getattr(self.config.model, "prefill_from_host", False):
            if inputs.active_rows <= 0:
                raise RequestError(
                    "start_pos",
                    f"{type(self.config.model).__name__} prefills rows sharing one start "
                    "position (prefill_from_host); this step's rows start at different ones",
                )
            host = {"chunk_start": inputs.chunk_start, "active_rows": inputs.active_rows}
        step: Any = self._step  # a prefill_from_host model takes the two host values too
        logits = step(
            tokens=inputs.tokens,
            start_pos=inputs.start_pos,
            seq_lens=inputs.seq_lens,
            page_table=inputs.page_table,
            last_token_index=inputs.last_token_index,
            **host,
        )
        return {"logits": logits}

    def invoke_step(
        self, chunk: PrefillChunk, signature: PrefillSignature
    ) -> dict[str, torch.Tensor]:
        """Stage and run one chunk step alone (compilation); staged inputs are released."""
        inputs = stage(chunk, device=self.config.device, orphans=self._orphans)
        try:
            return self.body(inputs, signature)
        finally:
            self._orphans.extend(
                release_tensors(inputs, device=self.config.device, ledger=ReleaseLedger())
            )

    def invoke(
        self, prepared: PreparedPrefillRequest, *, on_step: StepHook | None = None
    ) -> dict[str, torch.Tensor]:
        """Run a request's complete chunk sequence eagerly; returns the final raw outputs."""
        return run_sequence(
            prepared,
            device=self.config.device,
            body=self.body,
            on_step=on_step,
            orphans=self._orphans,
        )

    def finish(
        self,
        prepared: PreparedPrefillRequest,
        raw: dict[str, torch.Tensor],
        *,
        history: TokenHistory | None = None,
    ) -> Finished:
        """Sampling after the program (penalties use each row's prompt and output tokens).

        Outputs torch cannot compute on are read first and post-processed on the host.
        """
        if runs_on_host(raw):
            return HostFinish.submit(
                raw,
                reader=self.config.output_reader,
                apply=lambda host: cast(HostOutputs, self.finish(prepared, host, history=history)),
                is_tokens=prepared.path != "logits",
            )
        sampling = prepared.sampling
        if sampling is not None and sampling.any_penalties and history is not None:
            prompt, output = history_counts(
                [history[src] for src in prepared.request.source_rows],
                batch=prepared.request.padded_batch_size,
                vocab_size=self.config.vocab_size,
                device=raw["logits"].device,
            )
            raw = {
                **raw,
                "logits": apply_penalties(
                    raw["logits"], tensors=sampling, prompt_counts=prompt, output_counts=output
                ),
            }
        return sample_outputs(
            raw,
            path=prepared.path,
            sampling=sampling,
            step_offsets=prepared.step_offsets,
            generator=self._generator,
        )

    def assemble(self, prepared: PreparedPrefill, raws: Sequence[Finished]) -> PrefillOutput:
        """Read every request's outputs and restore the caller's source-row order."""
        collector = ResultCollector(
            output_reader=self.config.output_reader, num_rows=prepared.num_rows
        )
        for request, raw in zip(prepared.requests, raws, strict=True):
            collector.collect(
                raw,
                source_rows=request.request.source_rows,
                batch_rows=request.request.last_token_rows,
            )
        return collector.result()

    # -- traces --------------------------------------------------------------------------

    def capture_plan(
        self, prepared: PreparedPrefillRequest, *, step: int, program_key: str
    ) -> TraceCapturePlan:
        chunk, signature = prepared.steps[step]
        return build_capture_plan(
            program_key=program_key,
            signature=signature,
            chunk=chunk,
            device=self.config.device,
            body=self.body,
        )

    def refresh_trace(self, inputs: Any, chunk: PrefillChunk) -> None:
        """Rewrite a prefill trace's persistent inputs for one chunk step (always full)."""
        refresh(inputs, chunk, device=self.config.device)

    def finish_trace(
        self, prepared: PreparedPrefillRequest, outputs: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """After a request's final replayed step: detach its outputs from the trace buffers.

        Outputs torch cannot copy are left in place: ``finish`` submits their read at once,
        ahead of the next replay.
        """
        if runs_on_host(outputs):
            return outputs
        return {k: v.clone() for k, v in outputs.items()}

    def can_trace(self, *, tokens: int, prefill_len: int | None = None, start_pos: int = 0) -> bool:
        """Capability query by invocation geometry only (the spec's legacy inputs)."""
        length = prefill_len if prefill_len is not None else tokens
        return length > 0 and start_pos + length <= self.config.layout.max_sequence_length

    @property
    def orphans(self) -> tuple[TensorResourceOrphan, ...]:
        """Invocation transients whose deallocation failed (retried by ``cleanup``)."""
        return tuple(self._orphans)

    def cleanup(self) -> None:
        """Release transients whose deallocation failed earlier; idempotent.

        Raises ``CleanupError`` listing the transients that failed to release again (they
        stay orphans, so a later call retries them).
        """
        if self._orphans:
            self._orphans = retry_orphans(
                self._orphans, device=self.config.device, ledger=ReleaseLedger()
            )
        if self._orphans:
            raise CleanupError([(f"prefill:{o.path}", o.error) for o in self._orphans])
