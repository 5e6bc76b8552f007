"""Test helpers shipped with llmrt: a fault-injecting device, the ttnn fakes, parity helpers
and the pytest plugin (``plugin``).

Beside ``benchmarks``, below ``cli``: may import every package except those two.
"""

from llmrt.testing.faulty_device import OPERATIONS, DeviceCall, FaultyDevice, InjectedFault

__all__ = ["OPERATIONS", "DeviceCall", "FaultyDevice", "InjectedFault"]
