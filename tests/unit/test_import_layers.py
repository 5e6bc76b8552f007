"""The package map holds: no import cycle, no import from a lower layer to a higher one.

The layers are restated here from CONTRIBUTING.md's package map (top first; packages that
share a row are independent of each other). Every ``import`` in the source counts,
including those inside functions and under ``TYPE_CHECKING``: a deferred import still ties
the two modules together.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterable, Mapping

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: Top to bottom. A package may import the packages of lower rows only.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("benchmarks", "testing"),
    ("server",),
    ("serving", "vllm"),
    ("containers",),
    ("recipe",),
    ("runtime",),
    ("weights",),
    ("families",),
    ("kernels",),
    ("device", "lifecycle", "sampling"),
)
#: Cross-cutting leaf modules every layer may import; they import nothing of llmrt.
SHARED = ("errors", "paths")
#: The public facade (``llmrt.LLM``, ``llmrt.SamplingParams``): it may import anything,
#: nothing inside llmrt imports it.
FACADE = "llmrt"

Graph = Mapping[str, frozenset[str]]


def module_files() -> dict[str, pathlib.Path]:
    """Every llmrt module by dotted name; ``containers/`` installs as ``llmrt.containers``."""
    files = {}
    roots = ((ROOT / "llmrt", ("llmrt",)), (ROOT / "containers", ("llmrt", "containers")))
    for base, prefix in roots:
        for path in base.rglob("*.py"):
            parts = (*prefix, *path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


def _imported(module: str, path: pathlib.Path, known: Iterable[str]) -> set[str]:
    names = set(known)
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join([*base, *([node.module] if node.module else [])])
            else:
                origin = node.module or ""
            targets = [origin, *(f"{origin}.{alias.name}" for alias in node.names)]
        for target in targets:
            # ``import a.b.c`` imports a.b.c; a name from a module is that module.
            while target and target not in names:
                target = target.rpartition(".")[0]
            if target and target != module and not module.startswith(target + "."):
                found.add(target)
    return found


def import_graph() -> dict[str, frozenset[str]]:
    """Module -> the llmrt modules it imports (a package's own parents excluded: Python
    initializes them before any submodule, whatever the submodule says)."""
    files = module_files()
    return {m: frozenset(_imported(m, p, files)) for m, p in files.items()}


def cycles(graph: Graph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_violations(graph: Graph) -> list[str]:
    """Every import that goes up a layer, across a row, into the facade, or out of a shared
    leaf; and every top-level package or module the map does not place."""
    row = {package: i for i, packages in enumerate(LAYERS) for package in packages}
    problems = []
    for module in sorted(graph):
        package = package_of(module)
        if module != FACADE and package not in row and package not in SHARED:
            problems.append(f"{module}: top-level package or module not in the map")
    for module, imports in sorted(graph.items()):
        if module == FACADE:
            continue
        source = package_of(module)
        for target in sorted(imports):
            dest = package_of(target)
            if target == FACADE:
                problems.append(f"{module} imports the facade {FACADE}")
            elif source in SHARED:
                problems.append(f"{module} (shared leaf) imports {target}")
            elif dest in SHARED or dest == source or source not in row or dest not in row:
                continue
            elif row[dest] < row[source]:
                problems.append(f"{module} ({source}) imports {target} from a higher layer")
            elif row[dest] == row[source]:
                problems.append(f"{module} ({source}) imports {target} from its own row")
    return problems


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_no_upward_or_sideways_imports() -> None:
    assert layer_violations(import_graph()) == []


def test_top_level_is_packages_plus_shared_leaves() -> None:
    modules = {p.stem for p in (ROOT / "llmrt").glob("*.py")}
    assert modules == {"__init__", *SHARED}


def test_every_package_documents_its_place() -> None:
    """Each package's docstring says what lives there and what it may import."""
    for package in {p for row in LAYERS for p in row} - {"containers"}:
        init = ROOT / "llmrt" / package / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        assert "import" in doc, f"llmrt/{package}/__init__.py: say what it may import"
    doc = ast.get_docstring(ast.parse((ROOT / "containers" / "__init__.py").read_text()))
    assert doc is not None and "import" in doc


def test_the_map_matches_contributing() -> None:
    """CONTRIBUTING.md's package map names every package of the layers, in the same order."""
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    section = text[text.index("## Package map") :]
    paths = [("containers/" if p == "containers" else f"llmrt/{p}/") for row in LAYERS for p in row]
    positions = [section.find(f"`{path}`") for path in paths]
    assert -1 not in positions, "every package has a paragraph in the map"
    assert positions == sorted(positions), "the map lists packages top layer first"


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"llmrt.runtime.decode": frozenset({"llmrt.recipe.schema"})}, "from a higher layer"),
        ({"llmrt.serving.llm": frozenset({"llmrt.vllm.adapter"})}, "from its own row"),
        ({"llmrt.errors": frozenset({"llmrt.device.base"})}, "(shared leaf) imports"),
        ({"llmrt.device.base": frozenset({"llmrt"})}, "imports the facade"),
        ({"llmrt.gadgets": frozenset()}, "not in the map"),
    ],
)
def test_checker_reports(graph: Graph, expected: str) -> None:
    """The checks above can fail: each kind of violation is reported."""
    assert any(expected in problem for problem in layer_violations(graph))


def test_checker_finds_a_deferred_cycle(tmp_path: pathlib.Path) -> None:
    """A cycle closed by an import inside a function is still a cycle."""
    (tmp_path / "a.py").write_text("from llmrt.x.b import f\n")
    (tmp_path / "b.py").write_text("def f():\n    from llmrt.x.a import g\n")
    known = {"llmrt.x.a", "llmrt.x.b"}
    graph = {
        "llmrt.x.a": frozenset(_imported("llmrt.x.a", tmp_path / "a.py", known)),
        "llmrt.x.b": frozenset(_imported("llmrt.x.b", tmp_path / "b.py", known)),
    }
    assert cycles(graph) == [["llmrt.x.a", "llmrt.x.b"]]
    assert cycles({"llmrt.x.a": frozenset({"llmrt.x.b"}), "llmrt.x.b": frozenset()}) == []
