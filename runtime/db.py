"""Database engines and migrations shared by the shuffler and the analyzer.

SQLite (the embedded default) runs in WAL mode with ``synchronous=FULL``: a committed
transaction is on disk before the service acknowledges it. PostgreSQL (``postgresql+psycopg``)
is the production database. Schemas are managed by alembic; every service runs
``upgrade head`` on start (the pre-start step), after waiting for the database.

:func:`run_tx` is the one way into a read-write transaction (docs/architecture.md, "Storage"):
it retries what the backend says may succeed on a second try and counts every transaction by
its fixed name and outcome (:data:`TRANSACTIONS`, exported as :data:`TRANSACTIONS_METRIC`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from prometheus_client.core import CounterMetricFamily
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, OperationalError
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
_Result = TypeVar("_Result")

#: Attempts :func:`run_tx` makes by default (the first one included).
TX_ATTEMPTS = 3
#: The default backoff: attempt ``k`` (from 1) waits ``k`` times this before the next.
TX_BACKOFF_SECONDS = 0.05
#: PostgreSQL SQLSTATEs that ask for the transaction to be run again: serialization failure
#: and deadlock detected (the server rolled it back; nothing was written).
RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})
#: SQLite's messages for a write lock not granted within the busy timeout (nothing written).
RETRYABLE_SQLITE = ("database is locked", "database table is locked")
#: The Prometheus counter of :data:`TRANSACTIONS`.
TRANSACTIONS_METRIC = "esa_db_transactions"
#: The outcomes :func:`run_tx` counts: an attempt that will be run again is ``retried``.
TX_OUTCOMES = ("committed", "retried", "failed")


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


class TransactionCounts:
    """This process's transactions by (name, outcome): names are fixed strings chosen in the
    code, never data, so the counter's series are bounded and reveal nothing stored."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def count(self, name: str, outcome: str) -> None:
        """One more transaction ``name`` ended with ``outcome`` (one of :data:`TX_OUTCOMES`)."""
        with self._lock:
            self._counts[name, outcome] = self._counts.get((name, outcome), 0) + 1

    def get(self, name: str, outcome: str) -> int:
        """How many transactions ``name`` ended with ``outcome`` so far."""
        with self._lock:
            return self._counts.get((name, outcome), 0)

    def snapshot(self) -> dict[tuple[str, str], int]:
        """A copy of every count so far."""
        with self._lock:
            return dict(self._counts)

    def family(self, prefix: str) -> CounterMetricFamily:
        """:data:`TRANSACTIONS_METRIC` for the names starting with ``prefix`` (a service's
        own stores: one process may run several services in tests)."""
        help_text = "database transactions by name and outcome"
        family = CounterMetricFamily(TRANSACTIONS_METRIC, help_text, labels=["name", "outcome"])
        for (name, outcome), value in sorted(self.snapshot().items()):
            if name.startswith(prefix):
                family.add_metric([name, outcome], value)
        return family


#: The process's transaction counts (:func:`run_tx` adds to it).
TRANSACTIONS = TransactionCounts()


def retryable(error: BaseException) -> bool:
    """Whether the backend says ``error``'s transaction may succeed if run again: PostgreSQL's
    serialization failure or deadlock (:data:`RETRYABLE_SQLSTATES`), SQLite's write lock not
    granted in time (:data:`RETRYABLE_SQLITE`). Nothing else: a unique constraint, a lock
    timeout or a lost connection means something the caller decides about."""
    if not isinstance(error, DBAPIError):
        return False
    orig = error.orig
    if getattr(orig, "sqlstate", None) in RETRYABLE_SQLSTATES:
        return True
    return isinstance(error, OperationalError) and str(orig).startswith(RETRYABLE_SQLITE)


def run_tx(
    engine: Engine,
    name: str,
    fn: Callable[[Connection], _Result],
    *,
    attempts: int = TX_ATTEMPTS,
    retry_on: tuple[type[BaseException], ...] = (),
    backoff: float = TX_BACKOFF_SECONDS,
    lock: contextlib.AbstractContextManager[Any] | None = None,
    counted: bool = True,
) -> _Result:
    """Run ``fn`` in one transaction (``engine.begin()``: committed if it returns, rolled back
    if it raises) and return what it returned; the one way into a read-write transaction
    (Janus's ``Datastore::run_tx``; docs/architecture.md, "Storage").

    A failure :func:`retryable` says may pass, or one of ``retry_on`` (a caller's own, e.g. an
    ``IntegrityError`` that means "run it again, it reads the winner now"), runs ``fn`` again in
    a new transaction, up to ``attempts`` in all, after ``backoff`` times the attempt number;
    ``attempts=1`` runs it once (a body that must not run twice). ``lock`` (e.g. a store's
    writing lock) is held for each attempt. Each attempt is counted in :data:`TRANSACTIONS`
    under ``name`` (a fixed string) unless ``counted`` is False (a shuffler transaction whose
    count would reveal a secret, docs/shuffler.md, "Metrics").

    Raises:
        Exception: ``fn``'s or the commit's error, at once when not retried, else the last.
    """
    for attempt in range(1, attempts + 1):
        try:
            with contextlib.nullcontext() if lock is None else lock, engine.begin() as conn:
                result = fn(conn)
        except Exception as error:
            again = attempt < attempts and (retryable(error) or isinstance(error, retry_on))
            if counted:
                TRANSACTIONS.count(name, "retried" if again else "failed")
            if not again:
                raise
            why = {"transaction": name, "attempt": attempt, "error": type(error).__name__}
            log.info("transaction retried", extra=why)
            time.sleep(backoff * attempt)
            continue
        if counted:
            TRANSACTIONS.count(name, "committed")
        return result
    raise AssertionError("unreachable: the last attempt returns or raises")
