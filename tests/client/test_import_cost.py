"""``import encoder_client`` loads the device role only: no privacy accounting (scipy,
dp_accounting), no server stack, no numpy and no HTTP client until a ``Client`` needs them (a
guard by modules, not seconds; the time and memory are in docs/benchmarks.md, "SDK import").

The fast tier reads the source (the modules the SDK imports when it loads, and what they import
when they load); the system tier imports the SDK in a fresh interpreter and reads
``sys.modules``, which also sees what the third-party packages pull in.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("common", "encoder_client", "runtime", "shuffler", "analyzer", "services")
#: What a device never loads with the SDK: the accounting stack (and the mechanisms' privacy
#: and analyzer facets that import it), the servers' stack, numpy (LDP-SGD's encoder loads it
#: at its first report) and httpx (the first Client loads it).
FORBIDDEN = (
    "scipy",
    "dp_accounting",
    "common.accounting",
    "common.mechanisms.base",
    "numpy",
    "httpx",
    "fastapi",
    "starlette",
    "uvicorn",
    "sqlalchemy",
    "httptools",
)
#: The third-party packages the SDK's modules import when they load.
NEEDED = {"cryptography", "pydantic"}
#: Most modules after ``import encoder_client`` in a fresh interpreter (234 on Python 3.11; the
#: bound leaves room for another Python's standard library).
MAX_MODULES = 300


def _source(module: str) -> Path | None:
    """The file of one of our modules (None: a name inside a module, not a module)."""
    base = ROOT.joinpath(*module.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name | ast.Attribute) and "TYPE_CHECKING" in ast.unparse(test)


def _load_time_imports(tree: ast.AST) -> Iterator[str]:
    """Dotted names imported when the module loads: not inside a function, nor under
    ``if TYPE_CHECKING:``; ``from a import b`` yields ``a.b`` too (``b`` may be a module)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if _type_checking(node):
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, "production code imports absolutely"
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
        yield from _load_time_imports(node)


def _lazy(package: str) -> dict[str, str]:
    """The names a package resolves on first use (PEP 562: its ``_WHERE`` table), each with
    the module that defines it: taking one from the package loads that module."""
    path = _source(package)
    if path is None or path.name != "__init__.py":
        return {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "_WHERE":
            table = ast.literal_eval(node.value)
            return {k: v if "." in v else f"{package}.{v}" for k, v in table.items()}
    return {}


def _parents(name: str) -> Iterator[str]:
    parts = name.split(".")
    yield from (".".join(parts[:i]) for i in range(1, len(parts) + 1))


def device_role(start: str = "encoder_client") -> tuple[set[str], set[str]]:
    """Our modules ``import start`` loads, read from the source, and the top-level packages
    they import that are neither ours nor the standard library's."""
    ours: set[str] = set()
    others: set[str] = set()
    todo = [start]
    while todo:
        module = todo.pop()
        path = _source(module)
        if module in ours or path is None:
            continue
        ours.add(module)
        for name in _load_time_imports(ast.parse(path.read_text(), str(path))):
            root = name.split(".")[0]
            if root in OURS:
                package, _, attribute = name.rpartition(".")
                todo.extend(_parents(_lazy(package).get(attribute, name)))
            elif root not in sys.stdlib_module_names:
                others.add(root)
    return ours, others


def test_the_sdk_loads_no_accounting_server_or_numpy_module() -> None:
    ours, others = device_role()
    assert {"encoder_client._client", "common.mechanisms.device.rfrag"} <= ours  # it looked
    loaded = sorted(
        m for m in ours | others if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)
    )
    assert not loaded, f"import encoder_client would load {loaded}"
    assert others <= NEEDED, f"the SDK's modules import {sorted(others - NEEDED)} when they load"


def test_the_reading_sees_an_import_that_loads_with_the_module() -> None:
    tree = ast.parse(
        "import numpy\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import scipy\n"
        "try:\n    from common.accounting import certify\nexcept ImportError:\n    pass\n"
        "def later() -> None:\n    import httpx\n"
    )
    assert sorted(_load_time_imports(tree)) == [
        "common.accounting",
        "common.accounting.certify",
        "numpy",
        "typing",
        "typing.TYPE_CHECKING",
    ]
    # A name the package loads on first use brings its module in.
    assert _lazy("common.mechanisms")["Mechanism"] == "common.mechanisms.base"
    assert _lazy("common.accounting")["certify"] == "common.accounting.randomizers"


#: Imports the SDK, then runs every built-in mechanism's device facet as the SDK does at a
#: report (parameters, new state, one encoding, local privacy), LDP-SGD's encoder excepted
#: (numpy); prints the module count, and the forbidden packages loaded after each step.
PROBE = """
import sys
import encoder_client
from common.mechanisms import BUILT_IN_DEVICES, SystemSource, StateUpdate
forbidden = {forbidden!r}
def loaded():
    return sorted({{f for m in sys.modules for f in forbidden if m == f or m.startswith(f + ".")}})
print(len(sys.modules), *loaded())
examples = {{
    "krappor": ({{"k": 16, "eps": 2.0}}, 3),
    "rfrag": ({{"k": 16, "eps_b": 4.0, "eps_f": 2.0, "tau": 3}}, 3),
    "longitudinal": ({{"d": 8, "k": 2, "eps": 2.0}}, StateUpdate(1, True)),
    "zsum": ({{"d": 8, "eps": 1.0, "delta": 1e-8, "n": 100000}}, 3),
    "krr": ({{"k": 16, "eps": 2.0}}, 3),
    "ldp-sgd": ({{"dim": 4, "eps": 2.0}}, None),
}}
rng = SystemSource()
for device in BUILT_IN_DEVICES:
    raw, value = examples[device.name]
    params = device.parse_params(raw)
    device.local_privacy(params)
    if value is not None:
        device.encode(params, value, device.new_state(params, rng), rng, 3)
print(*[m for m in loaded() if m != "common.accounting"])
"""


@pytest.mark.system
def test_a_fresh_interpreter_loads_the_device_role_only() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(forbidden=FORBIDDEN)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    at_import, after_reports = done.stdout.splitlines()
    count, *heavy = at_import.split()
    assert not heavy, f"import encoder_client loads {heavy}"
    assert int(count) < MAX_MODULES, at_import
    # Reports on every built-in mechanism load at most the closed-form local ε of report
    # fragments (common.accounting.local and what it imports): never scipy or dp_accounting.
    assert not after_reports.split(), f"reporting loads {after_reports}"
