"""Every shipped family, and every example package's family, fits one module of at most
``LIMIT`` lines of code (#39: a model author writes an architecture in one short module,
with no ``build`` override and no module replaced after the build; whatever more it needs
belongs in the parts catalogue or its declarations).

Lines of code: lines with a token other than a comment or a docstring (blank lines,
comments and docstrings, which say why, are free). llama.cpp's GGUF declarations live in
the weights layer's table (``llmrt/weights/gguf_architectures.py``), shared reads in
``hfparts`` and declared renames in ``renames``, so no family module carries them.
"""

from __future__ import annotations

import ast
import io
import tokenize
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 60
_SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _SKIPPED and token.type != tokenize.ENDMARKER:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def _family_modules() -> list[str]:
    """The shipped families' modules (the ``llmrt.families`` entry points outside the
    test-only fakes) and the example packages' modules."""
    shipped = {
        "llmrt/" + ep.value.split(":")[0].removeprefix("llmrt.").replace(".", "/") + ".py"
        for ep in entry_points(group="llmrt.families")
        if ep.value.startswith("llmrt.families.")
    }
    examples = {
        str(path.relative_to(ROOT)) for path in (ROOT / "docs" / "examples").glob("*/*/__init__.py")
    }
    return sorted(shipped | examples)


def test_the_count_skips_docstrings_comments_and_blank_lines() -> None:
    source = (
        '"""Doc\n\nstring."""\n\n# comment\nX = (\n    1,  # one\n)\n\n\n'
        'def f():\n    """Why."""\n    return X\n'
    )
    assert code_lines(source) == 5  # X = (, 1, ), def f, return X


def test_the_modules_are_found() -> None:
    modules = _family_modules()
    assert "llmrt/families/llama.py" in modules and "llmrt/families/qwen2_moe.py" in modules
    assert "docs/examples/llmrt-arcee/llmrt_arcee/__init__.py" in modules


@pytest.mark.parametrize("module", _family_modules())
def test_a_family_module_fits_the_limit(module: str) -> None:
    source = (ROOT / module).read_text(encoding="utf-8")
    count = code_lines(source)
    assert count <= LIMIT, f"{module}: {count} lines of code, over the limit of {LIMIT}"
    # Laid out as the formatter lays it out: no statements packed past it to fit the count.
    assert "fmt: skip" not in source and "fmt: off" not in source, module


def test_every_shipped_family_is_a_plain_decoder_family() -> None:
    """No shipped family overrides ``build`` (a ``DecoderFamily`` subclass would): each one is
    its parts and names, built by the one decoder."""
    from llmrt.families.decoder_family import DecoderFamily

    for ep in entry_points(group="llmrt.families"):
        if ep.value.startswith("llmrt.families."):
            assert type(ep.load()) is DecoderFamily, f"{ep.value} is not a plain DecoderFamily"
