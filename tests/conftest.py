"""Shared fixtures (database URLs for SQLite and PostgreSQL) and the two test tiers.

Tiers: a test that starts a process, a container or a browser is marked ``system`` (every
test under ``tests/e2e``, ``tests/deploy``, ``tests/adversary`` and ``tests/faults`` is, by
its folder); an in-process test that takes more than ~2 s is marked ``slow``. ``make check``
runs the rest; ``make test`` runs everything. A test that starts a process without the
``system`` mark fails (:func:`_tier_guard`), so the fast tier stays in-process.

PostgreSQL is reached at ``ESA_TEST_POSTGRES`` (default ``127.0.0.1:5432``, user postgres,
trust auth). Each test gets a fresh database that is dropped afterwards. Under ``CI=true`` a
missing PostgreSQL is a failure, not a skip (docs/architecture.md, "Conventions the tests check").
"""

from __future__ import annotations

import multiprocessing.process
import os
import secrets
import subprocess
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

POSTGRES = os.environ.get("ESA_TEST_POSTGRES", "postgres@127.0.0.1:5432")


def _admin_connect() -> object:
    import psycopg

    user, _, hostport = POSTGRES.partition("@")
    host, _, port = hostport.partition(":")
    return psycopg.connect(
        host=host,
        port=int(port or 5432),
        user=user,
        dbname="postgres",
        autocommit=True,
        connect_timeout=3,
    )


def _admin_or_skip() -> Any:
    """An admin connection; a missing server fails under CI=true and skips elsewhere."""
    try:
        return _admin_connect()
    except Exception as error:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"PostgreSQL expected at {POSTGRES} under CI=true: {error}")
        pytest.skip(f"PostgreSQL not reachable at {POSTGRES}: {error}")


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database URL (dropped after the test)."""
    admin = _admin_or_skip()
    name = f"esa_test_{secrets.token_hex(6)}"
    admin.execute(f'CREATE DATABASE "{name}"')  # type: ignore[attr-defined]
    user, _, hostport = POSTGRES.partition("@")
    try:
        yield f"postgresql+psycopg://{user}@{hostport}/{name}"
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')  # type: ignore[attr-defined]
        admin.close()  # type: ignore[attr-defined]


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Both backends: a SQLite file, and a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'test.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url


@pytest.fixture
def postgres_template() -> Iterator[str]:
    """A database URL template with ``{service}`` for a whole deployment (``esa up
    --database-url-template``): fresh analyzer and shuffler_1..3 databases, dropped afterwards."""
    admin = _admin_or_skip()
    prefix = f"esa_test_{secrets.token_hex(4)}"
    names = [f"{prefix}_{s}" for s in ("analyzer", "shuffler_1", "shuffler_2", "shuffler_3")]
    for name in names:
        admin.execute(f'CREATE DATABASE "{name}"')  # type: ignore[attr-defined]
    user, _, hostport = POSTGRES.partition("@")
    try:
        yield f"postgresql+psycopg://{user}@{hostport}/{prefix}_{{service}}"
    finally:
        for name in names:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')  # type: ignore[attr-defined]
        admin.close()  # type: ignore[attr-defined]


#: Folders whose every test runs real processes or containers.
SYSTEM_FOLDERS = ("e2e", "deploy", "adversary", "faults")
#: Processes started while each test ran (its setup included), by node id.
_STARTED: dict[str, list[str]] = {}
_current: list[str] = []


#: Folders whose tests share one resource of the machine and so run in one pytest-xdist worker:
#: tests/deploy's compose project (one name, fixed subnets), started once for the folder.
SHARED_FOLDERS = ("deploy",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of :data:`SYSTEM_FOLDERS` ``system``."""
    here = Path(__file__).parent
    for item in items:
        folder = Path(item.path).parent
        if folder.parent == here and folder.name in SYSTEM_FOLDERS:
            item.add_marker(pytest.mark.system)


def work_unit(nodeid: str) -> str:
    """What one pytest-xdist worker runs whole, in order (``make test``): a module's tests
    (its fixtures start once; a module may check what its earlier tests recorded), or a whole
    folder of :data:`SHARED_FOLDERS`."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    if len(parts) > 2 and parts[0] == "tests" and parts[1] in SHARED_FOLDERS:
        return "/".join(parts[:2])
    return path


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: pytest runs without it too
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's file scheduling with :func:`work_unit` for a unit (its ``--dist
    loadgroup`` cannot mark groups under pytest 9: it rewrites a node id pytest no longer
    reads), and tests/deploy handed out last: under ``.ci/run`` its images are still being
    built in the background when the run starts (tests/deploy waits for them). Overrides
    ``LoadScopeScheduling._split_scope`` and its ``workqueue``: pyproject pins pytest-xdist."""
    from xdist.scheduler import LoadScopeScheduling

    class DeployLast(OrderedDict[str, Any]):
        def __setitem__(self, key: str, value: Any) -> None:
            super().__setitem__(key, value)
            for shared in SHARED_FOLDERS:
                if f"tests/{shared}" in self:
                    self.move_to_end(f"tests/{shared}")

    class ByWorkUnit(LoadScopeScheduling):
        def __init__(self, config: pytest.Config, log: Any) -> None:
            super().__init__(config, log)
            self.workqueue = DeployLast()

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log)


def _record(what: str) -> None:
    if _current:
        _STARTED.setdefault(_current[0], []).append(what)


def pytest_configure(config: pytest.Config) -> None:
    """Count the processes each test starts: ``subprocess`` (and so asyncio's) and
    ``multiprocessing`` (process pools included)."""
    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start

    def counted_popen(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
        _record(f"subprocess {str(args)[:80]}")
        popen_init(self, args, *rest, **kw)

    def counted_start(self: multiprocessing.process.BaseProcess) -> None:
        _record(f"multiprocessing {self.name}")
        process_start(self)

    subprocess.Popen.__init__ = counted_popen  # type: ignore[assignment, method-assign]
    multiprocessing.process.BaseProcess.start = counted_start  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Attribute what starts during the test's setup, call and teardown to it."""
    _current[:] = [item.nodeid]
    try:
        return (yield)
    finally:
        _current.clear()


@pytest.fixture(autouse=True)
def _tier_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that started a process without the ``system`` mark: the fast tier
    (``make check``) must stay in-process."""
    yield
    started = _STARTED.pop(request.node.nodeid, [])
    if started and request.node.get_closest_marker("system") is None:
        pytest.fail(
            f"this test started {len(started)} process(es) ({started[0]}, ...) but is not "
            "marked system: add @pytest.mark.system (or pytestmark) so make check leaves it out"
        )
