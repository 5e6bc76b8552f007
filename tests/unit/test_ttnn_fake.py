"""The recording fake ttnn: the hardware rules it enforces and the ttnn behaviour it mirrors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from fake_ttnn_errors import LIBRARY_ERRORS, fake_message, says

from llmrt.errors import ConfigError
from llmrt.testing.fake_ttnn import FakeTtnn, InjectedTtnnFailure, TtnnRuleViolation


def open_mesh(
    fake: FakeTtnn | None = None, *, shape: tuple[int, int] = (1, 1), region: int = 1 << 20
) -> tuple[FakeTtnn, Any]:
    fake = fake or FakeTtnn(system_mesh_shape=shape)
    return fake, fake.open_mesh_device(fake.MeshShape(*shape), trace_region_size=region)


def on_device(fake: FakeTtnn, mesh: Any, value: torch.Tensor) -> Any:
    return fake.from_torch(value, device=mesh, layout=fake.ROW_MAJOR_LAYOUT)


def violation(rule: str) -> Any:
    return pytest.raises(TtnnRuleViolation, match=f"ttnn rule violated: {rule}")


@pytest.mark.parametrize(
    ("rule", "call"),
    [
        ("no allocation inside capture", lambda f, m, t: on_device(f, m, torch.ones(2))),
        (
            "no allocation inside capture",
            lambda f, m, t: f.allocate_tensor_on_device([2], f.float32, f.ROW_MAJOR_LAYOUT, m),
        ),
        (
            "no allocation inside capture",
            lambda f, m, t: f.to_device(f.from_torch(torch.ones(2)), m),
        ),
        (
            "no host write inside capture",
            lambda f, m, t: f.copy_host_to_device_tensor(f.from_torch(torch.ones(2)), t),
        ),
        ("no read inside capture", lambda f, m, t: t.cpu(blocking=False)),
        ("no read inside capture", lambda f, m, t: f.to_torch(t)),
        ("no read inside capture", lambda f, m, t: t.item()),
        ("no event inside capture", lambda f, m, t: f.record_event(m, 0)),
        ("no synchronize inside capture", lambda f, m, t: f.synchronize_device(m)),
        ("no nested capture", lambda f, m, t: f.begin_trace_capture(m, cq_id=0)),
        ("deallocate inside capture", lambda f, m, t: f.deallocate(t)),
    ],
)
def test_capture_rejects_host_traffic(rule: str, call: Callable[[FakeTtnn, Any, Any], Any]) -> None:
    fake, mesh = open_mesh()
    t = on_device(fake, mesh, torch.zeros(2))
    tid = fake.begin_trace_capture(mesh, cq_id=0)
    with violation(rule):
        call(fake, mesh, t)
    fake.end_trace_capture(mesh, tid, cq_id=0)
    fake.release_trace(mesh, tid)
    assert [v.rule for v in fake.violations] == [rule]


def test_allocation_while_a_trace_is_live_raises_or_warns() -> None:
    fake, mesh = open_mesh()
    t = on_device(fake, mesh, torch.zeros(2))
    t + 1  # warm-up: compiles the program the capture runs
    tid = fake.begin_trace_capture(mesh, cq_id=0)
    t + 1
    fake.end_trace_capture(mesh, tid, cq_id=0)
    with violation("allocation while a trace is live"):
        on_device(fake, mesh, torch.ones(2))
    fake.copy_host_to_device_tensor(fake.from_torch(torch.ones(2)), t)
    (t * 2).deallocate()
    fake.release_trace(mesh, tid)
    on_device(fake, mesh, torch.ones(2))

    lenient, mesh = open_mesh(FakeTtnn(allocation_while_trace_live="warn"))
    t = on_device(lenient, mesh, torch.zeros(2))
    tid = lenient.begin_trace_capture(mesh, cq_id=0)
    lenient.end_trace_capture(mesh, tid, cq_id=0)
    on_device(lenient, mesh, torch.ones(2))
    assert len(lenient.warnings) == 1
    assert lenient.violations == ()
    with pytest.raises(ConfigError, match="allocation_while_trace_live"):
        FakeTtnn(allocation_while_trace_live="ignore")  # type: ignore[arg-type]


def test_non_blocking_read_needs_a_later_event_synchronized() -> None:
    fake, mesh = open_mesh()
    t = on_device(fake, mesh, torch.tensor([1.0, 2.0]))
    before = fake.record_event(mesh, 0)
    pending = t.cpu(blocking=False, cq_id=0)
    with violation("event synchronized before host read"):
        fake.to_torch(pending)
    fake.event_synchronize(before)
    with violation("event synchronized before host read"):
        pending.to_torch()
    fake.event_synchronize(fake.record_event(mesh, 0))
    assert fake.to_torch(pending).tolist() == [1.0, 2.0]

    later = t.cpu(blocking=False)
    fake.synchronize_device(mesh)
    assert fake.to_torch(later).tolist() == [1.0, 2.0]
    assert fake.to_torch(t.cpu(blocking=True)).tolist() == [1.0, 2.0]


def test_non_blocking_read_holds_the_value_queued_before_later_writes() -> None:
    fake, mesh = open_mesh()
    t = on_device(fake, mesh, torch.tensor([1, 2], dtype=torch.int32))
    pending = t.cpu(blocking=False)
    fake.copy_host_to_device_tensor(fake.from_torch(torch.tensor([7, 8], dtype=torch.int32)), t)
    fake.synchronize_device(mesh)
    assert fake.to_torch(pending).tolist() == [1, 2]


def test_nothing_is_deallocated_twice_or_used_after() -> None:
    fake, mesh = open_mesh()
    t = on_device(fake, mesh, torch.zeros(2))
    fake.deallocate(t)
    assert not t.is_allocated()
    with violation("deallocate twice"):
        t.deallocate()
    with violation("use after deallocate"):
        t + 1
    with violation("use after deallocate"):
        t.cpu()
    with violation("use after deallocate"):
        fake.copy_host_to_device_tensor(fake.from_torch(torch.ones(2)), t)


def test_trace_tensors_are_released_before_they_are_deallocated() -> None:
    fake, mesh = open_mesh()
    x = on_device(fake, mesh, torch.ones(2))
    x * 3
    tid = fake.begin_trace_capture(mesh, cq_id=0)
    out = x * 3
    fake.end_trace_capture(mesh, tid, cq_id=0)
    for tensor in (x, out):
        with violation("release_trace before deallocating its tensors"):
            fake.deallocate(tensor)
    fake.release_trace(mesh, tid)
    fake.deallocate(out)
    fake.deallocate(x)


def test_intermediates_may_be_freed_inside_their_capture_and_replay_still_runs() -> None:
    fake, mesh = open_mesh()
    x = on_device(fake, mesh, torch.tensor([1.0, 2.0]))
    (x * 2) + 1
    tid = fake.begin_trace_capture(mesh, cq_id=0)
    doubled = x * 2
    out = doubled + 1
    fake.deallocate(doubled)
    fake.end_trace_capture(mesh, tid, cq_id=0)
    fake.copy_host_to_device_tensor(fake.from_torch(torch.tensor([5.0, 6.0])), x)
    fake.execute_trace(mesh, tid, cq_id=0, blocking=False)
    assert fake.to_torch(out).tolist() == [11.0, 13.0]


def test_replay_repeats_in_place_writes_and_bakes_python_values() -> None:
    fake, mesh = open_mesh(FakeTtnn(torch_ops="allow"))
    counter = on_device(fake, mesh, torch.zeros(1))
    counter.add_(0.0)
    step = 2.0
    tid = fake.begin_trace_capture(mesh, cq_id=0)
    counter.add_(step)
    fake.end_trace_capture(mesh, tid, cq_id=0)
    step = 100.0
    for _ in range(3):
        fake.execute_trace(mesh, tid, cq_id=0, blocking=False)
    assert fake.to_torch(counter).tolist() == [8.0]
    assert fake.ops_run == 5


def test_trace_lifecycle_rules() -> None:
    fake, mesh = open_mesh(region=0)
    tid = fake.begin_trace_capture(mesh, cq_id=0)
    with violation("trace region"):
        fake.end_trace_capture(mesh, tid, cq_id=0)
    fake, mesh = open_mesh()
    tid = fake.begin_trace_capture(mesh, cq_id=0)
    with violation("end_trace_capture"):
        fake.end_trace_capture(mesh, fake.MeshTraceId(7), cq_id=0)
    with violation("no replay inside capture"):
        fake.execute_trace(mesh, tid, cq_id=0)
    fake.end_trace_capture(mesh, tid, cq_id=0)
    fake.release_trace(mesh, tid)
    with violation("release_trace"):
        fake.release_trace(mesh, tid)
    with violation("execute_trace"):
        fake.execute_trace(mesh, tid, cq_id=0)


def test_chosen_calls_fail_by_name_and_number() -> None:
    fake = FakeTtnn(fail={"Tensor.cpu": [2], "execute_trace": 1})
    _, mesh = open_mesh(fake)
    t = on_device(fake, mesh, torch.ones(1))
    t.cpu()
    with pytest.raises(InjectedTtnnFailure, match=r"Tensor.cpu call #2"):
        t.cpu()
    t.cpu()
    fake.inject("Tensor.cpu", 2)
    t.cpu()
    with pytest.raises(InjectedTtnnFailure, match=r"Tensor.cpu call #5"):
        t.cpu()
    fake.inject("deallocate", 1)
    with pytest.raises(InjectedTtnnFailure, match="deallocate call #1"):
        fake.deallocate(t)
    assert t.is_allocated()
    fake.deallocate(t)
    assert [(c.name, c.injected) for c in fake.calls if c.injected] == [
        ("Tensor.cpu", True),
        ("Tensor.cpu", True),
        ("deallocate", True),
    ]
    with pytest.raises(ConfigError, match=r"fail.release_trace: call numbers are integers >= 1"):
        FakeTtnn(fail={"release_trace": 0})


def test_submeshes_are_separate_queues() -> None:
    fake, mesh = open_mesh(shape=(1, 2))
    left, right = mesh.create_submeshes(fake.MeshShape(1, 1))
    a = on_device(fake, left, torch.ones(2))
    b = on_device(fake, right, torch.ones(2))
    with violation("op across meshes"):
        a + b
    tid = fake.begin_trace_capture(left, cq_id=0)
    on_device(fake, right, torch.ones(1))
    fake.end_trace_capture(left, tid, cq_id=0)
    with pytest.raises(RuntimeError, match="does not tile"):
        mesh.create_submeshes(fake.MeshShape(1, 3))
    fake.close_mesh_device(mesh)
    with violation("mesh closed"):
        on_device(fake, right, torch.ones(1))


def test_multi_device_tensors_compose_like_ttnn() -> None:
    fake, mesh = open_mesh(shape=(1, 2))
    value = torch.arange(4, dtype=torch.int32).reshape(2, 2)
    replicated = fake.from_torch(value, device=mesh, mesh_mapper=fake.ReplicateTensorToMesh(mesh))
    with pytest.raises(RuntimeError, match="pass a mesh_composer"):
        fake.to_torch(replicated)
    composer = fake.ConcatMeshToTensor(mesh, dim=0)
    assert torch.equal(fake.to_torch(replicated, mesh_composer=composer), torch.cat([value] * 2))
    sharded = fake.from_torch(value, device=mesh, mesh_mapper=fake.ShardTensorToMesh(mesh, dim=1))
    assert tuple(sharded.shape) == (2, 1)
    composer = fake.concat_mesh_to_tensor_composer(mesh, 1)
    assert torch.equal(fake.to_torch(sharded, mesh_composer=composer), value)
    unmapped = fake.from_torch(value)
    with violation("host tensor not distributed for this mesh"):
        fake.copy_host_to_device_tensor(unmapped, replicated)
    other, _ = open_mesh(shape=(1, 1))
    with violation("mesh mapper mismatch"):
        fake.from_torch(value, device=mesh, mesh_mapper=fake.replicate_tensor_to_mesh_mapper(other))


@pytest.mark.parametrize(
    ("source", "tt_dtype", "host_dtype"),
    [
        (torch.float32, "FLOAT32", torch.float32),
        (torch.bfloat16, "BFLOAT16", torch.bfloat16),
        (torch.float16, "BFLOAT16", torch.bfloat16),
        (torch.int64, "UINT32", torch.uint32),
        (torch.int32, "INT32", torch.int32),
        (torch.int16, "UINT16", torch.uint16),
        (torch.uint8, "UINT8", torch.uint8),
        (torch.bool, "UINT8", torch.uint8),
    ],
)
def test_inferred_dtypes_match_ttnn_0_81(
    source: torch.dtype, tt_dtype: str, host_dtype: torch.dtype
) -> None:
    fake = FakeTtnn()
    t = fake.from_torch(torch.zeros(2, 3, dtype=source))
    assert t.dtype.name == tt_dtype
    assert fake.to_torch(t).dtype == host_dtype


def test_block_floats_need_tile_layout_and_read_back_as_float32() -> None:
    fake = FakeTtnn()
    value = torch.arange(15, dtype=torch.float32).reshape(3, 5) / 7
    with pytest.raises(RuntimeError, match=r"Layout must be Layout::TILE"):
        fake.from_torch(value, dtype=fake.bfloat8_b, layout=fake.ROW_MAJOR_LAYOUT)
    t = fake.from_torch(value, dtype=fake.bfloat8_b, layout=fake.TILE_LAYOUT)
    assert (tuple(t.shape), tuple(t.padded_shape)) == ((3, 5), (32, 32))
    back = fake.to_torch(t)
    assert back.dtype == torch.float32
    assert torch.allclose(back, value, atol=0.02)
    wrapped = fake.to_torch(fake.from_torch(torch.tensor([0, -1], dtype=torch.int32), fake.uint32))
    assert wrapped.tolist() == [0, 4294967295]


def test_registered_ops_are_traced() -> None:
    fake, mesh = open_mesh()
    fake.register_op("softmax", lambda t, dim: torch.softmax(t, dim=dim))
    x = on_device(fake, mesh, torch.zeros(1, 2))
    fake.softmax(fake.add(x, x), dim=-1)  # type: ignore[attr-defined]
    tid = fake.begin_trace_capture(mesh, cq_id=0)
    out = fake.softmax(fake.add(x, x), dim=-1)  # type: ignore[attr-defined]
    fake.end_trace_capture(mesh, tid, cq_id=0)
    fake.copy_host_to_device_tensor(fake.from_torch(torch.tensor([[0.0, 1.0]])), x)
    fake.execute_trace(mesh, tid, cq_id=0, blocking=True)
    assert torch.allclose(fake.to_torch(out), torch.softmax(torch.tensor([[0.0, 2.0]]), dim=-1))


@pytest.mark.parametrize("case", sorted(LIBRARY_ERRORS))
def test_the_fake_raises_with_the_libraries_text(case: str) -> None:
    """The text is ttnn 0.81.1's (``tests/ttnn_host`` finds it in the wheel), not the fake's."""
    text, provoke = LIBRARY_ERRORS[case]
    message = fake_message(provoke)
    assert says(message, text), message
