"""The package's modules import each other without a circle (docs/architecture.md, rules
of the house): every import counts, also those only for type checking or inside a
function, since each says which module knows which."""

from __future__ import annotations

import ast
from pathlib import Path

import layerpy

SRC = Path(layerpy.__file__).resolve().parent
TESTS = Path(__file__).resolve().parent.parent


def module_name(path: Path, src: Path) -> str:
    parts = path.relative_to(src.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(src: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a name imported from a package is the
    submodule of that name when there is one, else the package's ``__init__``)."""
    modules = {module_name(path, src): path for path in src.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    found.add(submodule if submodule in modules else node.module)
        graph[name] = {module for module in found if module in modules and module != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            part = []
            while (top := stack.pop()) != module:
                part.append(top)
            if part:
                found.append(sorted([module, *part]))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_import_circle() -> None:
    assert circles(imports(SRC)) == []


def test_a_circle_is_seen(tmp_path: Path) -> None:
    """As stats.py once closed one through the lifecycle, for type checking only."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "stats.py").write_text("from typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    from pkg.lifecycle import L\n")  # fmt: skip
    (package / "lifecycle.py").write_text("def f():\n    from pkg import stats\n")
    assert circles(imports(package)) == [["pkg.lifecycle", "pkg.stats"]]


def test_no_two_test_modules_share_a_name() -> None:
    """pytest imports test modules by their base name (no packages under tests/): two of one
    name in different folders stop the whole suite at collection."""
    names = [path.name for path in TESTS.rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
