"""Fully resolved static prefill collaborators, capabilities and geometry ceilings."""

from __future__ import annotations

import attrs

from llmrt.device.base import Device
from llmrt.errors import ConfigError, IdentityError
from llmrt.families.base import CausalLM
from llmrt.runtime.config import PREFILL_BATCH_SIZES, PageTableLayout
from llmrt.runtime.output_reader import OutputReader
from llmrt.runtime.prefill.buckets import FINE_DEFAULT_STEP
from llmrt.runtime.prefill.plan import PrefillPlanPolicy, WaveRules


@attrs.frozen(kw_only=True)
class PrefillRuntimeConfig:
    """What one lane's prefill runtime borrows and may do, decided once."""

    model: CausalLM
    device: Device
    output_reader: OutputReader
    layout: PageTableLayout
    lane_capacity: int
    policy: PrefillPlanPolicy
    device_sampling: bool
    vocab_size: int
    batching_enabled: bool
    max_batch_size: int
    buckets: str
    bucket_step: int
    wave_batch_sizes: tuple[int, ...] = PREFILL_BATCH_SIZES
    max_wave_seq_len: int | None = None
    wave_rules: WaveRules = "spec"
    lane: int = 0

    @classmethod
    def resolve(
        cls,
        *,
        model: CausalLM,
        device: Device,
        output_reader: OutputReader,
        page_table_layout: PageTableLayout,
        lane_capacity: int,
        batching_enabled: bool = True,
        max_batch_size: int = 8,
        buckets: str = "tile",
        bucket_step: int = FINE_DEFAULT_STEP,
        device_sampling_enabled: bool = True,
        wave_batch_sizes: tuple[int, ...] = PREFILL_BATCH_SIZES,
        max_wave_seq_len: int | None = None,
        wave_rules: WaveRules = "spec",
        lane: int = 0,
    ) -> PrefillRuntimeConfig:
        """``wave_batch_sizes`` / ``max_wave_seq_len``: the padded waves warmup covers (the
        configured warmup batch sizes at the shortest warmup length), so the planner never
        forms a wave whose program was not compiled before the compile gate closed.
        ``wave_rules``: the spec's, ``packed`` (cached rows in waves, large buckets split) or
        ``ragged`` (``packed``, rows of any lengths in one wave)."""
        if output_reader.borrowed_device is not device:
            raise IdentityError(
                "prefill output reader uses the lane device", output_reader.borrowed_device, device
            )
        if max_batch_size not in PREFILL_BATCH_SIZES:
            raise ConfigError(
                "prefill.max_batch_size", max_batch_size, f"must be one of {PREFILL_BATCH_SIZES}"
            )
        policy = cls._policy(
            model=model,
            layout=page_table_layout,
            lane_capacity=lane_capacity,
            batching_enabled=batching_enabled,
            max_batch_size=max_batch_size,
            buckets=buckets,
            bucket_step=bucket_step,
            wave_batch_sizes=wave_batch_sizes,
            max_wave_seq_len=max_wave_seq_len,
            wave_rules=wave_rules,
        )
        return cls(
            model=model,
            device=device,
            output_reader=output_reader,
            layout=page_table_layout,
            lane_capacity=lane_capacity,
            policy=policy,
            device_sampling=device_sampling_enabled,
            vocab_size=model.config.vocab_size,
            batching_enabled=batching_enabled,
            max_batch_size=max_batch_size,
            buckets=buckets,
            bucket_step=bucket_step,
            wave_batch_sizes=wave_batch_sizes,
            max_wave_seq_len=max_wave_seq_len,
            wave_rules=wave_rules,
            lane=lane,
        )

    @staticmethod
    def _policy(
        *,
        model: CausalLM,
        layout: PageTableLayout,
        lane_capacity: int,
        batching_enabled: bool,
        max_batch_size: int,
        buckets: str,
        bucket_step: int,
        wave_batch_sizes: tuple[int, ...],
        max_wave_seq_len: int | None,
        wave_rules: WaveRules,
    ) -> PrefillPlanPolicy:
        return PrefillPlanPolicy.from_layout(
            layout,
            batching_supported=True,
            batching_enabled=batching_enabled,
            max_batch_size=max_batch_size,
            lane_capacity=lane_capacity,
            model_extracts_batched_outputs=bool(model.supports_batched_prefill_outputs),
            buckets=buckets,
            bucket_step=bucket_step,
            wave_batch_sizes=tuple(b for b in wave_batch_sizes if b <= max_batch_size) or (1,),
            max_wave_seq_len=max_wave_seq_len,
            wave_rules=wave_rules,
        )

    def with_layout(self, layout: PageTableLayout) -> PrefillRuntimeConfig:
        """The late physical-capacity replacement (shrink only)."""
        self.layout.check_replacement(layout)
        policy = self._policy(
            model=self.model,
            layout=layout,
            lane_capacity=self.lane_capacity,
            batching_enabled=self.batching_enabled,
            max_batch_size=self.max_batch_size,
            buckets=self.buckets,
            bucket_step=self.bucket_step,
            wave_batch_sizes=self.wave_batch_sizes,
            max_wave_seq_len=self.max_wave_seq_len,
            wave_rules=self.wave_rules,
        )
        return attrs.evolve(self, layout=layout, policy=policy)
