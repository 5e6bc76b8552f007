"""The one startup sequence of a built runtime: configure, allocate, warm decode, warm prefill,
activate.

Every front end (``LLM``, the vLLM adapter, the HTTP server, the integration tests) brings a
container-built lane group up through :class:`StartupSequence`, so the phase order and its
checks live in one place:

1. ``configure_kv_capacity(num_blocks)`` resolves physical KV capacity (shrink only);
2. ``allocate_kv_cache()`` allocates and binds every lane's KV (configuring first if needed);
3. ``warmup_decode()`` and 4. ``warmup_prefill()`` compile each lane's coverage (either
   order, as vLLM calls them; compilation needs allocated KV);
5. ``activate()`` commits trace capture on every lane through the capture barrier (already
   done by the last warmup when capture succeeded; a retry after a failed capture) and checks
   that every lane is serving-ready.

``run(num_blocks=...)`` performs all five in that order. A phase called out of order raises
``KVCacheStateError`` naming the phase that must come first; calling a finished phase again is
a no-op (the same capacity, or ``None``, configured again included), so a front end that
mirrors an external call order (vLLM) stays idempotent. A phase that failed can be called
again: every lane's step is idempotent (a lane that allocated keeps its KV), so a retried
``run()`` picks up where the failure stopped it.
"""

from __future__ import annotations

import enum

from llmrt.errors import KVCacheStateError
from llmrt.runtime.lane_group import LaneGroupExecutor
from llmrt.runtime.paged_kv_cache import PagedKVCacheContext


class StartupPhase(enum.IntEnum):
    """How far a runtime has come up; phases only move forward."""

    BUILT = 0
    CONFIGURED = 1
    ALLOCATED = 2
    ACTIVE = 3


class StartupSequence:
    """Brings one container-built lane group to serving; borrows the group."""

    def __init__(self, *, group: LaneGroupExecutor) -> None:
        self.group = group
        self._phase = StartupPhase.BUILT
        self._decode_warm = False
        self._prefill_warm = False

    @property
    def phase(self) -> StartupPhase:
        return self._phase

    @property
    def warmed(self) -> bool:
        """Both warmups ran (``activate`` may follow)."""
        return self._decode_warm and self._prefill_warm

    @property
    def active(self) -> bool:
        return self._phase is StartupPhase.ACTIVE

    def run(self, *, num_blocks: int | None = None) -> LaneGroupExecutor:
        """All five phases in order; returns the serving-ready lane group."""
        self.configure_kv_capacity(num_blocks)
        self.allocate_kv_cache()
        self.warmup_decode()
        self.warmup_prefill()
        self.activate()
        return self.group

    # -- phases --------------------------------------------------------------------------

    def configure_kv_capacity(self, num_blocks: int | None = None) -> None:
        """Resolve every lane's physical KV capacity (``None``: the recipe's); before allocation."""
        if self._phase >= StartupPhase.ALLOCATED:
            if num_blocks is None or num_blocks == self.group.lanes[0].layout.num_blocks:
                return
            raise KVCacheStateError(
                f"startup: KV capacity cannot change to {num_blocks} blocks after allocation "
                f"({self.group.lanes[0].layout.num_blocks} allocated per lane)"
            )
        self.group.configure_kv_capacity(num_blocks)
        self._phase = StartupPhase.CONFIGURED

    def allocate_kv_cache(self) -> list[PagedKVCacheContext]:
        """Allocate and bind every lane's KV (configures the recipe's capacity if not done)."""
        if self._phase >= StartupPhase.ALLOCATED:
            return [lane.kv_cache.context for lane in self.group.lanes]
        if self._phase < StartupPhase.CONFIGURED:
            self.configure_kv_capacity(None)
        handles = [lane.allocate_kv_cache() for lane in self.group.lanes]
        self._phase = StartupPhase.ALLOCATED
        return handles

    def warmup_decode(self) -> None:
        """Compile every lane's decode coverage (capture follows once prefill is warm too)."""
        self._require_allocated("warmup_decode")
        if not self._decode_warm:
            self.group.warmup_decode()
            self._decode_warm = True

    def warmup_prefill(self) -> None:
        """Compile every lane's prefill coverage (capture follows once decode is warm too)."""
        self._require_allocated("warmup_prefill")
        if not self._prefill_warm:
            self.group.warmup_prefill()
            self._prefill_warm = True

    def activate(self) -> None:
        """Commit trace capture on every lane (all or none) and mark the runtime serving-ready."""
        if self._phase is StartupPhase.ACTIVE:
            return
        self._require_allocated("activate")
        if not (self._decode_warm and self._prefill_warm):
            missing = [
                name
                for name, done in (
                    ("warmup_decode", self._decode_warm),
                    ("warmup_prefill", self._prefill_warm),
                )
                if not done
            ]
            raise KVCacheStateError(f"startup: activate() needs {' and '.join(missing)} first")
        self.group.activate()
        self._phase = StartupPhase.ACTIVE

    def _require_allocated(self, phase: str) -> None:
        if self._phase < StartupPhase.ALLOCATED:
            raise KVCacheStateError(f"startup: {phase}() needs allocate_kv_cache() first")
