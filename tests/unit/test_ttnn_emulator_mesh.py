"""The ttnn emulator on multi-chip meshes: mesh mappers and composers, per-chip op execution,
and the CCL ops (``all_gather``, ``reduce_scatter``, ``all_reduce``) against torch.

Each expectation is written from ttnn 0.81.1's documented semantics with plain torch
(chunks, concatenations and sums of the chips' values), not from the emulator's helpers.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from llmrt.testing.fake_ttnn import FakeTtnn, TtnnRuleViolation


def _open(shape: tuple[int, int], *, fabric: bool = True) -> tuple[FakeTtnn, object]:
    fake = FakeTtnn(system_mesh_shape=shape)
    if fabric:
        fake.set_fabric_config(fake.FabricConfig.FABRIC_1D)
    return fake, fake.open_mesh_device(fake.MeshShape(*shape), trace_region_size=1 << 20)


@pytest.fixture
def t3k() -> Iterator[tuple[FakeTtnn, object]]:
    fake, mesh = _open((1, 8))
    yield fake, mesh
    assert fake.violations == ()


def _per_chip(fake: FakeTtnn, mesh: object, tensor: object) -> list[torch.Tensor]:
    """Each chip's value: the chips' tensors stacked on a new leading dim by the composer."""
    devices = mesh.get_num_devices()  # type: ignore[attr-defined]
    rank = len(tensor.shape)  # type: ignore[attr-defined]
    joined = fake.to_torch(tensor, mesh_composer=fake.ConcatMeshToTensor(mesh, dim=0))
    if rank == 0:
        return list(joined)
    return list(joined.reshape(devices, -1, *joined.shape[1:]).unbind(0))


def test_shard_tensor_to_mesh_gives_each_chip_its_chunk(t3k: tuple[FakeTtnn, object]) -> None:
    fake, mesh = t3k
    value = torch.randn(4, 64)
    sharded = fake.from_torch(
        value, dtype=fake.float32, device=mesh, mesh_mapper=fake.ShardTensorToMesh(mesh, dim=1)
    )
    assert tuple(sharded.shape) == (4, 8)
    chips = _per_chip(fake, mesh, sharded)
    for d in range(8):
        assert torch.equal(chips[d], value[:, 8 * d : 8 * (d + 1)])
    back = fake.to_torch(sharded, mesh_composer=fake.ConcatMeshToTensor(mesh, dim=1))
    assert torch.equal(back, value)
    with pytest.raises(RuntimeError, match="does not split evenly over 8 devices"):
        fake.from_torch(
            torch.zeros(4, 12), device=mesh, mesh_mapper=fake.ShardTensorToMesh(mesh, dim=1)
        )


def test_shard_tensor_2d_mesh_and_its_composer() -> None:
    fake, mesh = _open((2, 4))
    value = torch.randn(6, 16)
    both = fake.from_torch(
        value,
        dtype=fake.float32,
        device=mesh,
        mesh_mapper=fake.ShardTensor2dMesh(mesh, mesh_shape=(2, 4), dims=(0, 1)),
    )
    assert tuple(both.shape) == (3, 4)
    chips = _per_chip(fake, mesh, both)
    for r in range(2):
        for c in range(4):
            assert torch.equal(chips[4 * r + c], value[3 * r : 3 * r + 3, 4 * c : 4 * c + 4])
    composer = fake.ConcatMesh2dToTensor(mesh, mesh_shape=(2, 4), dims=(0, 1))
    assert torch.equal(fake.to_torch(both, mesh_composer=composer), value)
    rows_replicated = fake.from_torch(
        value,
        dtype=fake.float32,
        device=mesh,
        mesh_mapper=fake.ShardTensor2dMesh(mesh, mesh_shape=(2, 4), dims=(None, 1)),
    )
    chips = _per_chip(fake, mesh, rows_replicated)
    for r in range(2):
        for c in range(4):
            assert torch.equal(chips[4 * r + c], value[:, 4 * c : 4 * c + 4])
    with pytest.raises(RuntimeError, match="does not cover the mesh's 8 devices"):
        fake.ShardTensor2dMesh(mesh, mesh_shape=(2, 2), dims=(0, 1))


def test_ops_run_on_each_chips_own_values(t3k: tuple[FakeTtnn, object]) -> None:
    """A column-sharded weight times a replicated input: each chip computes its columns."""
    fake, mesh = t3k
    x, w = torch.randn(4, 32), torch.randn(32, 64)
    tx = fake.from_torch(x, dtype=fake.float32, layout=fake.TILE_LAYOUT, device=mesh)
    tw = fake.from_torch(
        w,
        dtype=fake.float32,
        layout=fake.TILE_LAYOUT,
        device=mesh,
        mesh_mapper=fake.ShardTensorToMesh(mesh, dim=-1),
    )
    y = fake.linear(tx, tw)
    assert tuple(y.shape) == (4, 8)
    for d, chip in enumerate(_per_chip(fake, mesh, y)):
        assert torch.allclose(chip, x @ w[:, 8 * d : 8 * (d + 1)], atol=1e-5)


def _distinct(fake: FakeTtnn, mesh: object, chips: torch.Tensor, dtype: object) -> object:
    """A device tensor whose chip ``d`` holds ``chips[d]``."""
    devices = chips.shape[0]
    flat = chips.reshape(devices * chips.shape[1], *chips.shape[2:])
    return fake.from_torch(
        flat,
        dtype=dtype,
        layout=fake.TILE_LAYOUT,
        device=mesh,
        mesh_mapper=fake.ShardTensorToMesh(mesh, dim=0),
    )


def test_all_gather_joins_every_chips_value_on_every_chip(t3k: tuple[FakeTtnn, object]) -> None:
    fake, mesh = t3k
    chips = torch.randn(8, 2, 32)
    gathered = fake.all_gather(_distinct(fake, mesh, chips, fake.float32), -1)
    assert tuple(gathered.shape) == (2, 256)
    expected = torch.cat(list(chips), dim=-1)
    for chip in _per_chip(fake, mesh, gathered):
        assert torch.equal(chip, expected)


def test_reduce_scatter_leaves_chip_d_the_dth_chunk_of_the_sum(
    t3k: tuple[FakeTtnn, object],
) -> None:
    fake, mesh = t3k
    chips = torch.randn(8, 2, 64)
    scattered = fake.reduce_scatter(_distinct(fake, mesh, chips, fake.float32), -1)
    assert tuple(scattered.shape) == (2, 8)
    total = chips.double().sum(0)
    for d, chip in enumerate(_per_chip(fake, mesh, scattered)):
        assert torch.allclose(chip.double(), total[:, 8 * d : 8 * (d + 1)], atol=1e-5)


def _bf16(value: torch.Tensor) -> torch.Tensor:
    return value.to(torch.bfloat16).float()


def _pairwise_bf16(blocks: list[torch.Tensor]) -> torch.Tensor:
    """ttnn 0.81.1's reduce kernels (``reduce_scatter_minimal_direct_compute.cpp``,
    ``all_reduce_async``'s ``reduction.cpp``) on bfloat16 tiles: blocks added pairwise,
    ``add_tiles`` accumulating each pair into a bfloat16 destination register."""
    acc = _bf16(blocks[0].float() + blocks[1].float())
    for a, b in zip(blocks[2::2], blocks[3::2], strict=True):
        acc = _bf16(acc + (a.float() + b.float()))
    return acc


def test_all_reduce_sums_in_bfloat16_as_the_chip_folds_the_blocks(
    t3k: tuple[FakeTtnn, object],
) -> None:
    """A bfloat16 all-reduce accumulates in bfloat16 (ttnn turns fp32 accumulation on for
    float32 tensors only), not in float32 rounded once."""
    fake, mesh = t3k
    torch.manual_seed(1)
    chips = torch.randn(8, 2, 32).to(torch.bfloat16)
    reduced = fake.all_reduce(_distinct(fake, mesh, chips, fake.bfloat16))
    assert reduced.dtype == fake.bfloat16 and tuple(reduced.shape) == (2, 32)
    expected = _pairwise_bf16(list(chips))
    once = _bf16(chips.float().sum(0))
    assert not torch.equal(expected, once)  # the data tells the two apart
    for chip in _per_chip(fake, mesh, reduced):
        assert chip.dtype == torch.bfloat16
        assert torch.equal(chip.float(), expected)


def test_a_ring_reduce_scatter_folds_each_chunk_on_its_owner_in_bfloat16(
    t3k: tuple[FakeTtnn, object],
) -> None:
    """T3K's ring, a decode-sized input: 0.81.1's one-shot direct path, chip ``d`` folding
    its own chunk first, then the other chips' in device order."""
    fake, mesh = t3k
    torch.manual_seed(2)
    chips = torch.randn(8, 32, 256).to(torch.bfloat16)
    tensor = _distinct(fake, mesh, chips, fake.bfloat16)
    scattered = fake.reduce_scatter(tensor, -1, topology=fake.Topology.Ring)
    assert scattered.dtype == fake.bfloat16 and tuple(scattered.shape) == (32, 32)
    differs = False
    for d, chip in enumerate(_per_chip(fake, mesh, scattered)):
        pieces = [c[:, 32 * d : 32 * (d + 1)] for c in chips]
        expected = _pairwise_bf16([pieces[d], *pieces[:d], *pieces[d + 1 :]])
        assert torch.equal(chip.float(), expected)
        differs |= not torch.equal(expected, _bf16(torch.stack(pieces).float().sum(0)))
    assert differs


