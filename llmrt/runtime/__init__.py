"""The Common LLM runtime core: what runs a built model on a device, lane by lane.

Prefill planning and execution (``prefill/``), decode staging (``decode``), eager program
compilation (``program_compiler``, ``compiled_step``, ``step_artifacts``), trace capture
and replay (``trace_compiler``), the executors (``execution``, ``model_executor``), warmup
coverage (``warmup``), paged KV ownership (``paged_kv_cache``), output reads
(``output_reader``), data-parallel lanes (``lane_group``), start-up phases (``startup``),
their frozen configs (``config``) and tensor release (``tensor_resources``).

May import: ``families`` (the model protocol in ``families.base``), ``weights``,
``kernels``, ``device``, ``lifecycle``, ``sampling``, ``errors``, ``paths``. Never the
recipe, the containers or anything above them: it takes plain frozen configs.
"""
