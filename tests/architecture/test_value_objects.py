"""Value objects with more than four fields are built by keyword (docs/architecture.md), in every
package, test and benchmark: a positional call to a wide dataclass or NamedTuple silently swaps
two fields of the same type when the class changes.

A call that only unpacks a sequence (``PartHeader(*row)``, a database row in its selected
columns' order) is allowed. The check resolves each call's class through the file's own
definitions and its imports (``from x import Name`` and ``module.Name``), following re-exports
of package ``__init__``s.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = (
    "common",
    "encoder_client",
    "runtime",
    "shuffler",
    "analyzer",
    "services",
    "tests",
    "benchmarks",
    "deploy",
)
#: Fields above which a value object is built by keyword.
MOST_POSITIONAL_FIELDS = 4


@dataclass
class _Tree:
    """Every parsed source file, and the wide value objects defined at their top level."""

    files: dict[Path, ast.Module] = field(default_factory=dict)
    wide: set[tuple[Path, str]] = field(default_factory=set)

    def module_file(self, dotted: str) -> Path | None:
        base = ROOT.joinpath(*dotted.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate in self.files:
                return candidate
        return None

    def definition(self, path: Path, name: str, depth: int = 0) -> tuple[Path, str] | None:
        """Where ``name`` as seen from ``path`` is defined, if it is a wide value object."""
        if (path, name) in self.wide:
            return path, name
        if depth > 4:
            return None
        for node in self.files[path].body:
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            if any(alias.name == name for alias in node.names):
                source = self.module_file(node.module)
                return source and self.definition(source, name, depth + 1)
        return None


def _is_value_object(node: ast.ClassDef) -> bool:
    decorated = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
    bases = [ast.unparse(b) for b in node.bases]
    return "NamedTuple" in bases or (decorated and all(b.startswith("Generic") for b in bases))


def _fields(node: ast.ClassDef) -> int:
    return sum(
        1
        for statement in node.body
        if isinstance(statement, ast.AnnAssign) and "ClassVar" not in ast.unparse(statement)
    )


def _tree() -> _Tree:
    tree = _Tree()
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree.files[path] = module = ast.parse(path.read_text(), str(path))
            classes = [node for node in module.body if isinstance(node, ast.ClassDef)]
            for node in classes:
                if _is_value_object(node) and _fields(node) > MOST_POSITIONAL_FIELDS:
                    tree.wide.add((path, node.name))
    return tree


def _names(tree: _Tree, path: Path) -> tuple[dict[str, tuple[Path, str]], dict[str, Path]]:
    """The wide classes a file can name directly, and the modules it names."""
    classes, modules = {}, {}
    for node in ast.walk(tree.files[path]):
        if isinstance(node, ast.ImportFrom) and node.module:
            source = tree.module_file(node.module)
            for alias in node.names:
                found = source and tree.definition(source, alias.name)
                if found:
                    classes[alias.asname or alias.name] = found
                submodule = tree.module_file(f"{node.module}.{alias.name}")
                if submodule:
                    modules[alias.asname or alias.name] = submodule
        elif isinstance(node, ast.Import):
            for alias in node.names:
                module = tree.module_file(alias.name)
                if module:
                    modules[alias.asname or alias.name.rsplit(".", 1)[-1]] = module
    classes |= {name: (p, name) for p, name in tree.wide if p == path}
    return classes, modules


def _positional_calls(tree: _Tree, path: Path) -> list[str]:
    classes, modules = _names(tree, path)
    found = []
    for node in ast.walk(tree.files[path]):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        if all(isinstance(arg, ast.Starred) for arg in node.args):
            continue  # a row unpacked in its columns' order (``PartHeader(*row)``)
        target = None
        if isinstance(node.func, ast.Name):
            target = classes.get(node.func.id)
        elif isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
            module = modules.get(node.func.value.id)
            target = module and tree.definition(module, node.func.attr)
        if target:
            where = path.relative_to(ROOT)
            found.append(f"{where}:{node.lineno}: {target[1]} with {len(node.args)} positional")
    return found


def test_wide_value_objects_are_built_by_keyword() -> None:
    tree = _tree()
    assert len(tree.wide) > 20  # the check sees the value objects it is about
    offenders = [call for path in tree.files for call in _positional_calls(tree, path)]
    assert not offenders, "\n".join(offenders)
