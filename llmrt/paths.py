"""Where llmrt keeps files between runs: one cache directory for every layer.

Cross-cutting (the weights cache, the kernel build and compiled steps all live under it), so
it sits beside ``errors`` and imports nothing of llmrt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CACHE_DIR_ENV = "LLMRT_CACHE_DIR"


def default_cache_dir() -> Path:
    """`$LLMRT_CACHE_DIR`, else the user cache dir for llmrt by platform convention."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    home = Path.home()
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA")
        return (Path(base) if base else home / "AppData" / "Local") / "llmrt" / "Cache"
    if sys.platform == "darwin":
        return home / "Library" / "Caches" / "llmrt"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else home / ".cache") / "llmrt"