def test_a_two_chip_reduce_scatter_rounds_the_sum_once() -> None:
    """N300's line: one addition per element, its bfloat16 rounding the only one."""
    fake, mesh = _open((1, 2))
    chips = torch.randn(2, 32, 64).to(torch.bfloat16)
    scattered = fake.reduce_scatter(
        _distinct(fake, mesh, chips, fake.bfloat16), -1, topology=fake.Topology.Linear
    )
    total = _bf16(chips[0].float() + chips[1].float())
    for d, chip in enumerate(_per_chip(fake, mesh, scattered)):
        assert torch.equal(chip.float(), total[:, 32 * d : 32 * (d + 1)])


def test_a_line_reduce_scatter_stays_within_its_bfloat16_roundings() -> None:
    """Eight chips on a line (store-and-forward, each hop's partial stored in bfloat16): the
    error against the exact sum is bounded by one bfloat16 rounding per addition."""
    fake, mesh = _open((1, 8))
    chips = torch.randn(8, 32, 256).to(torch.bfloat16)
    scattered = fake.reduce_scatter(
        _distinct(fake, mesh, chips, fake.bfloat16), -1, topology=fake.Topology.Linear
    )
    exact = chips.double().sum(0)
    bound = 7 * 2**-8 * chips.double().abs().sum(0)  # (n - 1) unit roundoffs of |terms|
    for d, chip in enumerate(_per_chip(fake, mesh, scattered)):
        part = slice(32 * d, 32 * (d + 1))
        assert bool(((chip.double() - exact[:, part]).abs() <= bound[:, part]).all())


