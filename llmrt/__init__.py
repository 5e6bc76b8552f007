"""llmrt: a declarative LLM inference runtime.

``from llmrt import LLM, SamplingParams`` is the offline API; recipes, containers
and the runtime modules underneath are importable for model authors and tests.
"""

from llmrt.sampling.params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> object:
    # The serving layer pulls in the whole runtime; import it only when asked for.
    if name in ("LLM", "RequestOutput"):
        from llmrt.serving import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'llmrt' has no attribute {name!r}")
