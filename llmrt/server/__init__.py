"""``llmrt serve``: an OpenAI-compatible HTTP server over one continuous-batching engine.

May import ``serving`` and everything below it; never ``cli``, ``benchmarks`` or ``vllm``.
"""
