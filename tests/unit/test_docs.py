"""The documentation's relative links point at files that exist."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
DOCS = sorted(
    path
    for path in [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("*/README.md")]
    if not path.relative_to(ROOT).parts[0].startswith(".")  # .pytest_cache, .venv
)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE = re.compile(r"(`+).+?\1", re.S)
INLINE = re.compile(r"\]\(\s*(?:<([^<>\n]+)>|([^()\s]+))(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def links(text: str) -> list[str]:
    """Link targets outside code blocks and code spans, in order."""
    text = CODE.sub("", FENCE.sub("", text))
    inline = [angle or bare for angle, bare in INLINE.findall(text)]
    return inline + REFERENCE.findall(text)


def relative_targets(text: str) -> list[str]:
    """File paths of the relative links: no URLs, no bare #anchors, fragments dropped."""
    return [
        target.split("#", 1)[0]
        for target in links(text)
        if not SCHEME.match(target) and not target.startswith("#")
    ]


def test_link_parsing() -> None:
    text = (
        'See [a](docs/a.md), [b](b.md#part "title"), [web](https://x.org/y.md), [top](#top),\n'
        "[mail](mailto:x@y), <[angle](<c d.md>)>, `[not](code.md)`, and [ref][r].\n"
        "```\n[not](fenced.md)\n```\n"
        "[r]: ref/target.md\n"
    )
    assert relative_targets(text) == ["docs/a.md", "b.md", "c d.md", "ref/target.md"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_exist(doc: Path) -> None:
    missing = [
        target
        for target in relative_targets(doc.read_text(encoding="utf-8"))
        if target and not (doc.parent / target).exists()
    ]
    assert missing == [], f"{doc.relative_to(ROOT)} links to missing files"


def test_readme_and_docs_are_covered() -> None:
    names = {str(path.relative_to(ROOT)) for path in DOCS}
    assert {"README.md", "docs/api.md", "minos/README.md"} <= names


# -- docs/architecture.md's "Who writes what", held against the code ---------------------

SRC = ROOT / "src" / "layerpy"
HOLDERS = {  # what the code calls each holder of state (a name, an attribute, an app key)
    "nodes/store.py": {"nodes", "store", "NODES"},
    "nodes/feed.py": {"feed"},
    "lifecycle/": {"lifecycle", "power", "POWER"},
    "catalog.py": {"catalog", "CATALOG"},
    "boot.py": {"booter", "policy", "BOOTER"},
    "cluster/file.py": {"shared"},
}
TICKED = re.compile(r"`([^`]+)`")


def writers_table() -> list[tuple[str, str, set[str], list[str]]]:
    """(state, kept in, written only by, methods) per row of the table."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Who writes what", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]  # no header
    table = []
    for row in rows:
        state, kept, writers, through, _ = (cell.strip() for cell in row.strip("|").split("|"))
        paths = {path for path in TICKED.findall(writers) if path.endswith((".py", "/"))}
        table.append((state, TICKED.findall(kept)[0], paths, TICKED.findall(through)))
    return table


def holder_of(expression: ast.expr) -> str | None:
    """The last name of what a method is looked up on: `self.nodes` -> nodes,
    `request.app[NODES]` -> NODES."""
    if isinstance(expression, ast.Subscript):
        expression = expression.slice
    if isinstance(expression, ast.Name):
        return expression.id
    if isinstance(expression, ast.Attribute):
        return expression.attr
    return None


def naming(methods: list[str], holder: str, tree: dict[str, ast.Module]) -> set[str]:
    """The modules that look up one of `methods` on the holder (a call, or a bound method
    handed on)."""
    names = HOLDERS[holder]
    return {
        module
        for module, parsed in tree.items()
        for node in ast.walk(parsed)
        if isinstance(node, ast.Attribute)
        and node.attr in methods
        and holder_of(node.value) in names
    }


def defines(holder: str, methods: list[str]) -> set[str]:
    """Which of `methods` the holder (a file, or a folder) defines."""
    files = sorted((SRC / holder).glob("*.py")) if holder.endswith("/") else [SRC / holder]
    return {
        node.name
        for path in files
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in methods
    }


def within(module: str, paths: set[str]) -> bool:
    return any(module == path or (path.endswith("/") and module.startswith(path)) for path in paths)


def test_who_writes_what_is_what_the_code_does() -> None:
    tree = {
        str(path.relative_to(SRC)): ast.parse(path.read_text(encoding="utf-8"))
        for path in SRC.rglob("*.py")
    }
    table = writers_table()
    assert len(table) >= 10, "the table of docs/architecture.md was not found whole"
    for state, kept, writers, methods in table:
        for path in {kept, *writers}:
            assert (SRC / path).exists(), f"{state}: no {path} in src/layerpy"
        if not methods:
            continue
        assert defines(kept, methods) == set(methods), f"{state}: {kept} lacks a method"
        others = {m for m in naming(methods, kept, tree) if not within(m, {kept, *writers})}
        assert not others, f"{state}: also written by {sorted(others)}, not in the table"


def test_the_writers_check_sees_a_reach_through() -> None:
    """A service marking a boot phase on the store itself, as http.py once did, is seen."""
    reach = ast.parse("async def minos_file(request):\n    policy.nodes.mark(node, phase)\n")
    assert naming(["mark"], "nodes/store.py", {"services/http.py": reach}) == {"services/http.py"}


def test_no_boot_service_holds_the_node_store() -> None:
    """As docs/architecture.md says: DHCP, TFTP and boot HTTP know the Booter only."""
    for name in ("dhcp.py", "tftp.py", "http.py"):
        tree = ast.parse((SRC / "services" / name).read_text(encoding="utf-8"))
        held = {
            node.attr if isinstance(node, ast.Attribute) else node.id
            for node in ast.walk(tree)
            if (isinstance(node, ast.Attribute) and node.attr == "nodes")
            or (isinstance(node, ast.Name) and node.id in ("NodeStore", "NODES"))
        }
        assert not held, f"services/{name} reaches the node store: {sorted(held)}"
