"""Database engines and migrations shared by the shuffler and the analyzer.

SQLite (the embedded default) runs in WAL mode with ``synchronous=FULL``: a committed
transaction is on disk before the service acknowledges it. PostgreSQL (``postgresql+psycopg``)
is the production database. Schemas are managed by alembic; every service runs
``upgrade head`` on start (the pre-start step), after waiting for the database.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.sql.base import Executable

log = logging.getLogger(__name__)

#: Execution option (:func:`binary_rows`): on PostgreSQL
#: through psycopg the statement's rows come in the binary format, so a ``bytea`` column
#: arrives as its bytes instead of hex text (twice its size) that the server encodes and the
#: driver decodes: less CPU on both sides for the big reads, a group's fragments and a batch
#: part's body (benchmarks/postgres_bytea.py). The values are the same Python types. Ignored
#: on SQLite, whose blobs are bytes already.
BINARY_RESULTS = "binary_results"
_Statement = TypeVar("_Statement", bound=Executable)


def make_engine(url: str, busy_timeout: float = 5.0) -> Engine:
    """An engine for ``url``; SQLite files get their directory, WAL and FULL sync, and wait up
    to ``busy_timeout`` seconds for the write lock. Bound parameters never appear in errors or
    logs (``hide_parameters``): a held group's size or a client id is a secret there."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": busy_timeout},
            hide_parameters=True,
        )

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_connection: Any, _: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=FULL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    engine = create_engine(
        url, pool_pre_ping=True, pool_size=10, max_overflow=10, hide_parameters=True
    )
    if engine.dialect.driver == "psycopg":
        event.listen(engine, "before_cursor_execute", _result_format)
    return engine


def binary_rows(statement: _Statement) -> _Statement:
    """``statement`` with :data:`BINARY_RESULTS` set."""
    return statement.execution_options(**{BINARY_RESULTS: True})


def _result_format(
    conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool
) -> None:
    """Ask psycopg for binary rows when the statement's :data:`BINARY_RESULTS` option is set
    (the cursor is the statement's own, so no other statement is affected)."""
    if context is not None and context.execution_options.get(BINARY_RESULTS):
        from psycopg.pq import Format  # the postgres extra; only psycopg engines get here

        cursor.format = Format.BINARY


def wait_for(engine: Engine, timeout: float = 30.0) -> None:
    """Block until the database answers ``SELECT 1`` (raises after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with engine.connect() as connection:
                connection.execute(text("SELECT 1"))
            return
        except OperationalError:
            if time.monotonic() > deadline:
                raise
            log.info("waiting for the database")
            time.sleep(0.5)


def upgrade(engine: Engine, script_location: Path) -> None:
    """Run alembic ``upgrade head`` for one service's migration folder."""
    config = Config()
    config.set_main_option("script_location", str(script_location))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


def is_sqlite(engine: Engine) -> bool:
    """True for the embedded SQLite backend."""
    return engine.dialect.name == "sqlite"


def lock_key(identity: Sequence[Any]) -> int:
    """A signed 64-bit PostgreSQL advisory lock key: BLAKE2b of ``identity`` as JSON."""
    name = json.dumps(list(identity)).encode()
    return int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "big", signed=True)


@contextlib.contextmanager
def try_advisory_lock(engine: Engine, identity: Sequence[Any]) -> Iterator[bool]:
    """Whether this process holds the session advisory lock on ``identity`` for the ``with``
    block (``pg_try_advisory_lock`` on a dedicated autocommit connection, released at the end;
    a process killed meanwhile loses its connection and the lock with it). Always True on
    other databases (SQLite: one process per database)."""
    if engine.dialect.name != "postgresql":
        yield True
        return
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        lock = {"key": lock_key(identity)}
        if not conn.execute(text("SELECT pg_try_advisory_lock(:key)"), lock).scalar_one():
            yield False
            return
        try:
            yield True
        finally:
            try:
                conn.execute(text("SELECT pg_advisory_unlock(:key)"), lock)
            except Exception:  # never hand a pooled connection back still holding it
                conn.invalidate()
                raise
