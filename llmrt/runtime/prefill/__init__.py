"""Prefill: request planning (prefix reuse, chunks, padded or ragged waves), inputs, traces,
sampling and result collection, behind ``PrefillRuntime`` (``runtime``).

Part of the runtime core; may import what ``llmrt.runtime`` may, and the runtime's own
modules.
"""
