"""The vLLM adapter: the model class vLLM's Tenstorrent plugin drives (``adapter``), its
recipe resolution from a Hub architecture (``recipe``), sampling-parameter translation
(``sampling``) and the ``vllm.general_plugins`` entry point (``registration``).

May import the containers, the recipe, the runtime core and everything below them; never
``serving``, ``server``, ``cli`` or ``benchmarks``.
"""
