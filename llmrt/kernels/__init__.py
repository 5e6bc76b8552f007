"""llmrt's compiled CPU kernels (``csrc/``, built by ``native``) and the weight formats they
run (``formats``).

May import ``device``, ``errors`` and ``paths`` only.
"""
