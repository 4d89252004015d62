"""The package rules of docs/architecture.md, checked on the source itself.

* ``common`` imports nothing of ours; ``encoder_client`` only ``common``; ``shuffler`` and
  ``analyzer`` only ``common`` and ``runtime`` and never each other; ``runtime``
  and ``services.tools`` never import a service (only ``services.cli`` starts them).
* No production function is longer than :data:`MAX_LINES` lines (docs/architecture.md,
  "Conventions the tests check": short enough to read at once).
* A channel's mechanism carries its parameters (:func:`common.mechanisms.build`): outside
  ``common/mechanisms`` no code parses them again nor passes them to a mechanism, nor holds a
  mechanism of unknown types (``Mechanism[Any, Any]``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "encoder_client", "runtime", "shuffler", "analyzer", "services")
MAX_LINES = 60
#: What each package may import of ours (prefix match on the dotted module name).
ALLOWED: dict[str, tuple[str, ...]] = {
    "services": ("services",),
    "common": ("common",),
    "encoder_client": ("common", "encoder_client"),
    "shuffler": ("common", "runtime", "shuffler"),
    "analyzer": ("common", "runtime", "analyzer"),
    "runtime": ("common", "runtime"),
    "services.tools": ("common", "encoder_client", "runtime", "services.tools"),
    "services.cli": PACKAGES,
}


def production_files() -> Iterator[Path]:
    """Every Python file of the shipped packages (migrations are generated scripts)."""
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" not in path.parts:
                yield path


def module_name(path: Path) -> str:
    """``services/cli/demo.py`` → ``services.cli.demo``."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def our_imports(tree: ast.Module) -> Iterator[str]:
    """Dotted names of our packages that a module imports, lazily or not."""
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        yield from (n for n in names if n.split(".")[0] in PACKAGES)


def rule_for(module: str) -> tuple[str, ...]:
    """The allowed imports of the most specific rule that covers ``module``."""
    best = max((key for key in ALLOWED if _within(module, key)), key=len)
    return ALLOWED[best]


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def function_lengths() -> Iterator[tuple[str, int]]:
    """``(path:function, lines)`` for every function and method of production code, from its
    ``def`` line to its last line (decorators, such as a command's options, are not counted)."""
    for path in production_files():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                where = f"{path.relative_to(ROOT)}:{node.name}"
                yield where, node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("path", list(production_files()), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_package_rules(path: Path) -> None:
    module = module_name(path)
    allowed = rule_for(module)
    tree = ast.parse(path.read_text(), str(path))
    wrong = sorted({n for n in our_imports(tree) if not any(_within(n, a) for a in allowed)})
    assert not wrong, f"{module} may import only {allowed}, imports {wrong}"


def test_no_production_function_is_too_long() -> None:
    long = sorted(
        (f"{where} ({lines} lines)" for where, lines in function_lengths() if lines > MAX_LINES)
    )
    assert not long, f"functions over {MAX_LINES} lines: {long}"


def test_the_rules_catch_a_violation() -> None:
    tree = ast.parse("from shuffler.app import create_asgi\nimport analyzer.core\n")
    assert sorted(our_imports(tree)) == ["analyzer.core", "shuffler.app"]
    assert rule_for("services.tools.demo") == ALLOWED["services.tools"]
    assert not any(_within("shuffler.app", a) for a in rule_for("analyzer.core"))


def _parses_parameters(tree: ast.Module) -> list[int]:
    """Lines that call a ``parse_params`` method."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "parse_params"
    ]


def test_only_the_mechanisms_package_handles_parameters() -> None:
    mechanisms = ROOT / "common" / "mechanisms"
    found = []
    for path in production_files():
        if mechanisms in path.parents:
            continue
        text = path.read_text()
        where = str(path.relative_to(ROOT))
        found += [f"{where}:{line}" for line in _parses_parameters(ast.parse(text, where))]
        found += [where] if "Mechanism[Any, Any]" in text else []
    assert not found, f"build the channel's mechanism once (common.mechanisms.build): {found}"
    assert _parses_parameters(ast.parse("get(name).parse_params(raw)\n")) == [1]
