"""One name per idea: no two public classes of the production packages share a name.

A reader who meets ``Intake`` or ``Events`` should not have to ask which of two it is; the
exceptions are the domain errors (``UnknownChannelError`` at a shuffler and at the analyzer
is the same refusal, raised by each party of its own requests).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "encoder_client", "runtime", "shuffler", "analyzer", "services")


def public_classes() -> dict[str, list[str]]:
    """Each public module-level class name and the modules that define one by that name."""
    found: dict[str, list[str]] = defaultdict(list)
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    found[node.name].append(str(path.relative_to(ROOT)))
    return found


def test_public_class_names_are_unique_outside_domain_errors() -> None:
    classes = public_classes()
    assert len(classes) > 100  # the scan found the tree
    shared = {
        name: modules
        for name, modules in classes.items()
        if len(modules) > 1 and not name.endswith("Error")
    }
    assert not shared, f"one name, several classes: {shared}"
