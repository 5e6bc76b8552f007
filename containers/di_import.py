"""dependency_injector, imported without probing for the web frameworks it integrates with.

Why: importing ``dependency_injector.containers`` imports FastAPI (its wiring's ``Depends``
markers), pydantic-settings or else pydantic (``Configuration.from_pydantic``), werkzeug
(Flask's request scope) and Starlette (its ``Request`` marker, which also imports anyio:
~30 ms at load 12 on 2 cores) whenever they are installed; FastAPI is, for ``llmrt serve``,
and so is pydantic with it. That was ~0.6-0.9 s of every ``llmrt`` process here, a third of a
one-shot ``llmrt generate``; pydantic alone was another ~0.1 s and 2.5 MB resident.
llmrt uses none of those integrations (containers are built from recipes; the server uses
FastAPI's own ``Depends``), so for that one import the probes are answered "not installed"
by a finder placed first on ``sys.meta_path`` (not by ``None`` in ``sys.modules``: the
Cython-compiled ``providers`` takes a ``None`` entry for the module itself), which is removed
right after: a later ``import fastapi`` or ``import pydantic`` loads it as usual. A probed
package imported before is left alone (it is the real module). Importing this module does it
(``containers/__init__`` imports it before anything else).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

#: Optional packages dependency_injector probes for at import.
PROBED = (
    "fastapi",
    "fast_depends",
    "flask",
    "werkzeug",
    "pydantic_settings",
    "pydantic",
    "starlette",
)


class _Hidden(importlib.abc.MetaPathFinder):
    """Answers "not installed" for ``names`` (and their submodules)."""

    def __init__(self, *, names: Sequence[str]) -> None:
        self.names = frozenset(names)

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def import_dependency_injector() -> None:
    """Import ``dependency_injector.containers`` and ``.providers`` (once per process)."""
    if "dependency_injector.containers" in sys.modules:
        return
    finder = _Hidden(names=[name for name in PROBED if name not in sys.modules])
    sys.meta_path.insert(0, finder)
    try:
        importlib.import_module("dependency_injector.containers")
        importlib.import_module("dependency_injector.providers")
    finally:
        sys.meta_path.remove(finder)


import_dependency_injector()
