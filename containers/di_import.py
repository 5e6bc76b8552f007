"""dependency_injector, imported without probing for the web frameworks it integrates with.

Why: importing ``dependency_injector.containers`` imports FastAPI (its wiring's ``Depends``
markers), pydantic and pydantic-settings (``Configuration.from_pydantic``), werkzeug
(Flask's request scope) and Starlette (its ``Request`` marker, which also imports anyio:
~30 ms at load 12 on 2 cores) whenever they are installed; FastAPI is, for ``llmrt serve``. That
was ~0.6-0.9 s of every ``llmrt`` process here, a third of a one-shot ``llmrt generate``.
llmrt uses none of those integrations (containers are built from recipes; the server uses
FastAPI's own ``Depends``), so for that one import the probes are answered "not installed",
and the names are released right after: a later ``import fastapi`` loads it as usual.
Importing this module does it (``containers/__init__`` imports it before anything else).
"""

from __future__ import annotations

import importlib
import sys

#: Optional packages dependency_injector probes for at import.
PROBED = ("fastapi", "fast_depends", "flask", "werkzeug", "pydantic_settings", "starlette")


def import_dependency_injector() -> None:
    """Import ``dependency_injector.containers`` and ``.providers`` (once per process)."""
    if "dependency_injector.containers" in sys.modules:
        return
    hidden = [name for name in PROBED if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # import raises ImportError
    try:
        importlib.import_module("dependency_injector.containers")
        importlib.import_module("dependency_injector.providers")
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


import_dependency_injector()
