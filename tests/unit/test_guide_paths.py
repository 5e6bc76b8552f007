"""Every repository path the model-author guide names exists (a moved file breaks this test,
not a reader's search)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "writing-a-family.md"
#: A backquoted path with a directory and a file extension, e.g. `llmrt/families/parts.py`.
PATH = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|cpp|h|md|toml|yaml))`")


def test_every_path_in_the_guide_exists() -> None:
    named = set(PATH.findall(GUIDE.read_text()))
    assert "llmrt/kernels/csrc/decode_layer.cpp" in named  # the pattern finds paths
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"{GUIDE.name} names paths that do not exist: {missing}"


def test_the_guide_names_no_bare_llmrt_module() -> None:
    """A module is named by its path from the repository root (``llmrt/families/parts.py``),
    never bare (``parts.py``), which a reader outside the tree cannot find."""
    bare = re.findall(r"`([\w]+\.(?:py|cpp))`", GUIDE.read_text())
    assert not bare, f"{GUIDE.name} names modules without their path: {sorted(set(bare))}"
