"""Per-device values on a multi-chip mesh for the fake ttnn: mappers, composers, CCL payloads.

Why: tensor-parallel layers leave different values on each chip (a column shard of a
weight, a partial sum of a row-parallel matmul), so one logical payload per tensor cannot
say what a chip holds. A tensor whose chips differ keeps a *stacked* payload: device ``d``
(row-major over the mesh, as ttnn numbers a mesh's devices) holds ``payload[d]``. A
replicated tensor keeps one payload (every chip holds the same value).

An op whose inputs include a stacked tensor runs once per device on that device's values
(``per_device``), as each chip runs its own program; its outputs are stacked. The collective
ops (``all_gather``, ``reduce_scatter``, ``all_reduce``) are the only ones that read other
chips' values; they combine the stacked payload along the rings ``cluster_axis`` names.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch


@attrs.frozen(eq=False)
class Shards:
    """A stacked payload inside an op's unwrapped arguments: device ``d`` holds ``stacked[d]``."""

    stacked: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.stacked.shape[0])


def leaves(tree: Any) -> Iterator[Any]:
    """Every non-container item of nested tuples, lists and mappings (an op's arguments)."""
    if isinstance(tree, (tuple, list)):
        for item in tree:
            yield from leaves(item)
    elif isinstance(tree, Mapping):
        for item in tree.values():
            yield from leaves(item)
    else:
        yield tree


def _map(tree: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map(v, fn) for v in tree]
    if type(tree) is tuple:
        return tuple(_map(v, fn) for v in tree)
    return fn(tree)


_Seen = dict[int, tuple[torch.Tensor, torch.Tensor]]
"""``id(view) -> (view, stacked)`` of the device views one device's call was given."""


def _combine(results: list[Any], views: list[_Seen]) -> Any:
    """One stacked result from each device's: a device's view of a stacked input comes back
    as that input (an in-place op), tensors stack, anything else is device 0's."""
    first = results[0]
    if isinstance(first, dict):
        return {k: _combine([r[k] for r in results], views) for k in first}
    if isinstance(first, list) or type(first) is tuple:
        items = [_combine([r[i] for r in results], views) for i in range(len(first))]
        return items if isinstance(first, list) else tuple(items)
    if isinstance(first, torch.Tensor):
        owners = [seen.get(id(r), (None, None))[1] for r, seen in zip(results, views, strict=True)]
        if owners[0] is not None and all(o is owners[0] for o in owners):
            return Shards(owners[0])
        return Shards(torch.stack(results))
    return first


