"""Model families: checkpoints -> torch models over a paged KV cache (see docs/contracts.md).

The model protocol (``base``), the parts decoder (``parts``, ``decoder``, ``decoder_layers``),
the fused CPU decode step (``fused_decode``), the registry and one module per family.

May import ``kernels``, ``device``, ``errors``, ``paths``; never the runtime core, the
recipe or the weights loader (which reads the registry).
"""
