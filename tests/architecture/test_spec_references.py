"""Every reference a reader follows resolves inside the repository.

Docstrings, comments and docs cite pages of ``docs/`` (or README.md), never a design text
outside the repository (the upper-case spec names, or a path into ``../shared``), which readers
of the repository cannot open; and every ``docs/<page>.md, "<section>"`` names a page that
exists and a heading (or a bold paragraph label) on it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Production packages, then the other Python the repository ships.
PYTHON = ("common", "encoder_client", "runtime", "shuffler", "analyzer", "services")
OTHER_PYTHON = ("tests", "benchmarks")
#: Names and paths of texts outside the repository (upper case: ``docs/protocol.md`` is ours).
OUTSIDE = re.compile(
    r"\b(?:PROTOCOL|MECHANISMS|ACCOUNTING|ARCHITECTURE|STYLE|CLIENTS)\.md\b"
    r"|\.\./shared\b|\bshared/(?:design|papers)\b"
)
#: ``docs/<page>.md`` and, when one follows, the quoted section.
CITATION = re.compile(r"docs/([A-Za-z0-9_-]+)\.md(?:,\s*\"([^\"]+)\")?")
#: A line break with what continues a comment or a docstring on the next line.
WRAP = re.compile(r"\n\s*(?:#:?\s*)?")
THIS = Path(__file__).resolve()


def sources() -> Iterator[Path]:
    """Production .py files, the repository's other Python, docs/*.md, README.md and deploy/
    configuration."""
    for folder in (*PYTHON, *OTHER_PYTHON):
        yield from (p for p in sorted((ROOT / folder).rglob("*.py")) if p.resolve() != THIS)
    yield from sorted((ROOT / "docs").glob("*.md"))
    yield ROOT / "README.md"
    for suffix in ("*.yml", "*.yaml", "*.cfg", "*.conf", "*.sh", "*.py", "Dockerfile*"):
        yield from sorted((ROOT / "deploy").rglob(suffix))


def test_no_reference_outside_the_repository() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {match.group()}"
        for path in sources()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for match in OUTSIDE.finditer(line)
    ]
    assert not found, (
        "references to design texts outside the repository (cite docs/*.md instead):\n"
        + "\n".join(found)
    )


def test_the_sources_are_scanned() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in sources()}
    assert {"common/wire.py", "docs/protocol.md", "README.md"} <= names


@cache
def anchors(page: str) -> tuple[str, ...] | None:
    """The headings and bold paragraph labels of docs/<page>.md, or None if it does not exist."""
    path = ROOT / "docs" / f"{page}.md"
    if not path.exists():
        return None
    text = path.read_text()
    headings = re.findall(r"^#+\s*(.+?)\s*$", text, re.MULTILINE)
    labels = re.findall(r"\*\*(.+?)\*\*", text)
    return tuple(headings + labels)


def test_cited_pages_and_sections_exist() -> None:
    broken = []
    for path in sources():
        flat = WRAP.sub(" ", path.read_text())
        for match in CITATION.finditer(flat):
            page, section = match.groups()
            found = anchors(page)
            if found is None:
                broken.append(f"{path.relative_to(ROOT)}: docs/{page}.md does not exist")
            elif section is not None and not any(a.startswith(section) for a in found):
                broken.append(f'{path.relative_to(ROOT)}: docs/{page}.md has no "{section}"')
    assert not broken, "\n".join(broken)
