"""The errors the fake ttnn raises with the real library's text, and how to provoke each.

Each case names the text as it stands in the ttnn 0.81.1 wheel's shared libraries (``{}``
where tt-metal formats a value in) and a call sequence that makes a fresh ``FakeTtnn`` raise
it. ``tests/unit/test_ttnn_fake.py`` checks the fake's message against the text on every
machine; ``tests/ttnn_host`` checks the text is in the real wheel. Both read the text from
here, never from the fake's own constants.

Import with ``from fake_ttnn_errors import ...`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from llmrt.testing.fake_ttnn import FakeTtnn


def _mesh(fake: FakeTtnn, *, region: int = 1 << 20) -> Any:
    return fake.open_mesh_device(fake.MeshShape(1, 1), trace_region_size=region)


def _new_program_in_capture(fake: FakeTtnn) -> None:
    mesh = _mesh(fake)
    x = fake.from_torch(torch.ones(32, 32), device=mesh, layout=fake.TILE_LAYOUT)
    fake.begin_trace_capture(mesh, cq_id=0)
    fake.add(x, x)  # never run before the capture: not in the program cache


def _int32_embedding_ids(fake: FakeTtnn) -> None:
    mesh = _mesh(fake)
    ids = fake.from_torch(torch.tensor([[1, 2]], dtype=torch.int32), device=mesh)
    weight = fake.from_torch(torch.ones(4, 8), device=mesh, layout=fake.ROW_MAJOR_LAYOUT)
    fake.embedding(ids, weight)


def _row_major_matmul(fake: FakeTtnn) -> None:
    mesh = _mesh(fake)
    x = fake.from_torch(torch.ones(4, 4), device=mesh, layout=fake.ROW_MAJOR_LAYOUT)
    fake.matmul(x, x)


def _trace_over_region(fake: FakeTtnn) -> None:
    mesh = _mesh(fake, region=0)
    trace = fake.begin_trace_capture(mesh, cq_id=0)
    fake.end_trace_capture(mesh, trace, cq_id=0)


def _fabric_while_open(fake: FakeTtnn) -> None:
    _mesh(fake)
    fake.set_fabric_config(fake.FabricConfig.FABRIC_1D)


def _fabric_on_one_chip(fake: FakeTtnn) -> None:
    fake.set_fabric_config(fake.FabricConfig.FABRIC_1D)
    _mesh(fake)


#: case -> (the library's text, a call sequence making a fresh fake raise it)
LIBRARY_ERRORS: dict[str, tuple[str, Callable[[FakeTtnn], None]]] = {
    "program-cache-miss-in-capture": (
        "Cannot load new binaries during trace capture.This program is not yet in program "
        "cache. Warm up before capturing a trace.See the operation's hash signature for "
        "arguments that must match.",
        _new_program_in_capture,
    ),
    "embedding-ids-dtype": ("Input must be UINT32 or BFLOAT16", _int32_embedding_ids),
    "matmul-layout": ("Inputs to matmul must be tilized", _row_major_matmul),
    "trace-region": (
        "Creating trace buffers of size {}B on MeshDevice {}, but only {}B is allocated for "
        "trace region.",
        _trace_over_region,
    ),
    "fabric-after-open": ("is not allowed while devices are still open", _fabric_while_open),
    "fabric-on-one-chip": ("requires at least 2 participating chips", _fabric_on_one_chip),
}


def fake_message(provoke: Callable[[FakeTtnn], None]) -> str:
    """What a fresh fake raises under ``provoke`` (it must raise)."""
    try:
        provoke(FakeTtnn())
    except Exception as exc:  # the message is what is compared
        return str(exc)
    raise AssertionError(f"{provoke.__name__}: the fake raised nothing")


def says(message: str, text: str) -> bool:
    """Whether ``message`` contains ``text``, each ``{}`` in it standing for a value."""
    pattern = ".+?".join(re.escape(part) for part in text.split("{}"))
    return re.search(pattern, message) is not None
