"""Continuous batching over the runtime: ``LLM`` (``llm``), the engine, its scheduler, block
pool with prefix hashing, and requests.

May import the containers, the recipe, the runtime core and everything below; never
``vllm``, ``server``, ``cli`` or ``benchmarks``.
"""
