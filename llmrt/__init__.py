"""llmrt: a declarative LLM inference runtime.

``from llmrt import LLM, SamplingParams`` is the offline API; recipes, containers
and the runtime modules underneath are importable for model authors and tests.
"""

import contextlib
import os

from llmrt.sampling.params import SamplingParams

if os.environ.get("LLMRT_KERNELS_ISA"):
    # Cap torch's own kernels at the forced level before anything runs an op (a bad value
    # raises where the kernels load or a policy reads the level).
    from llmrt.device.cpu_features import pin_torch_isa
    from llmrt.errors import ConfigError

    with contextlib.suppress(ConfigError):
        pin_torch_isa()

__version__ = "0.1.0"

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> object:
    # The serving layer pulls in the whole runtime; import it only when asked for.
    if name in ("LLM", "RequestOutput"):
        from llmrt.serving import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'llmrt' has no attribute {name!r}")
