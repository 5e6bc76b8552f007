"""Best-effort tensor release: orphans on failure, retry releases the rest, never twice."""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from llmrt.device import TorchDevice
from llmrt.runtime.tensor_resources import (
    ReleaseLedger,
    TensorResourceOrphan,
    iter_tensors,
    release_tensors,
    retry_orphans,
)
from llmrt.testing import FaultyDevice, InjectedFault


@attrs.frozen(kw_only=True)
class KVPair:
    keys: torch.Tensor
    values: torch.Tensor
    block_size: int


class Holder:
    """Owns ``mine`` and borrows ``borrowed``; only ``owned_tensors()`` is released."""

    def __init__(self, *, mine: torch.Tensor, borrowed: torch.Tensor) -> None:
        self.mine = mine
        self.borrowed = borrowed

    def owned_tensors(self) -> dict[str, torch.Tensor]:
        return {"mine": self.mine}


def successful_deallocations(device: FaultyDevice) -> Counter[int | None]:
    return Counter(c.subject_id for c in device.calls_of("deallocate") if not c.injected)


def test_walks_nested_structures_and_skips_non_tensors() -> None:
    inner = TorchDevice("cpu")
    a, b, c, d = (inner.allocate(shape=(1,), dtype=torch.float32) for _ in range(4))
    borrowed = torch.zeros(1)
    resources = {
        "kv": [KVPair(keys=a, values=b, block_size=32)],
        "io": (c, "label", 7, None),
        "holder": Holder(mine=d, borrowed=borrowed),
    }
    paths = [path for path, _ in iter_tensors(resources, path="r")]
    assert paths == [
        "r['kv'][0].keys",
        "r['kv'][0].values",
        "r['io'][0]",
        "r['holder'].owned_tensors()['mine']",
    ]
    assert release_tensors(resources, device=inner, ledger=ReleaseLedger()) == []
    assert inner.stats().live_tensors == 0


def test_aliased_tensor_is_released_once() -> None:
    device = FaultyDevice(TorchDevice("cpu"), fail={})
    t = device.allocate(shape=(2,), dtype=torch.float32)
    shared = [t]
    ledger = ReleaseLedger()
    assert release_tensors({"a": t, "b": (t, shared, shared)}, device=device, ledger=ledger) == []
    assert release_tensors([t], device=device, ledger=ledger) == []  # a second cleanup pass
    assert len(device.calls_of("deallocate", subject=t)) == 1
    assert t in ledger


def test_partial_failure_then_retry_releases_the_rest_exactly_once() -> None:
    device = FaultyDevice(TorchDevice("cpu"), fail={"deallocate": 2})
    tensors = [device.allocate(shape=(1,), dtype=torch.float32) for _ in range(3)]
    ledger = ReleaseLedger()

    with capture_logs() as logs:
        orphans = release_tensors({"kv": tensors}, device=device, ledger=ledger)

    assert len(orphans) == 1
    orphan = orphans[0]
    assert isinstance(orphan, TensorResourceOrphan)
    assert orphan.tensor is tensors[1]
    assert orphan.path == "resources['kv'][1]"
    assert isinstance(orphan.error, InjectedFault)
    assert [e["event"] for e in logs] == ["resource.orphaned"]
    assert logs[0]["path"] == "resources['kv'][1]"

    assert retry_orphans(orphans + orphans, device=device, ledger=ledger) == []
    assert release_tensors({"kv": tensors}, device=device, ledger=ledger) == []
    assert retry_orphans(orphans, device=device, ledger=ledger) == []

    attempts = Counter(c.subject_id for c in device.calls_of("deallocate"))
    assert attempts == {id(tensors[0]): 1, id(tensors[1]): 2, id(tensors[2]): 1}
    assert successful_deallocations(device) == {id(t): 1 for t in tensors}
    assert device.stats().live_tensors == 0


def test_retry_that_fails_again_keeps_the_orphan_with_the_new_error() -> None:
    device = FaultyDevice(TorchDevice("cpu"), fail={"deallocate": [1, 2]})
    t = device.allocate(shape=(1,), dtype=torch.float32)
    ledger = ReleaseLedger()
    first = release_tensors((t,), device=device, ledger=ledger)
    second = retry_orphans(first, device=device, ledger=ledger)
    assert [o.path for o in second] == ["resources[0]"]
    assert second[0].error is not first[0].error
    assert retry_orphans(second, device=device, ledger=ledger) == []
    assert device.stats().live_tensors == 0


def test_base_exceptions_are_not_swallowed() -> None:
    class Interrupting(TorchDevice):
        def deallocate(self, tensor: torch.Tensor) -> None:
            raise KeyboardInterrupt

    device = Interrupting("cpu")
    with pytest.raises(KeyboardInterrupt):
        release_tensors([device.allocate(shape=(1,), dtype=torch.float32)],
                        device=device, ledger=ReleaseLedger())


class Leaf:
    def __init__(self, index: int) -> None:
        self.index = index


structures = st.recursive(
    st.one_of(st.integers(0, 5).map(Leaf), st.none(), st.integers(), st.text(max_size=2)),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=2), children, max_size=4),
    ),
    max_leaves=20,
)


def materialize(shape: Any, pool: list[torch.Tensor]) -> Any:
    if isinstance(shape, Leaf):
        return pool[shape.index]
    if isinstance(shape, list):
        return [materialize(x, pool) for x in shape]
    if isinstance(shape, tuple):
        return tuple(materialize(x, pool) for x in shape)
    if isinstance(shape, dict):
        return {k: materialize(v, pool) for k, v in shape.items()}
    return shape


@settings(max_examples=60, deadline=None)
@given(shape=structures, failing=st.sets(st.integers(1, 12), max_size=6))
def test_release_with_retries_frees_every_tensor_exactly_once(
    shape: Any, failing: set[int]
) -> None:
    inner = TorchDevice("cpu")
    device = FaultyDevice(inner, fail={"deallocate": failing} if failing else {})
    pool = [inner.allocate(shape=(1,), dtype=torch.float32) for _ in range(6)]
    resources = materialize(shape, pool)
    reachable = {id(t): t for _, t in iter_tensors(resources)}
    ledger = ReleaseLedger()

    orphans = release_tensors(resources, device=device, ledger=ledger)
    assert len(orphans) <= len(failing)
    for _ in range(len(failing) + 1):
        orphans = retry_orphans(orphans, device=device, ledger=ledger)
    assert orphans == []
    assert release_tensors(resources, device=device, ledger=ledger) == []

    assert successful_deallocations(device) == {key: 1 for key in reachable}
    assert inner.stats().live_tensors == len(pool) - len(reachable)
    assert all(t in ledger for t in reachable.values())