def test_reduce_scatter_then_all_gather_is_the_row_parallel_matmul(
    t3k: tuple[FakeTtnn, object],
) -> None:
    """tt_transformers' all-reduce on a 1xN mesh: row-sharded weight, partial sums, reduce-
    scatter, all-gather: every chip holds ``x @ w``."""
    fake, mesh = t3k
    x, w = torch.randn(4, 64), torch.randn(64, 32)
    shard = fake.ShardTensorToMesh(mesh, dim=-1)
    tx = fake.from_torch(
        x, dtype=fake.float32, layout=fake.TILE_LAYOUT, device=mesh, mesh_mapper=shard
    )
    tw = fake.from_torch(
        w,
        dtype=fake.float32,
        layout=fake.TILE_LAYOUT,
        device=mesh,
        mesh_mapper=fake.ShardTensorToMesh(mesh, dim=-2),
    )
    partial = fake.linear(tx, tw)
    out = fake.all_gather(fake.reduce_scatter(partial, -1), -1)
    for chip in _per_chip(fake, mesh, out):
        assert torch.allclose(chip, x @ w, atol=1e-4)


def test_cluster_axis_rings_are_the_mesh_rows_or_columns() -> None:
    fake, mesh = _open((2, 4))
    chips = torch.arange(8, dtype=torch.float32).reshape(8, 1, 1).expand(8, 2, 32).clone()
    tensor = _distinct(fake, mesh, chips, fake.float32)
    rows = _per_chip(fake, mesh, fake.all_gather(tensor, 0, cluster_axis=1))
    columns = _per_chip(fake, mesh, fake.all_reduce(tensor, cluster_axis=0))
    for r in range(2):
        for c in range(4):
            assert torch.equal(rows[4 * r + c], torch.cat([chips[4 * r + k] for k in range(4)]))
            assert torch.equal(columns[4 * r + c], chips[c] + chips[4 + c])


