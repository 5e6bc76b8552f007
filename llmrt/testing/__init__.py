"""Test helpers shipped with llmrt: a fault-injecting device."""

from llmrt.testing.faulty_device import OPERATIONS, DeviceCall, FaultyDevice, InjectedFault

__all__ = ["OPERATIONS", "DeviceCall", "FaultyDevice", "InjectedFault"]
