"""``llmrt bench``: workloads measured against a baseline run in the same process.

Modules: ``settings`` (validated CLI options), ``report`` (text/JSON output, ratios and
targets), ``timing`` (interleaved medians, percentiles, progress bars), ``sizing``
(recipes sized to a workload), ``prompts`` (deterministic token prompts), ``hf`` (the
Hugging Face transformers baseline on the same weights), ``serving`` (``mixed``,
``shared-prefix``), ``decode``, ``prefill``, ``lanes`` (helpers the step workloads share)
and ``plot`` (optional latency plot).

Beside ``testing``, below ``cli``: may import every package except those two.
"""
