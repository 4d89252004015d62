"""Shared fixtures: database URLs for SQLite and PostgreSQL.

PostgreSQL is reached at ``ESA_TEST_POSTGRES`` (default ``127.0.0.1:5432``, user postgres,
trust auth). Each test gets a fresh database that is dropped afterwards. Under ``CI=true`` a
missing PostgreSQL is a failure, not a skip (ARCHITECTURE.md).
"""

from __future__ import annotations

import os
import secrets
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
