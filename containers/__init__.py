"""Dependency-injection containers (installed as ``llmrt.containers``)."""

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