def per_device(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` run once per device when any argument is ``Shards`` (that device's values;
    single payloads are every device's), its tensor results stacked into ``Shards``."""

    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> Any:
        counts = {leaf.count for leaf in leaves((args, kwargs)) if isinstance(leaf, Shards)}
        if not counts:
            return func(*args, **kwargs)
        if len(counts) != 1:
            raise RuntimeError(f"per-device inputs of {sorted(counts)} devices in one op")
        results, views = [], []
        for device in range(counts.pop()):
            seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

            def pick(leaf: Any, device: int = device, seen: _Seen = seen) -> Any:
                if not isinstance(leaf, Shards):
                    return leaf
                view = leaf.stacked[device]
                seen[id(view)] = (view, leaf.stacked)  # the view kept alive: its id stays its
                return view

            results.append(func(*_map(args, pick), **_map(kwargs, pick)))
            views.append(seen)
        return _combine(results, views)

    return run


# -- mappers and composers -----------------------------------------------------------------


def mesh_grid(shape: Sequence[int]) -> tuple[int, int]:
    """``(rows, columns)`` of a mesh shape (a 1-D mesh is one row)."""
    dims = [int(d) for d in shape]
    if len(dims) == 1:
        return 1, dims[0]
    return dims[0], math.prod(dims[1:])


def _split(tensor: torch.Tensor, dim: int | None, parts: int, what: str) -> list[torch.Tensor]:
    if dim is None or parts == 1:
        return [tensor] * parts
    size = tensor.shape[dim]
    if size % parts:
        raise RuntimeError(
            f"{what}: dimension {dim} of shape {list(tensor.shape)} ({size}) does not split "
            f"evenly over {parts} devices"
        )
    return list(torch.chunk(tensor, parts, dim=dim))


def shard_1d(tensor: torch.Tensor, *, dim: int, devices: int) -> torch.Tensor:
    """``ShardTensorToMesh``: device ``d`` holds the ``d``-th of ``devices`` equal chunks."""
    _check_dim(dim, tensor.dim(), "ShardTensorToMesh")
    return torch.stack(_split(tensor, dim, devices, "ShardTensorToMesh"))


def shard_2d(
    tensor: torch.Tensor, *, dims: tuple[int | None, int | None], grid: tuple[int, int]
) -> torch.Tensor:
    """``ShardTensor2dMesh``: device ``(r, c)`` holds chunk ``r`` of ``dims[0]`` (whole when
    None) and, within it, chunk ``c`` of ``dims[1]``."""
    rows, cols = grid
    for d in dims:
        if d is not None:
            _check_dim(d, tensor.dim(), "ShardTensor2dMesh")
    if (
        dims[0] is not None
        and dims[1] is not None
        and dims[0] % tensor.dim() == dims[1] % tensor.dim()
    ):
        raise RuntimeError(f"ShardTensor2dMesh: dims {list(dims)} name one dimension twice")
    pieces = []
    for row in _split(tensor, dims[0], rows, "ShardTensor2dMesh"):
        pieces.extend(_split(row, dims[1], cols, "ShardTensor2dMesh"))
    return torch.stack(pieces)


def _check_dim(dim: int, rank: int, what: str) -> None:
    if not -rank <= dim < rank:
        raise RuntimeError(f"{what}: dim {dim} is out of range for a rank-{rank} tensor")


def concat_1d(shards: list[torch.Tensor], *, dim: int) -> torch.Tensor:
    if shards[0].dim() == 0:
        return torch.stack(shards)
    return torch.cat(shards, dim=dim)


def concat_2d(
    shards: list[torch.Tensor], *, dims: tuple[int, int], grid: tuple[int, int]
) -> torch.Tensor:
    """``ConcatMesh2dToTensor``: each mesh row's devices joined along ``dims[1]``, the rows
    along ``dims[0]``."""
    rows, cols = grid
    if dims[0] % shards[0].dim() == dims[1] % shards[0].dim():
        raise RuntimeError(f"ConcatMesh2dToTensor: dims {list(dims)} name one dimension twice")
    joined = [torch.cat(shards[r * cols : (r + 1) * cols], dim=dims[1]) for r in range(rows)]
    return torch.cat(joined, dim=dims[0])


# -- collectives ----------------------------------------------------------------------------


def rings(grid: tuple[int, int], cluster_axis: int | None) -> list[list[int]]:
    """Device indices of each ring a collective runs on: every device (``None``), each
    mesh column (axis 0: the devices that differ in row) or each mesh row (axis 1)."""
    rows, cols = grid
    if cluster_axis is None:
        return [list(range(rows * cols))]
    if cluster_axis == 0:
        return [[r * cols + c for r in range(rows)] for c in range(cols)]
    return [[r * cols + c for c in range(cols)] for r in range(rows)]


def gathered(shards: list[torch.Tensor], groups: list[list[int]], dim: int) -> list[torch.Tensor]:
    """Each device's ``all_gather`` result: its ring's values joined along ``dim``."""
    out: list[torch.Tensor] = [shards[0]] * len(shards)
    for ring in groups:
        joined = torch.cat([shards[d] for d in ring], dim=dim)
        for d in ring:
            out[d] = joined
    return out


Rounding = Callable[[torch.Tensor], torch.Tensor]
"""A value rounded to the format a chip holds it in (float32 torch values in and out)."""


def folded(blocks: Sequence[torch.Tensor], register: Rounding) -> torch.Tensor:
    """``blocks`` summed as ttnn 0.81.1's reduce kernels fold them into the destination
    register (``reduce_scatter_minimal_direct_compute.cpp``, ``all_reduce_async``'s
    ``reduction.cpp``): pairwise ``add_tiles`` accumulating into DST, each pair's sum added to
    the accumulator and rounded to the register's format (bfloat16 unless the tensor is
    float32, where fp32 accumulation is on); an odd count starts from the first block."""
    values = [b.float() for b in blocks]
    acc: torch.Tensor | None = None
    if len(values) % 2:
        acc, values = register(values[0]), values[1:]
    for a, b in zip(values[0::2], values[1::2], strict=True):
        pair = a + b
        acc = register(pair if acc is None else acc + pair)
    assert acc is not None
    return acc


def relayed(own: torch.Tensor, left: Sequence[torch.Tensor], right: Sequence[torch.Tensor],
            stored: Rounding) -> torch.Tensor:
    """A store-and-forward reduction's result on its owner: each side's partial accumulated hop
    by hop from the far end (every hop's partial stored in the tensor's dtype before it is
    sent on), the owner adding the nearer-side partials to its own value."""

    def partial(hops: Sequence[torch.Tensor]) -> torch.Tensor | None:
        acc: torch.Tensor | None = None
        for value in hops:
            acc = value.float() if acc is None else stored(acc + value.float())
        return acc

    total = own.float()
    for side in (partial(left), partial(right)):
        if side is not None:
            total = stored(total + side)
    return total


def reduced(
    shards: list[torch.Tensor], groups: list[list[int]], *, register: Rounding
) -> list[torch.Tensor]:
    """Each device's ``all_reduce`` result: its ring's values folded in device order (the
    gathered blocks ``all_reduce_async`` reduces on every device)."""
    out: list[torch.Tensor] = [shards[0]] * len(shards)
    for ring in groups:
        total = folded([shards[d] for d in ring], register)
        for d in ring:
            out[d] = total
    return out


def scattered(
    shards: list[torch.Tensor],
    groups: list[list[int]],
    dim: int,
    *,
    direct: bool,
    register: Rounding,
    stored: Rounding,
) -> list[torch.Tensor]:
    """Each device's ``reduce_scatter`` result: chunk ``i`` (its place in its ring) of the
    ring's sum along ``dim``. ``direct``: ttnn 0.81.1's one-shot path (a ring, a small tile
    input), the owner folding its own chunk then the others' in device order
    (``folded``); otherwise the store-and-forward line/ring kernels, modelled as partials
    relayed towards the owner from both ends of the line (``relayed``: exact for two
    devices, one rounding of a two-term sum; for longer rings the order of 0.81.1's
    bidirectional ring kernel is approximated, its per-hop rounding in the dtype kept)."""
    out: list[torch.Tensor] = [shards[0]] * len(shards)
    for ring in groups:
        pieces = [torch.chunk(shards[d], len(ring), dim=dim) for d in ring]
        for i, owner in enumerate(ring):
            mine = [p[i] for p in pieces]
            if direct:
                out[owner] = folded([mine[i], *mine[:i], *mine[i + 1 :]], register)
            else:
                out[owner] = relayed(mine[i], mine[:i], mine[:i:-1], stored)
    return out
