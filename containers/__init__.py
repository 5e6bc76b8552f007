"""Dependency-injection containers (installed as ``llmrt.containers``)."""

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
    "DeviceContainer",
    "LaneContainer",
    "ModelContainer",
    "RuntimeContainer",
    "build_lane_group",
    "build_lanes",
    "close_runtime",
    "start_runtime",
]
