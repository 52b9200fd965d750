"""The documentation's relative links point at files that exist."""

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
