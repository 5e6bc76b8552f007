"""Dependency-injection containers (installed as ``llmrt.containers``): recipe -> device,
model, lanes and runtime, in owned scopes.

May import the recipe, the runtime core and everything below; never ``serving``,
``vllm``, ``server``, ``cli``, ``benchmarks`` or ``testing``.
"""

# di_import first: it imports dependency_injector without its web-framework probes.
from . import di_import  # noqa: F401
from .ownership import Borrowed, Owned
from .runtime import (
    DeviceContainer,
    LaneContainer,
    ModelContainer,
    RuntimeContainer,
    build_lane_group,
    build_lanes,
    close_runtime,
    start_runtime,
)

__all__ = [
    "Borrowed",
    "DeviceContainer",
    "LaneContainer",
    "ModelContainer",
    "Owned",
    "RuntimeContainer",
    "build_lane_group",
    "build_lanes",
    "close_runtime",
    "start_runtime",
]
