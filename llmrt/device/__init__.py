"""The device port (``base``) and its backends: torch (``torch``) and Tenstorrent ttnn
(``ttnn``), with host facts they read (``cpu_features``, ``host_memory``, ``huge_pages``).

May import only ``errors``: the runtime, families and recipes build on it.
"""

from llmrt.device.base import Device, DeviceKind, DeviceStats, DeviceTensor, Event, Trace
from llmrt.device.identity import IdentitySet
from llmrt.device.torch import TorchDevice, TorchEvent, TorchTrace

__all__ = [
    "Device",
    "DeviceKind",
    "DeviceStats",
    "DeviceTensor",
    "Event",
    "IdentitySet",
    "TorchDevice",
    "TorchEvent",
    "TorchTrace",
    "Trace",
]
