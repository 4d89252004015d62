"""Benchmarks write docs/benchmarks.md only when given ``--write``.

Every script that records a section does it through ``benchmarks/_report.write_section``, whose
``write`` argument is the script's ``--write`` switch (``add_write`` or ``command_line``); no
script writes the file any other way.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _called(tree: ast.Module, name: str) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
    ]


def test_every_section_writer_takes_write() -> None:
    problems = []
    for script in sorted(BENCHMARKS.glob("*.py")):
        if script.name == "_report.py":
            continue
        tree = ast.parse(script.read_text())
        writes = _called(tree, "write_section")
        if any(isinstance(node, ast.Name) and node.id == "DOC" for node in ast.walk(tree)):
            problems.append(f"{script.name}: uses docs/benchmarks.md's path itself")
        if not writes:
            continue
        if not (_called(tree, "add_write") or _called(tree, "command_line")):
            problems.append(f"{script.name}: records a section but takes no --write")
        for call in writes:
            switch = [*call.args[2:], *(k.value for k in call.keywords if k.arg == "write")]
            source = ast.unparse(switch[0]) if switch else ""
            if "write" not in source:
                problems.append(f"{script.name}:{call.lineno}: write_section without --write")
    assert not problems, "\n".join(problems)


def test_write_section_leaves_the_file_alone_without_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    _report = importlib.import_module("_report")

    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nIntro.\n\n## A\n\nold a\n\n## B\n\nold b\n")
    monkeypatch.setattr(_report, "DOC", doc)
    before = doc.read_text()
    _report.write_section("## A", "new a", write=False)
    assert doc.read_text() == before
    assert "--write" in capsys.readouterr().err
    _report.write_section("## A", "new a", write=True)
    assert doc.read_text() == "# Benchmarks\n\nIntro.\n\n## A\n\nnew a\n\n## B\n\nold b\n"
    sys.modules.pop("_report", None)
