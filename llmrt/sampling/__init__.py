"""Sampling: the request-level ``SamplingParams`` (``params``) and the batched token sampler
with seeds, penalties, top-k/top-p/min-p and log-probabilities (``sampler``).

May import only ``errors``.
"""
