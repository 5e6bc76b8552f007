"""The device port (``base``) and its torch backend (``torch``)."""

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
