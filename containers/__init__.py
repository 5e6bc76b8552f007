"""Dependency-injection containers (installed as ``llmrt.containers``)."""

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