def test_collectives_run_inside_traces(t3k: tuple[FakeTtnn, object]) -> None:
    """A captured all-reduce replays against refreshed inputs, as a decode trace does."""
    fake, mesh = t3k
    shard = fake.ShardTensorToMesh(mesh, dim=0)

    def host(chips: torch.Tensor) -> object:
        return fake.from_torch(
            chips.reshape(16, 32), dtype=fake.float32, layout=fake.TILE_LAYOUT, mesh_mapper=shard
        )

    first = torch.randn(8, 2, 32)
    device = fake.to_device(host(first), mesh)
    program = lambda: fake.all_gather(fake.reduce_scatter(device, -1), -1)  # noqa: E731
    assert torch.allclose(_per_chip(fake, mesh, program())[0], first.sum(0), atol=1e-5)
    trace = fake.begin_trace_capture(mesh)
    out = program()
    fake.end_trace_capture(mesh, trace)
    second = torch.randn(8, 2, 32)
    fake.copy_host_to_device_tensor(host(second), device)
    fake.execute_trace(mesh, trace)
    for chip in _per_chip(fake, mesh, out):
        assert torch.allclose(chip, second.sum(0), atol=1e-5)
    fake.release_trace(mesh, trace)


def test_collective_arguments_are_checked_as_ttnn_checks_them(
    t3k: tuple[FakeTtnn, object],
) -> None:
    fake, mesh = t3k
    value = fake.from_torch(torch.zeros(2, 36), dtype=fake.bfloat16, device=mesh)
    with pytest.raises(TtnnRuleViolation, match=r"dim -1 \(36\) is not divisible by the 8"):
        fake.reduce_scatter(value, -1)
    with pytest.raises(TtnnRuleViolation, match="cluster_axis 2"):
        fake.all_gather(value, 0, cluster_axis=2)
    with pytest.raises(TtnnRuleViolation, match="dim 2 is out of range"):
        fake.all_gather(value, 2)
    with pytest.raises(TtnnRuleViolation, match="rank 2 or greater"):
        fake.all_reduce(fake.from_torch(torch.zeros(16), dtype=fake.bfloat16, device=mesh))
    ids = fake.from_torch(torch.zeros(2, 32, dtype=torch.int32), dtype=fake.int32, device=mesh)
    with pytest.raises(TtnnRuleViolation, match="INT32 is not BFLOAT16"):
        fake.all_reduce(ids)
    with pytest.raises(TypeError, match=r"topology must be a ttnn\.Topology"):
        fake.all_gather(value, 0, topology="ring")
    with pytest.raises(NotImplementedError, match="output_tensor"):
        fake.all_gather(value, 0, output_tensor=value)
    assert len(fake.violations) == 5
    fake._violations.clear()  # the fixture checks for unexpected ones


def test_collectives_need_a_fabric() -> None:
    fake, mesh = _open((1, 2), fabric=False)
    value = fake.from_torch(torch.zeros(2, 64), dtype=fake.bfloat16, device=mesh)
    with pytest.raises(TtnnRuleViolation, match="opened without a fabric"):
        fake.all_gather(value, -1)


def test_an_all_gather_on_a_2d_mesh_over_a_1d_fabric_names_its_axis() -> None:
    """ttnn 0.81.1: "1D fabric on a 2D mesh_device requires cluster_axis to be set"."""
    fake, mesh = _open((2, 4))
    tensor = _distinct(fake, mesh, torch.randn(8, 2, 32), fake.bfloat16)
    with pytest.raises(TtnnRuleViolation, match="requires cluster_axis to be set"):
        fake.all_gather(tensor, -1)
    assert len(_per_chip(fake, mesh, fake.all_gather(tensor, -1, cluster_axis=1))) == 8


def test_a_2d_reduce_scatter_without_an_axis_reduces_each_axis_in_turn() -> None:
    """ttnn 0.81.1 on a non-line mesh: axis 0, then axis 1; chip ``(r, c)`` keeps chunk
    ``r * cols + c`` of the sum (float32: exact to rounding)."""
    fake, mesh = _open((2, 4))
    chips = torch.randn(8, 32, 256)
    scattered = fake.reduce_scatter(_distinct(fake, mesh, chips, fake.float32), -1)
    total = chips.double().sum(0)
    for d, chip in enumerate(_per_chip(fake, mesh, scattered)):
        assert torch.allclose(chip.double(), total[:, 32 * d : 32 * (d + 1)], atol=1e-5)
